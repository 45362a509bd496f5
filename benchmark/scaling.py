"""How LeanRL scales on one machine: more seeds in one process (`--num-seeds`), more processes
under torchrun. Each case runs its settings back to back per seed, one intra-op thread per
process and nothing pinned (the point is to use the machine), and reports the aggregate env
steps/s of each setting over the first one's, per seed. Usage: `./run.sh --scaling --help`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the runner is the speed benchmark's)

# case -> (lean script, shared arguments, settings as (label, launcher, extra arguments)). Budgets
# hold several log points after warm-up at the largest setting; --total-timesteps is per seed.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
SEEDS = [(f"{n} seeds", [], ["--num-seeds", str(n)]) for n in (1, 8)] + [
    ("8 seeds, 2 threads", [], ["--num-seeds", "8", "--threads", "2"])
]
CASES = {
    "dqn --num-seeds": ("dqn", ["--compile", "--learning-starts", "1000", "--total-timesteps", "12000"], SEEDS),
    "pqn --num-seeds": ("pqn", ["--compile", "--total-timesteps", "51200"], SEEDS),
    "pqn_torchenv --num-seeds": ("pqn_torchenv", ["--compile", "--total-timesteps", "51200"], SEEDS),
    "ppo --num-seeds": ("ppo", ["--compile", "--total-timesteps", "51200"], SEEDS),
    "ppo_continuous_action --num-seeds": ("ppo_continuous_action", ["--compile", "--total-timesteps", "8192"], SEEDS),
    "ppo_atari_envpool --num-seeds": (
        "ppo_atari_envpool",
        ["--compile", "--total-timesteps", "8192"],
        [(f"{n} seeds", [], ["--num-seeds", str(n)]) for n in (1, 4)],
    ),
    "ppo_atari_envpool torchrun": (
        "ppo_atari_envpool",
        ["--compile", "--total-timesteps", "8192"],
        [(f"{k} ranks", [*TORCHRUN, "--nproc_per_node", str(k)], []) for k in (1, 2)],
    ),
}


def run(script, launcher, argv, log, timeout):
    """One run (python, or a launcher such as torchrun): its summary, or None if it failed."""
    env = {**os.environ, **bench.ONE_THREAD, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    with open(log, "w") as err:
        try:
            proc = subprocess.run(
                [*(launcher or [sys.executable]), str(script), *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=log.parent,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if proc.returncode == 0 and lines and json.loads(lines[-1]).get("sps") else None


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="run.sh --scaling", description="Aggregate steps/s with more seeds per process and more processes."
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(CASES),
        choices=list(CASES),
        metavar="CASE",
        help=f"cases (default: all): {'; '.join(CASES)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench_results/scaling-<time>)")
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args(argv)
    out = (args.out or bench.ROOT / "bench_results" / f"scaling-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        for case in args.cases:
            family, shared, settings = CASES[case]
            for label, launcher, extra in settings:
                log = out / "logs" / f"{family}__{label.replace(' ', '').replace(',', '_')}__seed{seed}.log"
                summary = run(
                    bench.SCRIPTS / f"{family}_torchcompile.py",
                    launcher,
                    [*shared, *extra, "--seed", str(seed)],
                    log,
                    args.timeout,
                )
                print(
                    f"{case}, {label}, seed {seed}: "
                    + (f"{summary['sps']:,.0f} steps/s" if summary else f"failed: see {log}"),
                    flush=True,
                )
                results.setdefault((case, label), {})[seed] = summary and summary["sps"]
    info = bench.machine()
    rows = [
        f"Machine: {info['cpu']}, {info['cores']} cores, GPU: {info['gpu'] or 'none'}; torch {info['torch']}. "
        f"Command: `./run.sh --scaling {' '.join(argv if argv is not None else sys.argv[1:])}`.".replace("  ", " "),
        "",
        "| case | setting | steps/s, all seeds or ranks (median) | over the first setting, per seed (median) | min-max |",
        "|---|---|---:|---:|---:|",
    ]
    for case in args.cases:
        base = results.get((case, CASES[case][2][0][0]), {})
        for label, _, _ in CASES[case][2]:
            got = {s: v for s, v in results.get((case, label), {}).items() if v}
            ratios = [v / base[s] for s, v in got.items() if base.get(s)]
            cols = [case, label, f"{statistics.median(got.values()):,.0f}" if got else "failed"]
            cols += [f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}"] if ratios else ["", ""]
            rows.append("| " + " | ".join(cols) + " |")
    table = "\n".join(rows) + "\n"
    (out / "table.md").write_text(table)
    print(table)
    return 0 if all(v for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The LeanRL benchmark: each plain script against its lean twin in every mode, over seeds.

A family is a plain script in leanrl/ with a `_torchcompile` twin. For each seed, the plain
script runs, then the lean one in each mode (eager, compile, cudagraphs, compile+cudagraphs),
with the same hyper-parameters and budget. It writes `results.jsonl` (one summary per
run), `table.md` (median steps/s per cell, paired speed-ups, ceilings) and one PNG per family.
Without CUDA the cudagraphs modes are reported as n/a, never run as something else.
Method: benchmark/RESULTS.md. Usage: `./run.sh --help`.
"""

import argparse
import contextlib
import csv
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import arithmetic_ceiling, env_ceiling  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"
# One intra-op thread for every run: the networks here are too small for a second thread to
# pay, and beside any other process OpenMP's spinning threads stall (a 0.7 ms PPO minibatch
# took 46 ms with two threads beside one busy process).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MODES = {
    "eager": [],
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}

# Per family: the env, the arguments every mode shares and the total env steps per profile:
# "quick" runs the whole benchmark in minutes (the README's table), "full" over longer budgets,
# "tiny" is for the benchmark's own test. `arith`: the plain script's arguments for the short run
# whose matmuls and convolutions the arithmetic ceiling replays, and the env steps that run trains
# on. A family missing here is no error: it runs with DEFAULT, its script's own env and defaults,
# and gets no ceilings.
DEFAULT = dict(
    env_id=None,
    num_envs=1,
    args=[],
    budget=dict(full=20000, quick=5000, tiny=256),
    tiny_args=[],
    arith=None,
    envpool=False,
    torch_env=False,
)
# off-policy: 300 training steps after 256 acting ones (their single-row forwards are recorded too,
# well under 1% of the replay time)
OFF_POLICY_ARITH = dict(args=["--learning-starts", "256", "--total-timesteps", "556"], steps=300)
# SAC and TD3: quick makes 300 updates after learning starts
MUJOCO_OFF_POLICY = dict(
    env_id="HalfCheetah-v5",
    args=["--learning-starts", "1000"],
    budget=dict(full=7000, quick=1300, tiny=200),
    tiny_args=["--env-id", "Pendulum-v1", "--learning-starts", "64", "--batch-size", "32"],
    arith=OFF_POLICY_ARITH,
)
FAMILIES = {
    # PPO: iterations of 2048 steps, the first of them warm-up; quick times two
    "ppo_continuous_action": dict(
        env_id="HalfCheetah-v5",
        args=["--num-steps", "2048"],
        budget=dict(full=22528, quick=6144, tiny=256),
        tiny_args=["--env-id", "InvertedPendulum-v5", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
        arith=dict(args=["--num-steps", "2048", "--total-timesteps", "4096"], steps=4096),
    ),
    "sac_continuous_action": MUJOCO_OFF_POLICY,
    "td3_continuous_action": MUJOCO_OFF_POLICY,
    "dqn": dict(
        env_id="CartPole-v1",
        args=["--learning-starts", "1000"],
        budget=dict(full=20000, quick=12000, tiny=300),
        tiny_args=["--learning-starts", "100", "--batch-size", "32"],
        arith=OFF_POLICY_ARITH,
    ),
    # Atari DQN: CleanRL's one env; quick makes 250 updates after learning starts (a smaller buffer:
    # the steps fill 1,000 rows of it)
    "dqn_atari_envpool": dict(
        env_id="Breakout-v5",
        envpool=True,
        args=["--learning-starts", "1000", "--buffer-size", "100000"],
        budget=dict(full=6000, quick=2000, tiny=300),
        tiny_args=["--num-envs", "2", "--learning-starts", "100", "--buffer-size", "200"],
        arith=dict(args=["--learning-starts", "256", "--total-timesteps", "556", "--buffer-size", "10000"], steps=300),
    ),
    # Atari PPO: iterations of 8 x 128 steps, the first of them warm-up
    "ppo_atari_envpool": dict(
        env_id="Breakout-v5",
        num_envs=8,
        envpool=True,
        budget=dict(full=12288, quick=2048, tiny=64),
        tiny_args=["--num-envs", "2", "--num-steps", "16"],
        arith=dict(args=["--total-timesteps", "2048"], steps=2048),
    ),
    # PPO discrete: iterations of 4 x 128 steps, the first of them warm-up
    "ppo": dict(
        env_id="CartPole-v1",
        num_envs=4,
        budget=dict(full=102400, quick=20480, tiny=512),
        tiny_args=["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
        arith=dict(args=["--total-timesteps", "1024"], steps=1024),
    ),
    # PPO discrete on torch-native envs: as "ppo". Its env ceiling steps the torch-native CartPole
    # compiled, `torch_env` (benchmark/ceilings.py).
    "ppo_torchenv": dict(
        env_id="CartPole-v1",
        torch_env=True,
        num_envs=4,
        budget=dict(full=102400, quick=20480, tiny=512),
        tiny_args=["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
        arith=dict(args=["--total-timesteps", "1024"], steps=1024),
    ),
    # PQN: iterations of 4 x 128 steps, the first of them warm-up
    "pqn": dict(
        env_id="CartPole-v1",
        num_envs=4,
        budget=dict(full=102400, quick=20480, tiny=512),
        tiny_args=["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
        arith=dict(args=["--total-timesteps", "1024"], steps=1024),
    ),
    # PQN on the torch-native CartPole: as "pqn"; the env ceiling as "ppo_torchenv"'s.
    "pqn_torchenv": dict(
        env_id="CartPole-v1",
        torch_env=True,
        num_envs=4,
        budget=dict(full=102400, quick=20480, tiny=512),
        tiny_args=["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
    ),
    # Atari PQN: iterations of 8 x 128 steps, the first of them warm-up
    "pqn_atari_envpool": dict(
        env_id="Breakout-v5",
        num_envs=8,
        envpool=True,
        budget=dict(full=12288, quick=2048, tiny=64),
        tiny_args=["--num-envs", "2", "--num-steps", "16"],
        arith=dict(args=["--total-timesteps", "2048"], steps=2048),
    ),
}


def families():
    """Every plain script in leanrl/ that has a `_torchcompile` twin, found by glob."""
    return sorted(
        p.stem.removesuffix("_torchcompile")
        for p in SCRIPTS.glob("*_torchcompile.py")
        if (SCRIPTS / p.name.replace("_torchcompile", "")).exists()
    )


def config(family):
    return {**DEFAULT, **FAMILIES.get(family, {})}


def machine():
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version()}


def plan(fams, seeds, profile, cuda, steps=None):
    """The runs, (family, script, mode, seed, argv), and the cudagraphs cells skipped without
    CUDA, (family, script, mode). Seeds are the outer loop so a slow stretch of a shared host hits
    one seed of every cell rather than every seed of one cell; the plain run and the lean runs of
    one seed stay back to back, so that their ratio (the paired speed-up) shares the host's state."""
    runs, skipped = [], []
    for seed in seeds:
        for fam in fams:
            cfg = config(fam)
            shared = (
                cfg["tiny_args"] if profile == "tiny" else (["--env-id", cfg["env_id"]] if cfg["env_id"] else []) + cfg["args"]
            )
            base = ["--total-timesteps", str(steps or cfg["budget"][profile]), *shared, "--seed", str(seed)]
            lean = SCRIPTS / f"{fam}_torchcompile.py"
            runs.append((fam, SCRIPTS / f"{fam}.py", "plain", seed, base))
            for mode, flags in MODES.items():
                if "cudagraphs" in mode and not cuda:
                    if seed == seeds[0]:
                        skipped.append((fam, lean, mode))
                    continue
                runs.append((fam, lean, mode, seed, [*base, *flags]))
    return runs, skipped


def read_curve(summary, cwd):
    """The run's learning curve as (step, seconds, return) rows: from `<run_dir>/curve.csv`
    (relative to the run's cwd), else from an older script's `curve` field, else empty."""
    path = Path(cwd) / str(summary.get("run_dir")) / "curve.csv"
    if not (summary.get("run_dir") and path.exists()):
        return [list(p) for p in summary.get("curve") or []]
    with open(path, newline="") as f:
        rows = [[row.get(k) for k in ("step", "seconds", "episodic_return")] for row in csv.DictReader(f)]
    rows = [list(map(float, row)) for row in rows if all(row)]  # rows before the first episode may have no return
    return rows[:: max(1, len(rows) // 200)]  # enough points for a plot; results.jsonl stays small


def run_one(script, argv, log, timeout, timed=True, cache=None):
    """Run one script with one thread, in the log's folder; return its summary (the last stdout
    line that is a JSON object) with its curve, or None if it failed, timed out or (`timed`) ran
    too short to be timed. `cache`: the folder of torch.compile's caches for this run."""
    env = {**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    with open(log, "w") as err:
        # its own process group, so that a timeout or Ctrl-C also stops anything it started
        proc = subprocess.Popen(
            [sys.executable, str(script), *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )
        try:
            stdout = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            return None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None
    summary = json.loads(lines[-1])
    if timed and summary.get("sps") is None:  # a budget too small to time after warm-up
        return None
    return {**summary, "curve": read_curve(summary, log.parent)}


def ceilings_of(fams, work_dir):
    """The env ceiling of every family with an env in FAMILIES, and the arithmetic ceiling of the
    families with an `arith` run. Families on the same env and number of envs share one measurement."""
    ceilings, env_measured = {}, {}
    for fam in fams:
        cfg = config(fam)
        print(f"ceiling: {fam} ({cfg['env_id'] or 'not in FAMILIES: no env to measure'})", flush=True)
        if not cfg["env_id"]:
            continue
        key = (cfg["env_id"], cfg["num_envs"], cfg["torch_env"])
        if key not in env_measured:
            env_measured[key] = env_ceiling(*key[:2], envpool_env=cfg["envpool"], torch_env=cfg["torch_env"])
        ceilings[fam] = {"env": env_measured[key]}
        if cfg["arith"]:
            argv = cfg["arith"]["args"] + (["--env-id", cfg["env_id"]] if cfg["env_id"] else [])
            try:
                ceilings[fam]["arith"] = arithmetic_ceiling(SCRIPTS / f"{fam}.py", argv, cfg["arith"]["steps"], work_dir)
            except subprocess.CalledProcessError as e:
                print(f"  arithmetic ceiling failed: {(e.stderr or '').strip().splitlines()[-1:]}", flush=True)
    return ceilings


def duration(seconds):
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def run_all(runs, out, timeout):
    """Run the plan in order with a progress line; append each summary to results.jsonl. Each
    (script, mode) cell has a compile cache of its own, empty before its first seed: the first
    seed's warm-up is cold (everything compiled), the others' warm (inductor's caches hit)."""
    results, start, cold = [], time.perf_counter(), set()
    with open(out / "results.jsonl", "w") as sink:
        for i, (fam, script, mode, seed, argv) in enumerate(runs, 1):
            elapsed = time.perf_counter() - start
            eta = f", about {duration(elapsed / (i - 1) * (len(runs) - i + 1))} left" if i > 1 else ""
            print(f"[{i}/{len(runs)}] {script.name} {mode} seed {seed} (elapsed {duration(elapsed)}{eta})", flush=True)
            log = out / "logs" / f"{script.stem}__{mode}__seed{seed}.log"
            summary = run_one(script, argv, log, timeout, cache=out / "compile_cache" / f"{script.stem}__{mode}")
            if summary is None:
                print(f"  failed: see {log}", flush=True)
                continue
            record = {"family": fam, "mode": mode, **summary, "cold": (script, mode) not in cold}
            cold.add((script, mode))
            results.append(record)
            print(json.dumps(record), file=sink, flush=True)
            print(
                f"  {summary['sps']:,.0f} steps/s after warm-up, warm-up {summary.get('warmup_s') or 0:.1f} s, "
                f"return {summary.get('episodic_return')}",
                flush=True,
            )
    return results


def by_cell(results):
    """The records grouped by cell, (family, mode), in the order they first appear."""
    cells = {}
    for r in results:
        cells.setdefault((r["family"], r["mode"]), []).append(r)
    return cells


def paired_ratios(cell, plain):
    """Per seed, a run's steps/s over the plain run of the same seed (run just before it, on the
    same core): the host's slow and fast stretches hit both, so the ratio cancels most of them."""
    plain_sps = {r["seed"]: r["sps"] for r in plain}
    return [r["sps"] / plain_sps[r["seed"]] for r in cell if plain_sps.get(r["seed"])]


def of_cell(cell, key, fmt, reduce=statistics.median):
    """A summary field reduced over a cell's runs (those that have it), formatted; "" if none has."""
    values = [r[key] for r in cell if r.get(key) is not None]
    return format(reduce(values), fmt) if values else ""


def summarize(results, skipped, ceilings, info):
    """The Markdown table: per family and mode, the median steps/s over seeds and its min-max,
    and the median over seeds of the paired ratio lean/plain with its min-max."""
    rows = [
        f"Machine: {info['cpu']}, {info['cores']} cores, GPU: {info['gpu'] or 'none'}; "
        f"torch {info['torch']}, Python {info['python']}.",
        f"Command: `{info['command']}` (profile `{info['profile']}`, seeds {info['seeds']}).",
        "",
        "| algorithm | script | mode | steps/s (median) | min-max | vs plain (median) | vs plain min-max | of env ceiling "
        "| of arithmetic ceiling | warm-up s cold | warm-up s warm | peak RSS MB | return (median) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells, na = by_cell(results), {(fam, mode) for fam, _, mode in skipped}
    for fam in dict.fromkeys(r["family"] for r in results):
        ceil = ceilings.get(fam, {})
        for mode in ["plain", *MODES]:
            cell = cells.get((fam, mode))
            if (fam, mode) in na:
                rows.append(f"| {fam} | {fam}_torchcompile.py | {mode} | n/a (needs CUDA) | | | | | | | | | |")
            elif cell:
                sps = [r["sps"] for r in cell]
                med = statistics.median(sps)
                ratios = paired_ratios(cell, cells.get((fam, "plain"), []))
                cols = [fam, cell[0]["script"], mode, f"{med:,.0f}", f"{min(sps):,.0f}-{max(sps):,.0f}"]
                cols += [f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}"] if ratios else ["", ""]
                cols += [f"{med / ceil[c]['sps']:.0%}" if c in ceil else "" for c in ("env", "arith")]
                cols += [
                    of_cell([r for r in cell if r.get("cold")], "warmup_s", ".1f"),
                    of_cell([r for r in cell if not r.get("cold")], "warmup_s", ".1f"),
                ]
                cols += [of_cell(cell, "peak_rss_mb", ",.0f", max), of_cell(cell, "episodic_return", ".1f")]
                rows.append("| " + " | ".join(cols) + " |")
    rows += [
        "",
        "steps/s: after warm-up, one thread, pinned to one core; median and min-max over seeds. "
        "warm-up: seconds to the first log point with 3 updates done; cold: the first seed, with empty compile caches; "
        "warm: the median of the other seeds, whose compiles hit the caches. "
        "vs plain: per seed, the run's steps/s over the plain script's run of that seed (run just before it); "
        "the median and min-max of those ratios.",
    ]
    rows += ["", "Ceilings (steps/s):", ""] if ceilings else []
    for fam, ceil in ceilings.items():
        cfg, a = config(fam), ceil.get("arith")
        env = f"{cfg['env_id']}{' torch-native, compiled' if cfg['torch_env'] else ''}, {cfg['num_envs']} env"
        rows.append(
            f"- {fam}: env alone {ceil['env']['sps']:,.0f} ({env}, random actions)"
            + (
                f"; dense ops alone {a['sps']:,.0f} ({a['gflop_per_step']:.3g} GFLOP per step at {a['gflops']:.0f} GFLOP/s)"
                if a
                else ""
            )
        )
    return "\n".join(rows) + "\n"


def plot(results, out_dir):
    """Per family: steps/s per mode (bar: median, whiskers: min-max over seeds), and each run's
    return against wall-clock seconds and against env steps (a faster mode should learn alike per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for fam in dict.fromkeys(r["family"] for r in results):
        cells = {mode: cell for (f, mode), cell in by_cell(results).items() if f == fam}
        sps = [[r["sps"] for r in cell] for cell in cells.values()]
        meds = [statistics.median(v) for v in sps]
        err = [[m - min(v) for m, v in zip(meds, sps)], [max(v) - m for m, v in zip(meds, sps)]]
        colors = ["grey" if mode == "plain" else f"C{i}" for i, mode in enumerate(cells)]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        axes[0].bar(list(cells), meds, yerr=err, capsize=4, color=colors)
        axes[0].set(ylabel="steps/s after warm-up", title=f"{fam}: speed")
        axes[0].tick_params(axis="x", rotation=20)
        for color, (mode, cell) in zip(colors, cells.items()):
            for j, r in enumerate(r for r in cell if r.get("curve")):
                steps, secs, rets = zip(*r["curve"])
                axes[1].plot(secs, rets, color=color, alpha=0.8, label=None if j else mode)
                axes[2].plot(steps, rets, color=color, alpha=0.8, label=None if j else mode)
        for ax, x in zip(axes[1:], ("wall-clock seconds", "env steps")):
            ax.set(xlabel=x, ylabel="episodic return", title=f"return against {x.split()[-1]}")
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"{fam}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def main(argv=None):
    known = families()
    parser = argparse.ArgumentParser(
        prog="run.sh", description="Benchmark LeanRL: each plain script against its lean twin in every mode, over seeds."
    )
    parser.add_argument(
        "--profile", choices=["quick", "full", "tiny"], default="full", help="budget per run (FAMILIES in benchmark/bench.py)"
    )
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="same as --profile quick")
    parser.add_argument(
        "--scripts",
        nargs="+",
        default=known,
        choices=known,
        metavar="FAMILY",
        help=f"families to run (default: all): {', '.join(known)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default: 1 2 3 4 5; 1 for tiny)")
    parser.add_argument("--steps", type=int, default=None, help="total env steps of every run, instead of the profile's")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench_results/<profile>-<time>)")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the env and arithmetic ceilings")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before one run is abandoned")
    args = parser.parse_args(argv)

    import torch

    seeds = args.seeds or ([1] if args.profile == "tiny" else [1, 2, 3, 4, 5])
    out = (args.out or ROOT / "bench_results" / f"{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    info = {
        **machine(),
        "profile": args.profile,
        "seeds": seeds,
        "command": "./run.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    runs, skipped = plan(args.scripts, seeds, args.profile, torch.cuda.is_available(), args.steps)
    for fam, script, mode in skipped:
        print(f"n/a: {script.name} {mode} needs CUDA; reported as not applicable", flush=True)
    # Runs and ceilings on one core (the last this process may use), which the runs inherit: a run
    # never migrates between cores of different speed, and a lean run and its plain pair share it.
    # The harness itself mostly waits on the run's output. Restored after, for callers in-process.
    pin = os.sched_setaffinity if hasattr(os, "sched_setaffinity") else lambda pid, cores: None  # Linux only
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}
    pin(0, {max(before)})
    start = time.perf_counter()
    try:
        results = run_all(runs, out, args.timeout)
        ceilings = {} if args.no_ceilings or args.profile == "tiny" else ceilings_of(args.scripts, out / "logs")
    finally:
        pin(0, before)
    (out / "ceilings.json").write_text(json.dumps({"machine": info, "ceilings": ceilings}, indent=1))
    table = summarize(results, skipped, ceilings, info)
    (out / "table.md").write_text(table)
    plots = plot(results, out) if results else []
    print(table)
    print(f"results: {out / 'results.jsonl'}; table: {out / 'table.md'}; plots: {', '.join(p.name for p in plots)}")
    print(f"done in {duration(time.perf_counter() - start)}")
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())

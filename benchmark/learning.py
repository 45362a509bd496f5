"""The LeanRL learning profile: does each lean script learn as well as its plain twin?

For every pair, the plain script and the lean one (`--compile`) train over the same seeds, on a
task and budget where the curve is still rising, interleaved (per seed: plain, then lean) with one
thread per run. It writes `results.jsonl` (one summary and curve per run), `table.md` (final
returns, the lean-minus-plain difference and its 95% bootstrap interval) and `learning.png` (return
against env steps per pair: mean over seeds and the min-max band, plain and lean overlaid).
Learning is not timed, so runs go `--jobs` at a time. Usage: `./run.sh --learning --help`.
"""

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the runner and the curve reader are the speed benchmark's)

# Per pair and profile: the arguments both scripts share and the env steps per run. "full" is a
# budget where the curve still rises on a task that is not saturated; "quick" runs all pairs over
# 3 seeds in about an hour on 2 cores (Breakout DQN half of it), where the smaller budgets show the start of learning.
PAIRS = {
    "ppo_continuous_action": dict(
        full=(["--env-id", "HalfCheetah-v5"], 300_000), quick=(["--env-id", "HalfCheetah-v5"], 40_960)
    ),
    "sac_continuous_action": dict(
        full=(["--env-id", "HalfCheetah-v5"], 100_000), quick=(["--env-id", "Pendulum-v1", "--learning-starts", "1000"], 5_000)
    ),
    "td3_continuous_action": dict(
        full=(["--env-id", "HalfCheetah-v5"], 100_000), quick=(["--env-id", "Pendulum-v1", "--learning-starts", "1000"], 5_000)
    ),
    "ppo": dict(full=([], 500_000), quick=([], 100_000)),
    "ppo_torchenv": dict(full=([], 500_000), quick=([], 100_000)),
    "dqn": dict(full=([], 500_000), quick=([], 100_000)),
    "pqn": dict(full=([], 500_000), quick=([], 100_000)),
    "pqn_torchenv": dict(full=([], 500_000), quick=([], 100_000)),
    # Breakout DQN on a CPU: learning starts at 5,000 (CleanRL: 80,000 of 10M steps); 50k steps take
    # 11-32 minutes a run on 2 cores, where the return leaves random play's 0.5-1.9 for 3.3-6.6
    "dqn_atari_envpool": dict(
        full=(["--learning-starts", "5000", "--buffer-size", "100000"], 50_000),
        quick=(["--learning-starts", "2000", "--buffer-size", "100000"], 20_000),
    ),
    "ppo_atari_envpool": dict(full=([], 200_000), quick=([], 10_240)),
    "pqn_atari_envpool": dict(full=([], 200_000), quick=([], 10_240)),
}
SEEDS = dict(full=[1, 2, 3, 4, 5], quick=[1, 2, 3])
SIDES = {"plain": ("{}.py", []), "lean": ("{}_torchcompile.py", ["--compile"])}


def plan(pairs, seeds, profile, steps=None, sides=tuple(SIDES)):
    """(pair, side, seed, script, argv), seeds outer, so that a stopped profile has every pair."""
    runs = []
    for seed in seeds:
        for pair in pairs:
            args, budget = PAIRS[pair][profile]
            for side in sides:
                name, flags = SIDES[side]
                argv = ["--total-timesteps", str(steps or budget), *args, "--seed", str(seed), *flags]
                runs.append((pair, side, seed, bench.SCRIPTS / name.format(pair), argv))
    return runs


def run_all(runs, out, jobs, timeout):
    """Run the plan, `jobs` at a time, each run's log in out/logs; their summaries (with curves)."""
    start, done = time.perf_counter(), []
    (out / "logs").mkdir(exist_ok=True)

    def one(run):
        pair, side, seed, script, argv = run
        log = out / "logs" / f"{pair}__{side}__seed{seed}.log"
        summary = bench.run_one(script, argv, log, timeout, timed=False)
        status = "failed: see " + str(log) if summary is None else f"return {summary.get('episodic_return')}"
        print(
            f"[{len(done) + 1}/{len(runs)}] {pair} {side} seed {seed}: {status} "
            f"({bench.duration(time.perf_counter() - start)})",
            flush=True,
        )
        done.append(run)
        return None if summary is None else {"pair": pair, "side": side, **summary}

    with ThreadPoolExecutor(jobs) as pool:
        return [r for r in pool.map(one, runs) if r]


def parser_error(message):
    """Bad input: one line on stderr, exit status 2, as the scripts do."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def merge(folders):
    """The runs of several earlier profiles as one list, and how many were replaced: a run found
    in several folders (same pair, side and seed) is taken from the last one, so that runs redone
    after a change replace the old ones. A pair run on two tasks or budgets, or a folder without
    results.jsonl, ends with one line."""
    runs, task, read = {}, {}, 0
    for folder in folders:
        path = folder / "results.jsonl"
        if not path.is_file():
            parser_error(f"{path} does not exist: pass folders that ./run.sh --learning --out wrote")
        for line in path.read_text().splitlines():
            r = json.loads(line)
            first = task.setdefault(r["pair"], (r["env_id"], r["total_steps"], folder))
            if first[:2] != (r["env_id"], r["total_steps"]):
                parser_error(
                    f"{r['pair']} ran {first[0]} for {first[1]:,} steps in {first[2]} and {r['env_id']} for "
                    f"{r['total_steps']:,} in {folder}: merge runs of one profile"
                )
            runs[(r["pair"], r["side"], r["seed"])] = r
            read += 1
    return list(runs.values()), read - len(runs)


def machines_of(folders):
    """Where the parts ran, from the first line of each part's table.md ("" if none says)."""
    found = []
    for folder in folders:
        table = folder / "table.md"
        head = table.read_text().split("\n", 1)[0] if table.is_file() else ""
        if head.startswith("Machine: ") and "; torch" in head:
            found += head[len("Machine: ") : head.index("; torch")].split(" and ")
    return " and ".join(dict.fromkeys(found))


def profile_of(results):
    """The profile whose budgets the merged runs used (per pair, the nearer one)."""
    found = {min(PAIRS[r["pair"]], key=lambda p: abs(PAIRS[r["pair"]][p][1] - r["total_steps"])) for r in results}
    return "+".join(sorted(found)) or "none"


def bootstrap_interval(a, b, resamples=10_000, seed=0):
    """95% percentile-bootstrap interval of mean(b) - mean(a), resampling each side's seeds."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, float), np.asarray(b, float)
    diffs = rng.choice(b, (resamples, len(b))).mean(1) - rng.choice(a, (resamples, len(a))).mean(1)
    return tuple(np.percentile(diffs, [2.5, 97.5]))


def finals(results, pair, side):
    """Each seed's final return (mean of its last 10 episodes), in seed order."""
    runs = sorted((r for r in results if r["pair"] == pair and r["side"] == side), key=lambda r: r["seed"])
    return [r["episodic_return"] for r in runs if r.get("episodic_return") is not None]


def seed_ranges(seeds):
    """Seeds as ranges, in order: [1, 2, 3, 5, 7, 8] -> "1-3, 5, 7-8"."""
    spans = []
    for seed in sorted(set(seeds)):
        if spans and seed == spans[-1][1] + 1:
            spans[-1][1] = seed
        else:
            spans.append([seed, seed])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def seeds_arg(text):
    """A --seeds value: a seed (5) or a range of them (1-180)."""
    found = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not found or int(found[2] or found[1]) < int(found[1]):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a seed nor a range of seeds such as 1-5")
    return list(range(int(found[1]), int(found[2] or found[1]) + 1))


def seed_groups(results):
    """The seeds run, as ranges, and the pairs run on them: "1-15 (dqn, ppo); 1-180 (pqn)"."""
    groups = {}
    for pair in dict.fromkeys(r["pair"] for r in results):
        groups.setdefault(seed_ranges(r["seed"] for r in results if r["pair"] == pair), []).append(pair)
    if len(groups) == 1:
        return f"{next(iter(groups))} (every pair run)"
    return "; ".join(f"{seeds} ({', '.join(pairs)})" for seeds, pairs in groups.items())


def summarize(results, info):
    rows = [
        f"Machine: {info['host']}; torch {info['torch']}.",
        f"Command: {info['command']} (profile `{info['profile']}`, {info['wall']}).",
        f"Seeds: {seed_groups(results) if results else 'none'}.",
        "",
        "| pair | env | steps | plain (mean ± sd) | lean --compile (mean ± sd) | lean - plain | 95% interval | same? |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for pair in dict.fromkeys(r["pair"] for r in results):
        plain, lean = finals(results, pair, "plain"), finals(results, pair, "lean")
        first = next(r for r in results if r["pair"] == pair)
        cols = [pair, first["env_id"], f"{first['total_steps']:,}"]
        cols += [
            f"{np.mean(v):.1f} ± {np.std(v, ddof=1) if len(v) > 1 else 0:.1f} (n={len(v)})" if v else "" for v in (plain, lean)
        ]
        if len(plain) > 1 and len(lean) > 1:
            lo, hi = bootstrap_interval(plain, lean)
            cols += [f"{np.mean(lean) - np.mean(plain):+.1f}", f"[{lo:+.1f}, {hi:+.1f}]", "yes" if lo <= 0 <= hi else "**no**"]
        else:
            cols += ["", "", "too few seeds"]
        rows.append("| " + " | ".join(cols) + " |")
    rows += [
        "",
        "Final return: a run's mean over its last 10 episodes. 95% interval: percentile bootstrap of the "
        "difference of the means over seeds (10,000 resamples). same?: the interval holds 0.",
    ]
    return "\n".join(rows) + "\n"


def plot(results, path):
    """Return against env steps per pair: mean over seeds and the min-max band, plain and lean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(dict.fromkeys(r["pair"] for r in results))
    cols = min(4, len(pairs))
    fig, axes = plt.subplots(-(-len(pairs) // cols), cols, figsize=(4.2 * cols, 3.6 * -(-len(pairs) // cols)), squeeze=False)
    for ax in axes.flat[len(pairs) :]:
        ax.axis("off")
    for ax, pair in zip(axes.flat, pairs):
        for color, side in (("grey", "plain"), ("C0", "lean")):
            curves = [np.asarray(r["curve"]) for r in results if r["pair"] == pair and r["side"] == side and r["curve"]]
            if not curves:
                continue
            grid = np.linspace(max(c[0, 0] for c in curves), min(c[-1, 0] for c in curves), 100)
            ys = np.stack([np.interp(grid, c[:, 0], c[:, 2]) for c in curves])
            ax.plot(grid, ys.mean(0), color=color, label=f"{side} ({len(curves)} seeds)")
            ax.fill_between(grid, ys.min(0), ys.max(0), color=color, alpha=0.2)
        first = next(r for r in results if r["pair"] == pair)
        ax.set(title=f"{pair}\n{first['env_id']}", xlabel="env steps", ylabel="episodic return")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def command(args, seeds, out):
    """The command that makes the table again from what the repository holds: the run's options
    that change results, seeds as ranges, and --out where it lies in the repository. A merge's
    parts lie outside it: each seed group of the table's Seeds line is run, then merged."""
    where = f" --out {out.relative_to(bench.ROOT)}" if out.is_relative_to(bench.ROOT) else ""
    if args.merge:
        return (
            "each seed group below as `./run.sh --learning --pairs PAIRS --seeds SEEDS --out DIR`, "
            f"then `./run.sh --learning --merge DIR...{where}`"
        )
    words = ["./run.sh --learning", "--quick" if args.quick else ""]
    words += ["--pairs " + " ".join(args.pairs) if args.pairs != list(PAIRS) else ""]
    words += ["--seeds " + seed_ranges(seeds).replace(",", ""), f"--steps {args.steps}" if args.steps else ""]
    words += ["--sides " + " ".join(args.sides) if args.sides != list(SIDES) else "", where.strip()]
    return "`" + " ".join(w for w in words if w) + "`"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="run.sh --learning", description="Plain against lean --compile: learning curves and final returns over seeds."
    )
    parser.add_argument("--quick", action="store_true", help="3 seeds, short budgets: about an hour on 2 cores")
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=list(PAIRS),
        choices=list(PAIRS),
        metavar="PAIR",
        help=f"pairs to run (default: all): {', '.join(PAIRS)}",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=seeds_arg,
        default=None,
        help="seeds or ranges such as 1-5 (default: 1-5, or 1-3 with --quick)",
    )
    parser.add_argument("--steps", type=int, default=None, help="env steps of every run, instead of the profile's")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES), help="plain, lean or both (default)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each (default 2)")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: bench_results/learning-<profile>-<time>)"
    )
    parser.add_argument("--timeout", type=int, default=6 * 3600, help="seconds before one run is abandoned")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: one table and plot from the results.jsonl of earlier --out folders (seeds run in parts); "
        "a run in several folders is taken from the last",
    )
    args = parser.parse_args(argv)
    if args.merge and (args.quick or args.seeds or args.steps or args.pairs != list(PAIRS) or args.sides != list(SIDES)):
        parser_error(
            "--merge runs nothing: drop --quick, --pairs, --seeds, --steps and --sides (the parts' runs are all merged)"
        )
    profile = "quick" if args.quick else "full"
    seeds = sorted({s for seeds in args.seeds for s in seeds}) if args.seeds else SEEDS[profile]
    out = (args.out or bench.ROOT / "bench_results" / f"learning-{profile}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.merge:
        results, replaced = merge(args.merge)
        seeds, wall = sorted({r["seed"] for r in results}), f"{len(args.merge)} folders merged"
        wall += f"; runs redone in a later folder and taken from it: {replaced}" if replaced else ""
        profile = profile_of(results)
    else:
        results = run_all(plan(args.pairs, seeds, profile, args.steps, args.sides), out, args.jobs, args.timeout)
        wall = bench.duration(time.perf_counter() - start)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    info = {**bench.machine(), "profile": profile, "command": command(args, seeds, out), "wall": wall}
    info["host"] = (args.merge and machines_of(args.merge)) or f"{info['cpu']}, {info['cores']} cores"
    table = summarize(results, info)
    (out / "table.md").write_text(table)
    if results:
        plot(results, out / "learning.png")
    print(table)
    print(f"results: {out / 'results.jsonl'}; table: {out / 'table.md'}; plot: {out / 'learning.png'}")
    return 0 if args.merge or len(results) == len(args.sides) * len(seeds) * len(args.pairs) else 1


if __name__ == "__main__":
    sys.exit(main())

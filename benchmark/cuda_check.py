"""The CUDA check, in one call on a machine with a GPU (see benchmark/cuda_check.sh).

Every script of leanrl/ at its tiny test settings (tests/conftest.py TINY), the plain ones eager
and the lean ones eager, --compile, --cudagraphs and both (and both with --num-seeds 2 where a
script has it), several at a time, each with TORCH_LOGS=recompiles and a count of CUDA graph
captures and replays (benchmark/cuda_probe). A run passes when it exits 0 with updates > 0,
nothing recompiles after warm-up, and its CUDA graphs are captured (in the cudagraphs modes
only) and then replayed more often than captured. Then one seed of the benchmark's tiny
profile. Prints one table and writes it to OUT/cuda_check.md."""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import TINY, family, is_lean  # noqa: E402

MODES = {
    "eager": [],
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
    "seeds2+compile+cudagraphs": ["--num-seeds", "2", "--compile", "--cudagraphs"],
}


def check(script, mode, out):
    tag = f"{script.stem}-{mode}"
    probe, workdir = out / f"{tag}.graphs.json", out / "runs-cwd"
    workdir.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "TORCH_LOGS": "recompiles",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "LEANRL_GRAPH_PROBE": str(probe),
        "PYTHONPATH": str(ROOT / "benchmark" / "cuda_probe"),
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *TINY[family(script)], *MODES[mode]],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        code, stdout, stderr = "timeout", "", ""
    (out / f"{tag}.stderr.txt").write_text(stderr)
    lines = stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    graphs = json.loads(probe.read_text()) if probe.exists() else {"captures": None, "replays": None}
    recompiles = stderr.count("Recompiling")
    problems = []
    if code != 0 or not summary.get("updates"):
        problems.append(f"exit {code}, updates {summary.get('updates')}")
    if recompiles:
        problems.append(f"{recompiles} recompiles")
    if "cudagraphs" in mode and not (graphs["captures"] and graphs["replays"] > graphs["captures"]):
        problems.append("graphs not captured and replayed")
    if "cudagraphs" not in mode and graphs["captures"]:
        problems.append("graphs captured without --cudagraphs")
    return [
        script.name,
        mode,
        code,
        summary.get("device"),
        summary.get("updates"),
        summary.get("sps"),
        graphs["captures"],
        graphs["replays"],
        recompiles,
        round(time.perf_counter() - start, 1),
        "; ".join(problems) or "ok",
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/cuda_check")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark's tiny profile")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device: this check is for a machine with a GPU", file=sys.stderr)
        sys.exit(2)
    jobs = [
        (s, m)
        for s in sorted((ROOT / "leanrl").glob("*.py"))
        for m in (MODES if is_lean(s) else ["eager"])
        if "seeds" not in m or "num_seeds: int" in s.read_text()
    ]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: check(*job, out), jobs))
    head = ["script", "mode", "exit", "device", "updates", "sps", "captures", "replays", "recompiles", "seconds", "verdict"]
    table = [
        f"# CUDA check: {torch.cuda.get_device_name()}, torch {torch.__version__}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    table += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    failed = sum(row[-1] != "ok" for row in rows)
    table += ["", f"{len(rows) - failed} passed, {failed} failed"]
    if not args.no_bench:
        bench = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmark" / "bench.py"),
                "--profile",
                "tiny",
                "--seeds",
                "1",
                "--no-ceilings",
                "--out",
                str(out / "bench"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        table_md = out / "bench" / "table.md"
        table += ["", f"## ./run.sh --profile tiny --seeds 1 (exit {bench.returncode})", ""]
        table += [table_md.read_text() if table_md.exists() else bench.stderr[-2000:]]
    text = "\n".join(table) + "\n"
    (out / "cuda_check.md").write_text(text)
    print(text)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

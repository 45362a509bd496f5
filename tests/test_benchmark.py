"""The benchmark's machinery: a tiny configuration end to end, and its arithmetic on inputs the test chose."""

import json
import math
import time

import pytest
from conftest import ROOT, load_script

# What bench.summarize is told about the machine and the run.
INFO = {"cpu": "x", "cores": 1, "gpu": None, "torch": "t", "python": "p", "command": "c"}


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "benchmark" / "bench.py")


load_ceilings = lambda: load_script(ROOT / "benchmark" / "ceilings.py")


def record(family, mode, seed, sps, **fields):
    """One run's record as bench writes it."""
    script = f"{family}.py" if mode == "plain" else f"{family}_torchcompile.py"
    return {"family": family, "mode": mode, "script": script, "seed": seed, "sps": sps, **fields}


def test_tiny_profile_writes_table_and_plot(bench, tmp_path):
    status = bench.main(["--profile", "tiny", "--scripts", "ppo_continuous_action", "--out", str(tmp_path)])
    assert status == 0
    records = [json.loads(r) for r in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) in (3, 5)  # plain + eager + compile, and the two cudagraphs modes on a CUDA machine
    assert all(r["sps"] > 0 and isinstance(r["curve"], list) for r in records)
    table = (tmp_path / "table.md").read_text()
    modes = ("| plain |", "| eager |", "| compile |", "| cudagraphs |", "| compile+cudagraphs |")
    assert all(mode in table for mode in modes), table
    plain_row = next(line for line in table.splitlines() if "| plain |" in line)
    assert "| 1.00x | 1.00-1.00 |" in plain_row  # the plain run over itself, seed by seed
    png = tmp_path / "ppo_continuous_action.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cudagraphs_modes_are_not_applicable_without_cuda(bench):
    runs, skipped = bench.plan(["ppo_continuous_action"], [1, 2], "tiny", cuda=False)
    assert {mode for _, _, mode, _, _ in runs} == {"plain", "eager", "compile"}
    assert sorted(mode for *_, mode in skipped) == ["compile+cudagraphs", "cudagraphs"]
    records, info = [record("ppo_continuous_action", "plain", 1, 9.0)], {**INFO, "profile": "tiny", "seeds": [1]}
    rows = [line for line in bench.summarize(records, skipped, {}, info).splitlines() if "n/a (needs CUDA)" in line]
    assert [row.split(" | ")[2] for row in rows] == ["cudagraphs", "compile+cudagraphs"]
    runs, skipped = bench.plan(["ppo_continuous_action"], [1], "tiny", cuda=True)
    assert len(runs) == 5 and not skipped


def test_plan_pairs_plain_and_lean_runs_of_one_seed_back_to_back(bench):
    runs, _ = bench.plan(["dqn", "ppo_continuous_action"], [1, 2], "quick", cuda=False)
    order = [(fam, mode, seed) for fam, _, mode, seed, _ in runs]
    assert order[:3] == [("dqn", "plain", 1), ("dqn", "eager", 1), ("dqn", "compile", 1)]
    assert [seed for *_, seed in order] == [1] * 6 + [2] * 6  # seeds are the outer loop
    assert all(argv[argv.index("--seed") + 1] == str(seed) for _, _, _, seed, argv in runs)
    assert runs[0][4][:2] == ["--total-timesteps", str(bench.FAMILIES["dqn"]["budget"]["quick"])]
    runs, _ = bench.plan(["dqn"], [1], "quick", cuda=False, steps=777)
    assert all(argv[:2] == ["--total-timesteps", "777"] for *_, argv in runs)


def test_paired_ratio_is_taken_per_seed_then_the_median(bench, tmp_path):
    plain = {1: 100.0, 2: 100.0, 3: 400.0}
    lean = {1: 150.0, 2: 300.0, 3: 400.0}  # per seed 1.5, 3.0, 1.0; the ratio of medians is 3.0
    records = [record("f", "plain", s, v) for s, v in plain.items()]
    records += [record("f", "compile", s, lean[s]) for s in (3, 1, 2)]  # out of seed order: runs pair by seed
    assert sorted(bench.paired_ratios(records[3:], records[:3])) == [1.0, 1.5, 3.0]
    info = {**INFO, "profile": "quick", "seeds": [1, 2, 3]}
    table = bench.summarize(records, [], {}, info)
    row = next(line for line in table.splitlines() if "| compile |" in line)
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[3:7] == ["300", "150-400", "1.50x", "1.00-3.00"], row
    assert bench.paired_ratios(records[3:], records[:1]) == [1.5]  # a seed without its plain run has no ratio


def test_curve_comes_from_the_run_dir_or_an_old_summary_field(bench, tmp_path):
    run_dir = tmp_path / "runs" / "CartPole-v1__dqn__1__1"
    run_dir.mkdir(parents=True)
    (run_dir / "curve.csv").write_text("step,seconds,episodic_return\n100,0.5,\n200,1.0,9.5\n300,1.5,12\n")
    # the row before the first finished episode has no return and is left out
    assert bench.read_curve({"run_dir": "runs/CartPole-v1__dqn__1__1"}, tmp_path) == [[200.0, 1.0, 9.5], [300.0, 1.5, 12.0]]
    assert bench.read_curve({"curve": [[1, 0.1, 2.0]]}, tmp_path) == [[1, 0.1, 2.0]]
    assert bench.read_curve({"run_dir": "runs/missing"}, tmp_path) == [] and bench.read_curve({}, tmp_path) == []


def test_run_one_reads_the_summary_and_the_curve_relative_to_the_runs_cwd(bench, tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(
        "import json, os\n"
        "os.makedirs('runs/fake__1', exist_ok=True)\n"
        "open('runs/fake__1/curve.csv', 'w').write('step,seconds,episodic_return\\n10,0.1,1.0\\n')\n"
        "print('progress line')\n"
        "print(json.dumps({'sps': 5.0, 'threads': os.environ['OMP_NUM_THREADS'], 'run_dir': 'runs/fake__1'}))\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    summary = bench.run_one(script, [], work / "fake.log", timeout=60)
    assert summary["sps"] == 5.0 and summary["threads"] == "1"
    assert summary["curve"] == [[10.0, 0.1, 1.0]] and (work / "runs" / "fake__1" / "curve.csv").exists()


def test_a_run_past_its_timeout_is_stopped_and_counted_as_failed(bench, tmp_path):
    (sleeper := tmp_path / "sleeper.py").write_text("import time\nprint('{\"sps\": 1.0}', flush=True)\ntime.sleep(60)\n")
    start = time.monotonic()
    assert bench.run_one(sleeper, [], tmp_path / "sleeper.log", timeout=2) is None
    assert (tmp_path / "sleeper.log").exists() and time.monotonic() - start < 30


def test_families_are_globbed_and_a_family_without_a_budget_uses_the_default(bench, tmp_path, monkeypatch):
    for name in ("new_algo.py", "new_algo_torchcompile.py", "alone.py", "orphan_torchcompile.py"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(bench, "SCRIPTS", tmp_path)
    assert bench.families() == ["new_algo"]
    runs, _ = bench.plan(["new_algo"], [1], "quick", cuda=False)
    assert runs[0][4] == ["--total-timesteps", str(bench.DEFAULT["budget"]["quick"]), "--seed", "1"]
    assert bench.ceilings_of(["new_algo"], tmp_path) == {}  # no env to measure, and no error


@pytest.mark.parametrize("torch_env", [False, True], ids=["gymnasium", "torch-native"])
def test_env_ceiling_steps_the_env(torch_env):
    assert load_ceilings().env_ceiling("CartPole-v1", 2, torch_env=torch_env, seconds=0.3)["sps"] > 0


def test_arithmetic_ceiling_replays_recorded_matmuls(bench, tmp_path):
    ceilings, cfg = load_ceilings(), bench.config("dqn")
    arith = cfg["arith"]
    ceiling = ceilings.arithmetic_ceiling(bench.SCRIPTS / "dqn.py", arith["args"], arith["steps"], tmp_path, seconds=0.3)
    assert ceiling["sps"] > 0 and math.isfinite(ceiling["gflops"])
    # DQN on CartPole: 1.09 MFLOP of updates per env step (2.75 per forward, 5.37 backward, 128 rows per 10 steps).
    assert 1.05e-3 < ceiling["gflop_per_step"] < 1.2e-3


def test_flop_counts_of_a_convolution_and_its_gradients():
    import torch

    ceilings = load_ceilings()
    x, w = torch.randn(2, 4, 8, 8), torch.randn(16, 4, 3, 3)
    out = torch.ops.aten.convolution.default(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert ceilings.flop("aten.convolution.default", [x, w], out) == 2 * (2 * 16 * 6 * 6) * (4 * 3 * 3)
    args = [out, x, w, [16], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False]]
    assert ceilings.flop("aten.convolution_backward.default", args, None) == 2 * 2 * out.numel() * (4 * 3 * 3)
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    assert ceilings.flop("aten.addmm.default", [torch.randn(7), a, b], None) == 2 * 3 * 5 * 7


def test_ceilings_appear_in_the_table_as_fractions_of_the_median(bench):
    records = [record("dqn", "plain", s, 50.0) for s in (1, 2)]
    ceilings = {"dqn": {"env": {"sps": 200.0}, "arith": {"sps": 100.0, "gflop_per_step": 0.001, "gflops": 30.0}}}
    info = {**INFO, "profile": "quick", "seeds": [1, 2]}
    table = bench.summarize(records, [], ceilings, info)
    row = next(line for line in table.splitlines() if "| plain |" in line)
    assert [c.strip() for c in row.strip("|").split("|")][7:9] == ["25%", "50%"]
    assert "- dqn: env alone 200 (CartPole-v1, 1 env, random actions); dense ops alone 100" in table


def test_warm_up_is_split_into_the_cold_first_seed_and_the_warm_others(bench):
    warmups = ((1, 30.0), (2, 4.0), (3, 6.0), (4, 100.0))
    records = [record("dqn", "compile", s, 50.0, warmup_s=w, cold=s == 1) for s, w in warmups]
    info = {**INFO, "profile": "quick", "seeds": [1, 2, 3, 4]}
    row = next(line for line in bench.summarize(records, [], {}, info).splitlines() if "| compile |" in line)
    assert [c.strip() for c in row.strip("|").split("|")][9:11] == ["30.0", "6.0"]


def test_each_cell_compiles_into_its_own_cache_and_only_its_first_seed_is_cold(bench, tmp_path, monkeypatch):
    calls = []
    run_one = lambda script, argv, log, timeout, cache: calls.append(cache) or {"sps": 1.0, "seed": argv[-1]}
    monkeypatch.setattr(bench, "run_one", run_one)
    runs, _ = bench.plan(["dqn"], [1, 2], "tiny", cuda=False)
    records = bench.run_all(runs, tmp_path, 10)
    assert [(r["mode"], r["cold"]) for r in records] == [(m, c) for c in (True, False) for m in ("plain", "eager", "compile")]
    assert calls[:3] == calls[3:] and len(set(calls)) == 3


def test_scaling_reports_each_setting_over_the_first_per_seed(tmp_path, monkeypatch):
    scaling = load_script(ROOT / "benchmark" / "scaling.py")
    cases = scaling.CASES.values()
    assert all((scaling.bench.SCRIPTS / f"{f}_torchcompile.py").exists() and len(settings) >= 2 for f, _, settings in cases)
    speeds = {("1", 1): 100.0, ("8", 1): 300.0, ("1", 2): 200.0, ("8", 2): 500.0}
    run = lambda script, launcher, argv, log, timeout: {"sps": speeds[(argv[argv.index("--num-seeds") + 1], int(argv[-1]))]}
    monkeypatch.setattr(scaling, "run", run)
    assert scaling.main(["--cases", "dqn --num-seeds", "--seeds", "1", "2", "--out", str(tmp_path)]) == 0
    row = next(line for line in (tmp_path / "table.md").read_text().splitlines() if "| 8 seeds |" in line)
    assert [c.strip() for c in row.strip("|").split("|")][2:] == ["400", "2.75x", "2.50-3.00"]

"""The learning profile (`./run.sh --learning`): every pair in it, the interval on the difference, a tiny profile."""

import json

import pytest
from conftest import ROOT, load_script


@pytest.fixture(scope="module")
def learning():
    return load_script(ROOT / "benchmark" / "learning.py")


def test_every_pair_has_both_profiles(learning):
    assert set(learning.PAIRS) == set(learning.bench.families())
    assert all(set(profiles) == {"full", "quick"} for profiles in learning.PAIRS.values()), learning.PAIRS


def test_plan_runs_plain_then_lean_compile_for_each_seed(learning):
    runs = learning.plan(["dqn", "pqn"], [1, 2], "quick")
    expected = [(p, s, seed) for seed in (1, 2) for p in ("dqn", "pqn") for s in ("plain", "lean")]
    assert [(pair, side, seed) for pair, side, seed, _, _ in runs] == expected
    _, _, _, script, argv = runs[1]
    assert script.name == "dqn_torchcompile.py" and argv[-1] == "--compile"
    assert argv[:2] == ["--total-timesteps", "100000"] and "--seed" in argv
    lean_only = learning.plan(["dqn"], [1, 2], "quick", sides=["lean"])
    assert [(side, seed) for _, side, seed, _, _ in lean_only] == [("lean", 1), ("lean", 2)]


def test_seeds_are_written_and_read_as_ranges(learning):
    """A table's header says seeds as ranges, its Command line too; --seeds takes them back."""
    assert learning.seed_ranges([3, 1, 2, 5, 7, 8, 180, 8]) == "1-3, 5, 7-8, 180"
    assert learning.seed_ranges(range(1, 181)) == "1-180"
    assert learning.seeds_arg("1-180") == list(range(1, 181)) and learning.seeds_arg("7") == [7]
    seeds = {"dqn": 15, "ppo": 15, "pqn": 180}
    results = [{"pair": p, "side": "plain", "seed": s} for p, n in seeds.items() for s in range(1, n + 1)]
    assert learning.seed_groups(results) == "1-15 (dqn, ppo); 1-180 (pqn)"
    args = learning.argparse.Namespace(merge=None, quick=True, pairs=["pqn"], steps=None, sides=list(learning.SIDES))
    out = learning.bench.ROOT / "benchmark" / "learning" / "quick"
    command = "`./run.sh --learning --quick --pairs pqn --seeds 1-3 5 --out benchmark/learning/quick`"
    assert learning.command(args, [1, 2, 3, 5], out) == command


def test_bootstrap_interval_holds_zero_only_when_it_should(learning):
    plain = [100.0, 110.0, 90.0, 105.0, 95.0]
    lo, hi = learning.bootstrap_interval(plain, [x + 1.0 for x in plain])
    assert lo < 0 < hi  # a shift far inside the spread of the seeds
    lo, hi = learning.bootstrap_interval(plain, [x + 100.0 for x in plain])
    assert 80 < lo < hi < 120  # a shift of 100 with a spread of 20


def test_table_flags_a_difference(learning):
    results = [
        {"pair": "dqn", "side": side, "seed": s, "env_id": "CartPole-v1", "total_steps": 1000,
         "episodic_return": r + (300 if side == "lean" else 0)}
        for s, r in enumerate([10.0, 20.0, 30.0]) for side in ("plain", "lean")
    ]  # fmt: skip
    info = {"host": "x, 1 cores", "torch": "t", "command": "c", "profile": "quick", "seeds": [0, 1, 2], "wall": "0m01s"}
    row = next(line for line in learning.summarize(results, info).splitlines() if line.startswith("| dqn"))
    assert "20.0 ± 10.0 (n=3)" in row and "320.0 ± 10.0 (n=3)" in row and "+300.0" in row and "**no**" in row


def test_tiny_learning_profile_writes_table_and_plot(learning, tmp_path):
    status = learning.main(["--quick", "--pairs", "pqn", "--seeds", "1", "2", "--steps", "512", "--out", str(tmp_path)])
    assert status == 0
    records = [json.loads(r) for r in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["side"], r["seed"]) for r in records) == [("lean", 1), ("lean", 2), ("plain", 1), ("plain", 2)]
    assert all(r["total_steps"] == 512 and r["curve"] for r in records)
    assert "| pqn | CartPole-v1 | 512 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_makes_one_table_from_parts_and_takes_a_redone_run_from_the_last(learning, tmp_path, capsys):
    """Parts merge into one table and plot, a redone run replacing the earlier; bad merges are one line, exit 2."""
    parts = []
    for part, seeds in enumerate(([1, 2], [3])):
        (folder := tmp_path / f"part{part}").mkdir()
        rows = [
            {"pair": "td3_continuous_action", "side": side, "seed": s, "env_id": "HalfCheetah-v5", "total_steps": 1000,
             "episodic_return": 10.0 * s + (1 if side == "lean" else 0), "curve": [[500, 1.0, 0.0], [1000, 2.0, 10.0 * s]]}
            for s in seeds for side in ("plain", "lean")
        ]  # fmt: skip
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "table.md").write_text(f"Machine: CPU {part}, 2 cores; torch 2.13.0. Command: ...\n")
        parts.append(str(folder))
    out = tmp_path / "merged"
    assert learning.main(["--merge", *parts, parts[0], "--out", str(out)]) == 0
    # where the parts ran, each once
    assert (out / "table.md").read_text().startswith("Machine: CPU 0, 2 cores and CPU 1, 2 cores; torch ")
    assert learning.main(["--merge", *parts, "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert "20.0 ± 10.0 (n=3)" in table and "21.0 ± 10.0 (n=3)" in table and "Seeds: 1-3 (every pair run)." in table
    assert "--merge DIR... --out" not in table and "part0" not in table  # the parts lie outside the repository
    assert "(profile `quick`" in table  # 1,000 steps is nearer TD3's quick budget than its full one
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (redone := tmp_path / "redone").mkdir()
    # lean seed 1: 11 -> 41
    (redone / "results.jsonl").write_text(json.dumps({**rows[1], "seed": 1, "episodic_return": 41.0}) + "\n")
    assert learning.main(["--merge", *parts, str(redone), "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert "31.0 ± 10.0 (n=3)" in table and "taken from it: 1" in table
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
    capsys.readouterr()
    (longer := tmp_path / "longer").mkdir()
    (longer / "results.jsonl").write_text(json.dumps({**rows[0], "seed": 9, "total_steps": 2000}) + "\n")
    for argv in ([str(tmp_path / "nothing")], [parts[0], str(longer)], [parts[0], "--quick"], [parts[0], "--sides", "lean"]):
        with pytest.raises(SystemExit) as stop:
            learning.main(["--merge", *argv, "--out", str(tmp_path / "again")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1

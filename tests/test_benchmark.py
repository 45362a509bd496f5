"""The benchmark's machinery on one tiny configuration: runs, table and plots are produced.
Only their presence and shape are checked, never their numbers."""

import importlib.util
import json
import math
import os
import time

from conftest import ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmark" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_tiny_profile_writes_table_and_plot(tmp_path):
    bench = load_bench()
    status = bench.main(["--profile", "tiny", "--scripts", "ppo_continuous_action", "--out", str(tmp_path)])
    assert status == 0
    records = (tmp_path / "results.jsonl").read_text().splitlines()
    # plain + eager + compile, and the two cudagraphs modes on a CUDA machine
    assert len(records) in (3, 5)
    table = (tmp_path / "table.md").read_text()
    for mode in ("| plain |", "| eager |", "| compile |", "| cudagraphs |", "| compile+cudagraphs |"):
        assert mode in table, table
    assert "Core speed during the runs ranged" in table  # every run had probe readings
    assert all(json.loads(r)["sps_ref"] > 0 for r in records)
    png = tmp_path / "ppo_continuous_action.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --results makes the table again from the saved runs, with the machine and command they ran with
    again = tmp_path / "again"
    assert bench.main(["--profile", "tiny", "--results", str(tmp_path / "results.jsonl"), "--out", str(again)]) == 0
    assert (again / "table.md").read_text() == table


def test_cudagraphs_modes_are_not_applicable_without_cuda():
    bench = load_bench()
    runs, skipped = bench.plan(["ppo_continuous_action"], [1, 2], "tiny", cuda=False)
    assert {mode for *_, mode, _, _ in runs} == {"plain", "eager", "compile"}
    assert sorted(mode for *_, mode in skipped) == ["compile+cudagraphs", "cudagraphs"]
    runs, skipped = bench.plan(["ppo_continuous_action"], [1], "tiny", cuda=True)
    assert len(runs) == 5 and not skipped


def test_env_ceiling_steps_the_env():
    bench = load_bench()
    ceiling = bench.env_ceiling("CartPole-v1", 2, seconds=0.3)
    start, end = ceiling["window"]
    assert ceiling["sps"] > 0 and end - start >= 0.3


def test_core_probe_reads_the_speed_of_the_core_it_shares():
    bench = load_bench()
    core = max(os.sched_getaffinity(0))
    probe = bench.CoreProbe(core)
    try:
        deadline = time.monotonic() + 60
        while len(probe.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(probe.samples) >= 3, "the probe printed no readings"
        first, last = probe.samples[0][0], probe.samples[-1][0]
        assert probe.speed(first, last) > 0
        assert probe.speed(last + 0.01, last + 0.02) == probe.samples[-1][1]  # a short window: the nearest reading
        assert probe.speed(first - 6, first - 5) is None  # no reading in or near that window
        assert os.sched_getaffinity(probe.proc.pid) == {core}
    finally:
        probe.close()
    # a run at exactly the reference speed keeps its steps/s; on a core twice as fast, half
    assert bench.at_reference(100.0, bench.REFERENCE_CORE_SPEED) == 100.0
    assert bench.at_reference(100.0, 2 * bench.REFERENCE_CORE_SPEED) == 50.0
    assert bench.at_reference(100.0, None) is None


def test_arithmetic_ceiling_replays_recorded_matmuls(tmp_path):
    bench = load_bench()
    ceiling = bench.arithmetic_ceiling("dqn", tmp_path, seconds=0.3)
    assert ceiling["sps"] > 0 and math.isfinite(ceiling["gflops"])
    assert ceiling["gflop_per_step"] > 0


def test_repeat_bands_from_each_cells_spread_with_a_pooled_floor():
    bench = load_bench()
    wide, narrow = [80, 90, 100, 110, 120], [99, 100, 100, 100, 101]
    bands = bench.repeat_bands({"wide": wide, "narrow": narrow, "single": [7.0]})
    factor = math.sqrt(math.pi / 2) * math.sqrt(2 / 5) * 100  # median 100 in both cells
    # the wide cell: its own spread, s / mean = 0.158, with t at 4 degrees of freedom (4.604)
    assert math.isclose(bands["wide"], 4.604 * (15.81 / 100) * factor, rel_tol=1e-3)
    # the narrow cell: not its own tiny spread but the pooled one, with t at 8 degrees of freedom
    pooled = math.sqrt((0.1581**2 + 0.00707**2) / 2)
    assert math.isclose(bands["narrow"], 3.355 * pooled * factor, rel_tol=1e-3)
    assert bands["single"] is None


def test_repeat_bands_add_the_hosts_drift_in_quadrature():
    bench = load_bench()
    cells = {"a": [80, 90, 100, 110, 120], "b": [99, 100, 100, 100, 101]}
    without, drifting = bench.repeat_bands(cells), bench.repeat_bands(cells, drift=0.02)
    for key in cells:
        assert math.isclose(drifting[key], math.hypot(without[key], 2.576 * math.sqrt(2) * 0.02 * 100))


def test_host_drift_is_what_the_medians_move_beyond_their_sampling_error():
    bench = load_bench()

    def run(scale, values=(100, 100, 100)):
        return [{"family": fam, "mode": "plain", "sps": v * scale} for fam in ("ppo", "dqn") for v in values]

    # every cell 10% faster in the second run, no spread over seeds: all of it is drift
    drift, n = bench.host_drift([run(1.0), run(1.1)])
    assert n == 2 and math.isclose(drift, math.log(1.1) / math.sqrt(2))
    # medians that move less than their seeds' spread explains: no drift
    assert bench.host_drift([run(1.0, (80, 100, 120)), run(1.01, (80, 100, 120))])[0] == 0.0
    # one benchmark alone says nothing about the next
    assert bench.host_drift([run(1.0)]) == (0.0, 1)


def test_drift_comes_from_earlier_runs_of_the_same_machine_only(tmp_path, monkeypatch):
    bench = load_bench()
    here = {"cpu": "X", "cores": 2, "gpu": None}

    def save(name, scale, machine):
        folder = tmp_path / name
        folder.mkdir()
        records = [{"family": "ppo", "mode": "plain", "sps": v * scale} for v in (100, 100, 100)]
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (folder / "ceilings.json").write_text(json.dumps({"machine": machine, "ceilings": {}}))
        return folder

    folders = [save("A", 1.0, here), save("B", 1.1, here), save("C", 2.0, {**here, "cpu": "Y"})]
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "DRIFT_RUNS", [f.name for f in folders])
    drift, n = bench.drift_of_machine(here)
    assert n == 2 and math.isclose(drift, math.log(1.1) / math.sqrt(2))
    assert bench.drift_of_machine(here, skip=[tmp_path / "B" / "results.jsonl"]) == (0.0, 1)


def test_compare_flags_a_median_outside_the_other_runs_band():
    bench = load_bench()

    def run(ppo, dqn):
        return [{"family": "ppo", "mode": "compile", "sps": s} for s in ppo] + [{"family": "dqn", "mode": "plain", "sps": s} for s in dqn]

    first = run(ppo=[100, 110, 120, 110, 110], dqn=[50, 51, 52, 51, 51])
    # ppo's medians differ by 2, well inside both bands; dqn's by 30%, outside both.
    rows, outside = bench.compare(first, run(ppo=[108, 112, 114, 112, 112], dqn=[66, 66, 67, 66, 66]))
    assert outside == 1
    assert [row.split(" | ")[-1] for row in rows[2:4]] == ["yes |", "no |"]
    assert bench.compare(first, first)[1] == 0


def test_compare_needs_each_median_inside_the_narrower_band(monkeypatch):
    bench = load_bench()
    bands = iter([{("a", "compile"): 20.0, ("b", "plain"): None}, {("a", "compile"): 5.0, ("b", "plain"): None}])
    monkeypatch.setattr(bench, "repeat_bands", lambda cells, drift=0.0: next(bands))
    first = [{"family": "a", "mode": "compile", "sps": 100}, {"family": "b", "mode": "plain", "sps": 7}]
    second = [{"family": "a", "mode": "compile", "sps": 110}, {"family": "b", "mode": "plain", "sps": 9}]
    rows, outside = bench.compare(first, second)
    # 110 lies in 100 +- 20 but 100 not in 110 +- 5; a cell of one run is not judged
    assert outside == 1
    assert [row.split(" | ")[-1] for row in rows[2:4]] == ["no |", "n/a (one run) |"]
    assert rows[-1] == "0 of 1 cells repeat within their noise band."


def test_ceiling_at_reference_speed_and_pinning_restored():
    bench = load_bench()

    class Probe:
        def speed(self, start, end):
            return 2 * bench.REFERENCE_CORE_SPEED if (start, end) == (1.0, 2.0) else None

    ceiling = bench.with_reference({"sps": 100.0}, Probe(), (1.0, 2.0))
    assert ceiling == {"sps": 100.0, "core_speed": 2 * bench.REFERENCE_CORE_SPEED, "sps_ref": 50.0}
    before = os.sched_getaffinity(0)
    try:
        with bench.pinned(max(before)):
            assert os.sched_getaffinity(0) == {max(before)}
            raise KeyError("inside")
    except KeyError:
        pass
    assert os.sched_getaffinity(0) == before


def test_a_run_past_its_timeout_is_stopped_and_counted_as_failed(tmp_path):
    bench = load_bench()
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('{}', flush=True)\ntime.sleep(60)\n")
    start = time.monotonic()
    summary, log, done_at = bench.run_one(sleeper, [], tmp_path, timeout=2, core=None)
    assert (summary, done_at) == (None, None) and log.exists()
    assert time.monotonic() - start < 30


def test_ceilings_saved_before_the_probe_are_read(tmp_path):
    bench = load_bench()
    saved = tmp_path / "ceilings.json"
    saved.write_text(json.dumps({"machine": {"cpu": "x"}, "ceilings": {"dqn": {"env_sps": 10.0, "arith": {"sps": 5.0, "gflop_per_step": 1.0, "gflops": 2.0}}}}))
    ceilings, info = bench.read_ceilings(saved)
    assert ceilings["dqn"]["env"] == {"sps": 10.0} and ceilings["dqn"]["arith"]["sps"] == 5.0
    assert bench.speed(ceilings["dqn"]["env"]) == 10.0 and info == {"cpu": "x"}


def test_elasticity_fit_and_use():
    bench = load_bench()
    # steps/s that move with the core speed to the power 1.5 give back 1.5, with no error
    runs = [{"family": "dqn", "mode": "compile", "sps": 10.0 * c**1.5, "core_speed": c} for c in (200.0, 300.0, 450.0)]
    runs.append({"family": "dqn", "mode": "compile", "sps": 5.0})  # no probe reading: not fitted
    runs.append({"family": "sac", "mode": "plain", "sps": 5.0, "core_speed": 300.0})  # too few runs
    fits = bench.fit_elasticity(runs)
    assert list(fits) == [("dqn", "compile")]
    slope, se, n = fits[("dqn", "compile")]
    assert math.isclose(slope, 1.5) and se < 1e-9 and n == 3
    # with that elasticity every run lands on the same speed at the reference core speed
    bench.ELASTICITY[("dqn", "compile")] = 1.5
    at_ref = {round(bench.speed(r), 6) for r in runs[:3]}
    assert at_ref == {round(10.0 * bench.REFERENCE_CORE_SPEED**1.5, 6)}
    assert bench.at_reference(100.0, 4 * bench.REFERENCE_CORE_SPEED, 0.5) == 50.0
    assert bench.speed(runs[3]) == 5.0  # raw steps/s without a reading
    # with noise: the slope's standard error as worked out by hand (x = log 2 ** k, k = 0..3)
    noisy = [{"family": "a", "mode": "eager", "sps": math.exp(y), "core_speed": 2.0**k} for k, y in enumerate([0.0, 1.0, 1.0, 2.0])]
    slope, se, n = bench.fit_elasticity(noisy)[("a", "eager")]
    ln2 = math.log(2)
    # slope over k is 0.6 (residuals -0.1, 0.3, -0.3, 0.1: 0.2 summed in squares, over sum of
    # (k - 1.5)^2 = 5); in log 2 units the slope divides by ln 2, and so does its error
    assert math.isclose(slope, 0.6 / ln2) and math.isclose(se, math.sqrt(0.2 / 2 / 5) / ln2)
    # every run at one core speed: no slope
    flat = [{"family": "a", "mode": "eager", "sps": s, "core_speed": 300.0} for s in (1.0, 2.0, 3.0)]
    assert bench.fit_elasticity(flat) == {}

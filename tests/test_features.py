"""Research features every script has: checkpoints across the pair, offline tracking, CPU threads."""

import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, family, is_lean, load_script, main_in_process, pair, run_script, scripts

ALL = scripts("*.py")
PLAIN = [s for s in ALL if not is_lean(s)]


@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_checkpoint_round_trip_across_the_pair(script, workdir):
    """A checkpoint saved by one script of the pair evaluates to the same return in both."""
    twin = pair(family(script))[1]
    trained_by = twin if PLAIN.index(script) % 2 else script
    summary, _ = run_script(trained_by, *TINY[family(script)], "--save-model", cwd=workdir)
    path = Path(workdir) / summary["checkpoint"]
    assert path.is_file() and not Path(str(path) + ".tmp").exists()
    evals = []
    for evaluated_by in (script, twin):
        argv = [*TINY[family(script)], "--load-model", path, "--total-timesteps", "0", "--eval-episodes", "2"]
        summary, _ = run_script(evaluated_by, *argv, cwd=workdir)
        assert summary["updates"] == 0 and summary["total_steps"] == 0 and math.isfinite(summary["eval_return"])
        evals.append(summary["eval_return"])
    assert evals[0] == pytest.approx(evals[1], rel=1e-5), (trained_by.name, evals)


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_track_offline_writes_a_local_run(script, workdir):
    summary, _ = run_script(script, *TINY[family(script)], "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    assert summary["updates"] > 0
    runs = list((Path(workdir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(Path(workdir).rglob("*"))[:20]


@pytest.mark.parametrize("flags, threads", [([], 1), (["--threads", "2"], 2)], ids=["default", "two"])
def test_lean_scripts_choose_their_cpu_threads(flags, threads, tmp_path, monkeypatch):
    """One intra-op thread on a CPU unless --threads says more, whatever torch started with."""
    before = torch.get_num_threads()
    try:
        for script in (s for s in scripts("*_torchcompile.py") if family(s) in ("dqn", "pqn", "pqn_torchenv")):
            torch.set_num_threads(3 - threads)
            code = main_in_process(load_script(script), *flags, tmp_path=tmp_path, monkeypatch=monkeypatch)
            assert code in (0, None) and torch.get_num_threads() == threads, (script.name, code)
    finally:
        torch.set_num_threads(before)

"""Research features every script has: checkpoints (atomic, loadable across the pair),
evaluation, Ctrl-C, and offline tracking."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, family, is_lean, load_script, run_script, scripts

ALL = scripts("*.py")
PLAIN = [s for s in ALL if not is_lean(s)]


def twin(script):
    return script.with_name(script.stem + "_torchcompile.py")


@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_checkpoint_round_trip_across_the_pair(script, workdir):
    """A checkpoint saved by either script evaluates to the same return in both: the reloaded
    deterministic policy takes the same actions on the same observations."""
    tiny = TINY[family(script)]
    for trained_by in (script, twin(script)):
        summary, _ = run_script(trained_by, *tiny, "--save-model", cwd=workdir)
        path = Path(workdir) / summary["checkpoint"]
        assert path.is_file() and not Path(str(path) + ".tmp").exists()
        torch.load(path, map_location="cpu", weights_only=False)
        evals = []
        for evaluated_by in (script, twin(script)):
            summary, _ = run_script(
                evaluated_by, *tiny, "--load-model", path, "--total-timesteps", "0", "--eval-episodes", "2", cwd=workdir
            )
            assert summary["updates"] == 0 and summary["total_steps"] == 0
            assert math.isfinite(summary["eval_return"])
            evals.append(summary["eval_return"])
        assert evals[0] == pytest.approx(evals[1], rel=1e-5), (trained_by.name, evals)


def test_missing_checkpoint_is_one_line(workdir):
    from conftest import assert_one_line_error

    for script in ALL:
        _, proc = run_script(script, *TINY[family(script)], "--load-model", "nope.pt", cwd=workdir, check=False)
        assert_one_line_error(proc, "nope.pt")


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_atomic_save_never_exposes_a_partial_file(script, tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous checkpoint whole at the final path."""
    module = load_script(script)
    path = str(tmp_path / "model.pt")
    module.atomic_save({"w": torch.ones(3)}, path)

    def crash(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(module.torch, "save", crash)
    with pytest.raises(OSError):
        module.atomic_save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["w"], torch.ones(3))


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_ctrl_c_saves_and_exits_clean(script, workdir):
    """SIGINT mid-training: exit 0, the summary says interrupted, the checkpoint loads."""
    tiny = TINY[family(script)]
    i = tiny.index("--total-timesteps")
    long_run = tiny[:i] + ["--total-timesteps", "10000000"] + tiny[i + 2 :]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    # A shell without job control starts background jobs with SIGINT ignored, and a Python started
    # so never raises KeyboardInterrupt: give the script the default disposition, as in a terminal.
    proc = subprocess.Popen(
        [sys.executable, str(script), *long_run, "--save-model"],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Wait for the progress bar to show a first logged iteration, i.e. training is under way.
    seen, deadline = "", time.time() + 120
    while "sps=" not in seen and time.time() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
    assert "sps=" in seen, seen
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, seen + stderr
    assert "Traceback" not in stderr, stderr
    import json

    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True
    checkpoint = torch.load(Path(workdir) / summary["checkpoint"], map_location="cpu", weights_only=False)
    assert checkpoint["args"]["env_id"] == summary["env_id"]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_track_offline_writes_a_local_run(script, workdir):
    summary, _ = run_script(script, *TINY[family(script)], "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    assert summary["updates"] > 0
    runs = list((Path(workdir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(Path(workdir).rglob("*"))[:20]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_untracked_run_never_imports_wandb(script, workdir):
    """Without --track nothing touches wandb: the script never imports it."""
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__'); "
        "assert 'wandb' not in sys.modules, 'wandb was imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(script), *TINY[family(script)]],
        cwd=workdir, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_capture_video_without_moviepy_is_one_line(script, workdir):
    """--capture-video without the `video` extra: one line naming it, before any training."""
    from conftest import assert_one_line_error, run_without

    proc = run_without("moviepy", script, *TINY[family(script)], "--capture-video", cwd=workdir)
    assert_one_line_error(proc, "leanrl[video]")

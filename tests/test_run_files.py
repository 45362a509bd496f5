"""What a run writes: its own folder, a curve that survives SIGKILL, safe final saves, strict JSON summaries."""

import errno
import math
import os
import re
import signal
import subprocess
import time
import types

import pytest
import torch
from conftest import TERMINAL, last_summary, pair, run_script, script_command, script_env, tiny, tiny_args

import leanrl_utils

DQN, DQN_LEAN = pair("dqn")


@pytest.mark.parametrize("taken", [0, 1, 2])
def test_run_folders_are_made_exclusively_with_a_suffix(taken, tmp_path, monkeypatch, capsys):
    """Runs started in one second with the same name each get a folder: runs/<name>, then <name>__2, <name>__3..."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(leanrl_utils.run, "time", types.SimpleNamespace(time=lambda: 1e6, perf_counter=time.perf_counter))
    args = tiny_args(DQN)
    folder = lambda k: f"runs/{args.env_id}__{args.exp_name}__{args.seed}__1000000" + ("" if k == 0 else f"__{k + 1}")
    [os.makedirs(folder(k)) for k in range(taken)]  # folders of runs started before, in this second
    runs = [leanrl_utils.Run(args, 0, DQN) for _ in range(2)]
    [run.open() for run in runs]  # the folder is made at the first need: a log point, a save, the end
    assert [run.dir for run in runs] == [folder(k) for k in (taken, taken + 1)]
    assert all(run.name == run.dir.removeprefix("runs/") for run in runs)
    for run in runs:
        run.finish(0, 0, {}, None)
        assert (tmp_path / run.dir / "curve.csv").read_text() == "step,seconds,episodic_return\n"


def test_each_seed_gets_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(leanrl_utils.run, "time", types.SimpleNamespace(time=lambda: 1e6, perf_counter=time.perf_counter))
    args = tiny_args(DQN_LEAN, "--num-seeds", 2)
    sweeps = [leanrl_utils.seeds.runs(args, 0, DQN_LEAN) for _ in range(2)]
    [run.open() for runs in sweeps for run in runs]
    dirs = [run.dir for runs in sweeps for run in runs]
    assert len(set(dirs)) == 4 and all((tmp_path / d).is_dir() for d in dirs), dirs
    for runs in sweeps:
        leanrl_utils.seeds.finish(runs, 0, 0, [{}, {}], None)
        assert last_summary(capsys.readouterr().out)["run_dir"] == runs[0].dir


# Prints each log point's step (with an episode seen, so that curve.csv has its row) to stderr.
LOG_POINTS = """
import os, leanrl_utils
log = leanrl_utils.Run.log
def reported_log(self, step, *args):
    log(self, step, *args)
    if self.returns:
        os.write(2, f"logged {step}\\n".encode())
leanrl_utils.Run.log = reported_log
"""


@pytest.mark.parametrize("script", [DQN, pair("pqn")[1]], ids=lambda s: s.stem)
def test_sigkill_loses_no_logged_point(script, tmp_path):
    """curve.csv is flushed at each log point: after SIGKILL it holds every point logged."""
    argv = tiny(script, total_timesteps=10_000_000)
    command = [*script_command(script, before=LOG_POINTS), *argv]
    proc = subprocess.Popen(command, cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, deadline = "", time.time() + 180
    while len(re.findall(r"logged \d+\n", seen)) < 20 and time.time() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
    proc.kill()
    _, rest = proc.communicate(timeout=60)
    logged = {int(s) for s in re.findall(r"logged (\d+)\n", seen + rest.decode(errors="replace"))}
    assert len(logged) >= 20, seen
    (curve,) = tmp_path.glob("runs/*/curve.csv")
    lines = curve.read_text().splitlines()
    assert lines[0] == "step,seconds,episodic_return"
    rows = {int(line.split(",")[0]) for line in lines[1:] if line.count(",") == 2}
    assert logged <= rows, sorted(logged - rows)


def partial_then(exc):
    """torch.save that writes a few bytes and then raises `exc` (a full disk, an interrupt)."""

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as file:
                file.write(b"partial")
        else:
            f.write(b"partial")
        raise exc

    return save


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left"), KeyboardInterrupt(), RuntimeError("boom")], ids=repr)
def test_atomic_save_leaves_no_tmp_and_the_old_file_whole(exc, tmp_path, monkeypatch):
    path = str(tmp_path / "model.pt")
    leanrl_utils.checkpoints.atomic_save({"old": torch.ones(2)}, path)
    monkeypatch.setattr(torch, "save", partial_then(exc))
    with pytest.raises(type(exc)):
        leanrl_utils.checkpoints.atomic_save({"new": torch.zeros(2)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(2))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, "dev_full", "torch"], ids=str)
def test_a_full_disk_at_the_final_save_still_prints_the_summary(code, tmp_path, monkeypatch, capsys):
    """A failed final save: one line, summary with save_failed, exit 1, no .tmp."""
    monkeypatch.chdir(tmp_path)
    run = leanrl_utils.Run(tiny_args(DQN, "--save-model"), 0, DQN)
    if code == "dev_full":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full on this platform")
        code = errno.ENOSPC
        run.open()
        os.symlink("/dev/full", f"{run.dir}/dqn.pt.tmp")
    elif code == "torch":
        monkeypatch.setattr(torch, "save", partial_then(RuntimeError("[enforce fail] unexpected pos 64 vs 0")))
    else:
        monkeypatch.setattr(torch, "save", partial_then(OSError(code, os.strerror(code))))
    with pytest.raises(SystemExit) as e:
        run.finish(0, 0, {"net": torch.nn.Linear(2, 2)}, None)
    assert e.value.code == 1
    out, err = capsys.readouterr()
    summary = last_summary(out)
    assert summary["save_failed"] is True and summary["checkpoint"] is None and summary["interrupted"] is False
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    cause = "unexpected pos" if code == "torch" else os.strerror(code)
    assert len(errors) == 1 and cause.lower() in errors[0].lower() and "Traceback" not in err, err
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.pt"))


# The first resume.pt save meets a full disk; TensorBoard's writer fails at its first point.
WRITES_FAIL = """
import errno, os, leanrl_utils, torch.utils.tensorboard
save, failed = leanrl_utils.checkpoints.atomic_save, []
def full_once(obj, path):
    if path.endswith("resume.pt") and not failed:
        failed.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(obj, path)
def read_only(self, *args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))
leanrl_utils.checkpoints.atomic_save = full_once
torch.utils.tensorboard.SummaryWriter.add_scalar = read_only
"""


def test_failed_writes_mid_run_are_one_line_each_and_training_goes_on(tmp_path):
    """Failed writes mid-run are said once each; training goes on."""
    summary, proc = run_script(DQN, *tiny(DQN, checkpoint_every=0.01), cwd=tmp_path, before=WRITES_FAIL)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "resume.pt" in errors[0] and "no space left" in errors[0].lower(), errors
    assert "TensorBoard" in errors[1] and "read-only" in errors[1].lower(), errors
    assert summary["updates"] > 0 and "save_failed" not in summary and list(tmp_path.glob("runs/*/resume.pt"))


# Sends `signums` to the script's own process as its final save starts.
SIGNALS_IN_SAVE = """
import os, leanrl_utils
save = leanrl_utils.checkpoints.atomic_save
def signalled_save(obj, path):
    for signum in {signums}:
        os.kill(os.getpid(), signum)
    return save(obj, path)
leanrl_utils.checkpoints.atomic_save = signalled_save
"""


INT, TERM = signal.SIGINT, signal.SIGTERM


@pytest.mark.parametrize("signums", [(INT,), (TERM,), (INT, TERM), (TERM, INT)])
def test_signals_during_the_final_save_are_recorded(signums, tmp_path):
    """The save completes, evaluation is skipped, the summary says interrupted, the exit status is the first signal's."""
    before = TERMINAL + SIGNALS_IN_SAVE.format(signums=[int(s) for s in signums])
    argv = tiny(DQN, "--save-model", "--eval-episodes", "20")
    summary, proc = run_script(DQN, *argv, cwd=tmp_path, before=before, check=False)
    assert proc.returncode == 128 + signums[0] and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert summary["interrupted"] is True and summary["eval_return"] is None
    checkpoint = torch.load(tmp_path / summary["checkpoint"], weights_only=True)
    assert all(torch.isfinite(t).all() for net in checkpoint["model"].values() for t in net.values())
    assert not list(tmp_path.rglob("*.tmp"))


def test_num_seeds_summary_is_strict_json(tmp_path, monkeypatch, capsys):
    """Per-seed lists hold null where a value is not finite, never Infinity or NaN."""
    monkeypatch.chdir(tmp_path)
    args = tiny_args(DQN_LEAN, "--num-seeds", 3, "--eval-episodes", 1)
    runs = leanrl_utils.seeds.runs(args, 0, DQN_LEAN)
    for run, value in zip(runs, [math.inf, math.nan, 2.0]):
        run.returns.append(value)
    evals = {args.seed: -math.inf, args.seed + 1: math.nan, args.seed + 2: 3.0}
    leanrl_utils.seeds.finish(runs, 0, 0, [{}] * 3, lambda nets, seed_args, name: evals[seed_args.seed])
    summary = last_summary(capsys.readouterr().out)
    assert summary["episodic_returns"] == [None, None, 2.0] and summary["eval_returns"] == [None, None, 3.0]

"""--resume: a run stopped partway and resumed ends as the run unbroken; bad resumes are one line, exit 2."""

import collections
import io
import json
import os
import signal
import time
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    SCRIPTS,
    TINY,
    assert_one_line_error,
    family,
    final_weights,
    run_script,
    scalars,
    scripts,
    signal_at_step,
    start_script,
    wait_for,
)

import leanrl_utils

# SIGKILLs the script's own process at its first env step from `at` on where a periodic checkpoint exists.
KILL_AFTER_CHECKPOINT = """
import glob, os, signal, gymnasium as gym
_step, _calls = gym.wrappers.RecordEpisodeStatistics.step, [0]
def step(self, action):
    _calls[0] += 1
    if _calls[0] >= {at} and glob.glob("runs/*/resume.pt"):
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, action)
gym.wrappers.RecordEpisodeStatistics.step = step
"""

# Right after --resume loads the run, its objects (but the envs) hold what was saved; the loop starts where it stopped.
CHECK_RESUMED = """
import sys, torch, leanrl_utils
def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
_resume, _checkpoint = leanrl_utils.Run.resume, leanrl_utils.Run.checkpoint
def resume(self, objects, loop, device="cpu"):
    out = _resume(self, objects, loop, device)
    for name, obj in self.objects.items():
        if name != "envs":
            assert same(leanrl_utils.state.state_of(obj), self.resumed["objects"][name]), name
    print("resume-check: objects ok", file=sys.stderr)
    return out
def checkpoint(self, iteration):
    if not hasattr(self, "checked"):  # the loop's first iteration
        self.checked = iteration == self.resumed["iteration"]
        assert self.checked, (iteration, self.resumed["iteration"])
        print("resume-check: iteration ok", file=sys.stderr)
    return _checkpoint(self, iteration)
leanrl_utils.Run.resume, leanrl_utils.Run.checkpoint = resume, checkpoint
"""

# Per family: the env step to stop at, after learning starts and between two log points.
STOP_AT = {"dqn": 250, "pqn": 300, "ppo": 300, "sac_continuous_action": 150, "td3_continuous_action": 150,
           "ppo_continuous_action": 150, "pqn_torchenv": 150, "ppo_torchenv": 150}  # fmt: skip
RESUMABLE = [s for s in scripts("*.py") if family(s) in STOP_AT]


curve_steps = lambda run_dir: [line.split(",")[0] for line in (Path(run_dir) / "curve.csv").read_text().splitlines()]


def loss_steps(run_dir):
    """The steps of the first loss the run logs, in the order written."""
    points = [(tag, step) for tag, step, _ in scalars(run_dir) if tag.startswith("losses/")]
    return [step for tag, step in points if tag == points[0][0]]


def assert_every_log_point_once(run_dir, total):
    steps = [int(s) for s in curve_steps(run_dir)[1:]]  # none before the first episode ends (Atari)
    assert steps == sorted(set(steps)) and steps[-1:] in ([], [total])
    logged = loss_steps(run_dir)
    every = logged[1] - logged[0]  # log points are evenly spaced: none missing, none twice
    assert logged == list(range(logged[0], total + 1, every)), logged


TWICE = [s for s in RESUMABLE if s.stem in ("dqn_torchcompile", "ppo_continuous_action_torchcompile")]
# Compiled, a run resumes by compiling anew: the replay-buffer, observation-statistics and learned-temperature states.
LEAN = [s for s in RESUMABLE if "compile" in s.stem and family(s) in ("dqn", "ppo_continuous_action", "sac_continuous_action")]
UNBROKEN = {f"{s.stem}{suffix}": (s, times, compiled) for suffix, times, compiled, group in
            (("", 1, False, RESUMABLE), ("-x2", 2, False, TWICE), ("-compile", 1, True, LEAN)) for s in group}  # fmt: skip


@pytest.mark.parametrize("case", UNBROKEN)
def test_stopped_and_resumed_run_is_the_run_unbroken(case, tmp_path):
    """SIGTERM (maybe twice) mid-run, --resume: the unbroken run's values and weights."""
    script, times, compiled = UNBROKEN[case]
    (whole := tmp_path / "whole").mkdir()
    (parts := tmp_path / "parts").mkdir()
    tiny = [*TINY[family(script)], "--save-model", *(["--compile"] if compiled else [])]
    unbroken, _ = run_script(script, *tiny, cwd=whole)
    where = {"where": "leanrl_envs:Env"} if family(script).endswith("_torchenv") else {}
    before = signal_at_step(STOP_AT[family(script)], times, **where)
    proc = start_script(script, parts, *tiny, before=before)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 143, stderr
    run_dir = parts / "runs" / os.listdir(parts / "runs")[0]
    assert (run_dir / "resume.pt").is_file()
    resumed, proc = run_script(script, "--resume", run_dir, "--save-model", cwd=parts)
    assert "notice: resuming" in proc.stderr and resumed["compile"] is compiled
    assert resumed["total_steps"] == unbroken["total_steps"] and resumed["updates"] == unbroken["updates"]
    assert Path(resumed["run_dir"]).resolve() == run_dir.resolve()
    points, got = scalars(whole / unbroken["run_dir"]), scalars(run_dir)
    assert any(tag.startswith("losses/") for tag, _, _ in points)
    assert [(tag, step) for tag, step, _ in got] == [(tag, step) for tag, step, _ in points]
    values = [v for _, _, v in points]
    assert [v for _, _, v in got] == (pytest.approx(values, rel=1e-5, abs=1e-6) if compiled else values)
    assert curve_steps(run_dir) == curve_steps(whole / unbroken["run_dir"])
    expected, got = final_weights(whole, unbroken), final_weights(parts, resumed)
    torch.testing.assert_close(got, expected, **(dict(rtol=1e-5, atol=1e-6) if compiled else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("script", [SCRIPTS / "dqn_torchcompile.py", SCRIPTS / "pqn.py"], ids=lambda s: s.stem)
def test_killed_run_resumes_from_its_periodic_checkpoint(script, tmp_path):
    """SIGKILL after a periodic checkpoint: resumed, the budget completes, each point once."""
    argv = [*TINY[family(script)], "--checkpoint-every", "0.05"]
    i = argv.index("--total-timesteps")
    argv[i + 1] = str(int(argv[i + 1]) * (50 if family(script) == "pqn" else 10))  # lean PQN runs 5120 steps in a second
    proc = start_script(script, tmp_path, *argv, before=KILL_AFTER_CHECKPOINT.format(at=int(argv[i + 1]) // 2))
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed: make it longer"
    run_dir = next((tmp_path / "runs").glob("*/resume.pt")).parent
    resumed, _ = run_script(script, "--resume", run_dir, cwd=tmp_path)
    assert resumed["total_steps"] == int(argv[i + 1])
    assert_every_log_point_once(run_dir, int(argv[i + 1]))


# SIGTERM 0.3 s into the first call of a compiled function (inside its compile); a line when it goes on eagerly.
SIGNAL_IN_COMPILE = """
import functools, os, signal, sys, threading, torch
_compile, _set_stance = torch.compile, torch.compiler.set_stance
def compile(fn, **options):
    compiled, timer = _compile(fn, **options), []
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        if not timer:
            timer.append(threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)))
            timer[0].start()
        return compiled(*args, **kwargs)
    return call
def set_stance(stance, **kwargs):
    print(f"compile-check: {stance}", file=sys.stderr)
    return _set_stance(stance, **kwargs)
torch.compile, torch.compiler.set_stance = compile, set_stance
"""


@pytest.mark.parametrize("script", [SCRIPTS / "dqn_torchcompile.py", SCRIPTS / "ppo_continuous_action_torchcompile.py"])
def test_a_signal_during_the_cold_compile_ends_it_and_saves(script, tmp_path):
    """A stop mid-compile goes on eagerly, saves, and resumes with its state."""
    argv = [*TINY[family(script)], "--compile"]
    proc = start_script(script, tmp_path, *argv, before=SIGNAL_IN_COMPILE)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "compile-check: force_eager" in stderr, stderr
    assert_resumes_with_its_state(script, next((tmp_path / "runs").iterdir()), int(argv[argv.index("--total-timesteps") + 1]))


def test_a_signal_in_a_finalizer_still_ends_the_cold_compile(capsys):
    """The signal is sent again: the compile ends within seconds, the call runs eagerly, nothing is printed."""
    lead = types.SimpleNamespace(stop_signal=None, compiling=False)
    lead.lead, previous = lead, signal.signal(signal.SIGTERM, types.MethodType(leanrl_utils.Run.on_signal, lead))

    def cold(x):
        weakref.finalize(set(), os.kill, os.getpid(), signal.SIGTERM)  # Python drops what is raised there
        time.sleep(60)  # as for g++: the signal must reach the main thread
        return "compiled"

    cold.__wrapped__, start = lambda x: "eager", time.perf_counter()  # torch.compile's wrapper names the function
    try:
        assert leanrl_utils.speed.interruptible(lead, cold)(0) == "eager" and not capsys.readouterr().err
        assert time.perf_counter() - start < 30, "the compile went on after the signal"
    finally:
        signal.signal(signal.SIGTERM, previous), torch.compiler.set_stance("default")


def assert_resumes_with_its_state(script, run_dir, total):
    """--resume restores what the run saved (CHECK_RESUMED) and completes the budget `total`, each log point once."""
    assert (run_dir / "resume.pt").is_file()
    proc = start_script(script, run_dir.parents[1], "--resume", run_dir, before=CHECK_RESUMED)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "resume-check: objects ok" in stderr and "resume-check: iteration ok" in stderr, stderr
    assert json.loads(stdout.splitlines()[-1])["total_steps"] == total
    assert_every_log_point_once(run_dir, total)


@pytest.mark.parametrize("script", scripts("*atari*.py"), ids=lambda s: s.stem)
def test_atari_run_resumes_with_its_saved_state_and_completes_its_budget(script, tmp_path):
    """envpool's games cannot be saved: the resumed run starts fresh episodes with the saved state, each step once."""
    # PPO and PQN: 4 iterations of 32 steps; DQN: 2 envs, past learning starts (its tiny budget, 400 steps)
    total, at = (400, 120) if family(script) == "dqn_atari_envpool" else (128, 40)
    argv = [*TINY[family(script)], "--total-timesteps", total]
    before = signal_at_step(at, where="leanrl_utils.vector:RecordEpisodeStatistics")
    proc = start_script(script, tmp_path, *argv, before=before)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    assert_resumes_with_its_state(script, next((tmp_path / "runs").iterdir()), total)


def test_every_seed_of_num_seeds_resumes(tmp_path):
    """Lean DQN with 2 seeds resumes as each seed's unbroken run; another --num-seeds is one line."""
    script = SCRIPTS / "dqn_torchcompile.py"
    (whole := tmp_path / "whole").mkdir()
    (parts := tmp_path / "parts").mkdir()
    argv = [*TINY["dqn"], "--num-seeds", 2, "--save-model"]
    run_script(script, *argv, cwd=whole)
    proc = start_script(script, parts, *argv, before=signal_at_step(2 * 250))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    lead = next(d for d in (parts / "runs").iterdir() if (d / "resume.pt").exists())
    _, proc = run_script(script, "--resume", lead, "--num-seeds", 3, cwd=parts, check=False)
    assert_one_line_error(proc, "--num-seeds", "contradicts", code=2)
    resumed, proc = run_script(script, "--resume", lead, "--save-model", cwd=parts)
    assert resumed["num_seeds"] == 2 and "notice: resuming" in proc.stderr
    for seed in (1, 2):
        expected, got = next((whole / "runs").glob(f"*__{seed}__*")), next((parts / "runs").glob(f"*__{seed}__*"))
        assert scalars(got) == scalars(expected)
        weights = [torch.load(d / "dqn_torchcompile.pt", weights_only=True)["model"] for d in (expected, got)]
        torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=0)


@pytest.fixture
def stopped_run(tmp_path):
    """A plain DQN run stopped by SIGTERM partway: (script, its run folder)."""
    script = next(s for s in RESUMABLE if s.stem == "dqn")
    proc = start_script(script, tmp_path, *TINY["dqn"], before=signal_at_step(250))
    proc.communicate(timeout=300)
    return script, next((tmp_path / "runs").iterdir())


def truncated(run_dir):
    (run_dir / "resume.pt").write_bytes((run_dir / "resume.pt").read_bytes()[:1000])
    return run_dir


def without_seeds(run_dir):
    checkpoint = torch.load(run_dir / "resume.pt", weights_only=True)
    del checkpoint["seeds"]
    torch.save(checkpoint, run_dir / "resume.pt")
    return run_dir


# Per case: the resuming script, a change to the run folder (returning the folder), flags, the line's words.
BAD_RESUMES = {
    "missing-folder": ("dqn", lambda run_dir: run_dir.parents[1] / "nowhere", [], ["no checkpoint"]),
    "corrupt-checkpoint": ("dqn", truncated, [], ["corrupt"]),
    "malformed-checkpoint": ("dqn", without_seeds, [], ["cannot read"]),
    "another-script": ("dqn_torchcompile", None, [], ["dqn.py"]),
    "env": ("dqn", None, ["--env-id", "Acrobot-v1"], ["--env-id", "contradicts"]),
    "size": ("dqn", None, ["--buffer-size", "600"], ["--buffer-size", "contradicts"]),
    "typed-default": ("dqn", None, ["--buffer-size", "10000"], ["--buffer-size 10000", "contradicts"]),  # the default, typed
    "budget-below-done": ("dqn", None, ["--total-timesteps", "100"], ["--total-timesteps 100", "below the 250 steps"]),
    "load-model": ("dqn", None, ["--load-model", "model.pt"], ["--load-model", "--resume"]),
}


@pytest.mark.parametrize("case", BAD_RESUMES)
def test_resume_refuses_what_it_cannot_honour_in_one_line(stopped_run, tmp_path, case):
    script, run_dir = stopped_run
    other, change, flags, words = BAD_RESUMES[case]
    resumed = (change or Path)(run_dir)
    _, proc = run_script(script.with_name(f"{other}.py"), "--resume", resumed, *flags, cwd=tmp_path, check=False)
    assert_one_line_error(proc, *words, code=2)


def test_resume_says_what_it_changes_and_where_it_goes_on(stopped_run, tmp_path):
    """Resume notices, a rebuilt curve.csv; a finished run refuses, a larger budget extends."""
    script, run_dir = stopped_run
    (run_dir / "curve.csv").unlink()
    summary, proc = run_script(script, "--resume", run_dir, "--eval-episodes", 1, cwd=tmp_path)
    notices = [line for line in proc.stderr.splitlines() if line.startswith("notice:")]
    assert "notice: resuming with --eval-episodes 1 (the run had 0)" in notices, notices
    assert f"notice: resuming {run_dir} from step 250" in notices or any("from step 250" in n for n in notices), notices
    assert any("curve.csv was missing or short; rebuilt" in n for n in notices), notices
    curve = (run_dir / "curve.csv").read_bytes()
    assert curve.startswith(b"step,seconds,episodic_return\n") and b"\0" not in curve and summary["eval_return"] is not None
    assert summary["total_steps"] == 400
    _, proc = run_script(script, "--resume", run_dir, cwd=tmp_path, check=False)
    assert_one_line_error(proc, "already finished", code=2)
    extended, _ = run_script(script, "--resume", run_dir, "--total-timesteps", 500, cwd=tmp_path)
    assert extended["total_steps"] == 500


def test_one_writer_per_run_folder(stopped_run, tmp_path):
    """A second process on a run folder in use is refused naming the first; a dead process's lock blocks nothing."""
    script, run_dir = stopped_run
    first = start_script(script, tmp_path, "--resume", run_dir, "--total-timesteps", 10**7)
    wait_for(first, "notice: resuming")
    _, proc = run_script(script, "--resume", run_dir, "--total-timesteps", 10**7, cwd=tmp_path, check=False)
    assert_one_line_error(proc, str(run_dir), f"pid {first.pid}", code=2)
    first.kill()
    first.communicate(timeout=60)
    resumed, _ = run_script(script, "--resume", run_dir, "--total-timesteps", 400, cwd=tmp_path)
    assert resumed["total_steps"] == 400


def test_loop_values_survive_a_weights_only_checkpoint():
    """What a checkpoint keeps of the loop's variables and the envs comes back with its types."""
    values = {
        "counts": (1, 2.5, np.float64(3.0), None, "s"),
        "queue": collections.deque([1.0, 2.0], maxlen=5),
        "arrays": [np.arange(3, dtype=np.uint32), np.ones((2, 2), bool)],
        "tensor": torch.arange(4.0),
        "rng": np.random.default_rng(3),
    }
    buffer = io.BytesIO()
    torch.save(leanrl_utils.state.to_plain(values), buffer)
    buffer.seek(0)
    back = leanrl_utils.state.from_plain(torch.load(buffer, weights_only=True))
    assert back["counts"] == (1, 2.5, 3.0, None, "s") and back["queue"] == values["queue"] and back["queue"].maxlen == 5
    assert all(a.dtype == b.dtype and (a == b).all() for a, b in zip(back["arrays"], values["arrays"]))
    assert torch.equal(back["tensor"], values["tensor"]) and back["rng"].random() == np.random.default_rng(3).random()

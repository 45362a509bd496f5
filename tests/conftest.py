"""Shared helpers for the script tests: run a script as a subprocess, read its summary line,
import a script as a module (for the numerics tests), list scripts by glob."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"


def scripts(pattern):
    """Script paths matching a glob inside leanrl/, sorted; never a hand-typed list."""
    found = sorted(SCRIPTS.glob(pattern))
    assert found, f"no script matches {pattern}"
    return found


def run_script(script, *args, cwd, timeout=600, env=None, check=True):
    """Run a script in a subprocess; return (summary dict or None, CompletedProcess).

    The summary is the last stdout line, which every script prints as one JSON object."""
    # One intra-op thread, as in the benchmark: the networks are too small for a second one to
    # pay on 2 cores, and beside any other process OpenMP's spinning threads stall (10x slower).
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"{Path(script).name} {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    # Strict JSON: NaN or Infinity in the summary fails the test.
    summary = json.loads(lines[-1], parse_constant=pytest.fail) if lines and lines[-1].startswith("{") else None
    return summary, proc


def run_without(module, script, *args, cwd):
    """Run a script as if `module` were not installed (its import fails)."""
    code = (
        f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(script), *map(str, args)],
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        capture_output=True, text=True, timeout=600,
    )


def assert_one_line_error(proc, *words):
    """Bad input: non-zero exit, one line on stderr starting with 'error:', no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word.lower() in errors[0].lower(), errors[0]


def load_script(path):
    """Import a script as a module (nothing runs at import) to reach its factories."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    # Registered, because dynamo looks a compiled function's globals up through sys.modules.
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def main_in_process(module, *argv, tmp_path, monkeypatch):
    """A script module's main at its tiny settings plus `argv`, in this process, from tmp_path;
    returns the exit code (0 when it ran through)."""
    monkeypatch.chdir(tmp_path)
    import tyro

    args = tyro.cli(module.Args, args=[*TINY[family(module.__file__)], *map(str, argv)])
    try:
        module.main(args)
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture
def inductor_fallback_random():
    """Compiled code draws its random numbers from the eager stream, so eager and compiled
    updates can be compared with the same noise. Inductor's own `config.patch`, not
    monkeypatch: its config module keeps values behind __getattr__, which monkeypatch's undo
    leaves unreadable for the next test."""
    import torch._inductor.config

    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.fixture
def workdir(tmp_path):
    """Each run writes runs/ and videos/ under its own temporary folder."""
    return tmp_path


def family(script):
    """The algorithm a script belongs to: its file name without `_torchcompile` and `.py`."""
    return Path(script).stem.removesuffix("_torchcompile")


def is_lean(script):
    return Path(script).stem.endswith("_torchcompile")


# Tiny settings per family: each reaches the update and the logging at least twice within
# seconds (compile aside), on a cheap env. Every script in leanrl/ must have an entry here.
TINY = {
    "ppo_continuous_action": [
        "--env-id", "InvertedPendulum-v5", "--total-timesteps", "256", "--num-steps", "64",
        "--num-minibatches", "2", "--update-epochs", "2",
    ],
    # Learning starts after step 64; 236 updates; logs at steps 100, 200 and 300.
    "sac_continuous_action": [
        "--env-id", "Pendulum-v1", "--total-timesteps", "300", "--learning-starts", "64",
        "--batch-size", "32", "--buffer-size", "1000",
    ],
    # Learning starts after step 32; 208 updates; logs at steps 100, 200 and 240.
    "td3_continuous_action": [
        "--env-id", "Pendulum-v1", "--total-timesteps", "240", "--learning-starts", "32",
        "--batch-size", "16", "--buffer-size", "1000",
    ],
    # Learning starts at step 100; 75 updates (one per 4 steps); target copies every 50 steps;
    # logs at steps 100, 200, 300 and 400.
    "dqn": [
        "--total-timesteps", "400", "--learning-starts", "100", "--batch-size", "32",
        "--buffer-size", "500", "--train-frequency", "4", "--target-network-frequency", "50",
    ],
    # Atari: 2 envs, 16 steps, 2 iterations (4 minibatch updates each).
    "ppo_atari_envpool": [
        "--env-id", "Breakout-v5", "--num-envs", "2", "--num-steps", "16", "--total-timesteps", "64",
        "--num-minibatches", "2", "--update-epochs", "2",
    ],
    # 2 envs, 64 steps: 4 iterations of 4 minibatch updates, a log point after each.
    "pqn": [
        "--total-timesteps", "512", "--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2",
    ],
    # Atari: 2 envs, 16 steps, 2 iterations (4 minibatch updates each).
    "pqn_atari_envpool": [
        "--env-id", "Breakout-v5", "--num-envs", "2", "--num-steps", "16", "--total-timesteps", "64",
        "--num-minibatches", "2", "--update-epochs", "2",
    ],
}

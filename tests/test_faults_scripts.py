"""Every script: no-update budgets, evaluation only, memory, unmakeable envs, torchrun faults, Ctrl-C, blow-ups."""

import os
import shlex
import signal
import subprocess
import sys
import time
import types

import pytest
from conftest import (
    ROOT,
    TERMINAL,
    TINY,
    assert_one_line_error,
    family,
    load_script,
    refused_in_process,
    run_script,
    script_command,
    script_env,
    scripts,
    tiny,
    tiny_value,
)
from test_torchrun import LEAN_PPO, TORCHRUN, summaries, torchrun

import leanrl_utils

ALL = scripts("*.py")
OFF_POLICY = [s for s in ALL if family(s) in ("dqn", "dqn_atari_envpool", "sac_continuous_action", "td3_continuous_action")]
ROLLOUT = [s for s in ALL if s not in OFF_POLICY]  # PPO and PQN
ATARI = [s for s in ALL if family(s).endswith("_envpool")]
TORCH_ENVS = [s for s in ALL if family(s).endswith("_torchenv")]  # leanrl_envs only
GYM = [s for s in ALL if s not in ATARI + TORCH_ENVS]


def refused(script, *argv, tmp_path, monkeypatch, capsys):
    """The script's main refused (exit 2, one line, returned) before its Run exists and within 1 GiB of memory."""
    module = load_script(script)

    def started(*args, **kwargs):
        pytest.fail("the run started: the refusal came after the run's folder")

    monkeypatch.setattr(leanrl_utils.run.Run, "__init__", started)
    peak = leanrl_utils.summary.peak_rss_mb()
    line = refused_in_process(module, *argv, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert not (tmp_path / "runs").exists() and leanrl_utils.summary.peak_rss_mb() < peak + 1024
    return line


@pytest.mark.parametrize("script", OFF_POLICY, ids=lambda s: s.stem)
def test_budget_that_ends_before_learning_starts_runs_with_a_notice(script, workdir):
    """A smoke run that trains nothing says so in one notice and ends with its summary and exit 0."""
    argv = tiny(script, total_timesteps=300, learning_starts=5000, eval_episodes=None)
    summary, proc = run_script(script, *argv, cwd=workdir)
    notices = [line for line in proc.stderr.splitlines() if "ends before learning starts" in line]
    assert summary["updates"] == 0 and len(notices) == 1 and notices[0].startswith("notice:"), proc.stderr
    assert all(w in notices[0] for w in ("--total-timesteps 300", "--learning-starts 5000", "no update will run")), notices


# (total, learning_starts, num_envs) -> no update: the loop's last step must pass learning_starts.
# (11, 8, 4): two iterations of 4 envs, steps 4 and 8; a zero budget is evaluation only, with its own rule.
BUDGETS = {(100, 100, 1): True, (101, 100, 1): False, (11, 8, 4): True, (12, 8, 4): False, (0, 5000, 1): False}


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_check_budget_at_its_boundary(budget):
    total, starts, num_envs = budget
    args = types.SimpleNamespace(total_timesteps=total, learning_starts=starts, num_envs=num_envs)
    assert leanrl_utils.checks.budget(args) is BUDGETS[budget]
    assert leanrl_utils.checks.budget(types.SimpleNamespace(total_timesteps=1, num_envs=1)) is False  # on-policy


ZERO_BUDGET = {"no-eval-episodes": ["--load-model", "model.pt"], "no-load-model": ["--eval-episodes", 2], "neither": []}


@pytest.mark.parametrize("argv", ZERO_BUDGET.values(), ids=ZERO_BUDGET)
@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_zero_budget_is_evaluation_only(script, argv, tmp_path, monkeypatch, capsys):
    error = refused(script, "--total-timesteps", 0, *argv, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert all(words in error for words in ("--total-timesteps 0", "--load-model", "--eval-episodes")), error


@pytest.mark.parametrize("flag, value", [("--num-steps", 10**12), ("--num-envs", 10**9)], ids=["num-steps", "num-envs"])
@pytest.mark.parametrize("script", ROLLOUT, ids=lambda s: s.stem)
def test_rollout_beyond_memory_is_one_line_before_allocating(script, flag, value, tmp_path, monkeypatch, capsys):
    sizes = {"--num-steps": tiny_value(script, "--num-steps"), "--num-envs": tiny_value(script, "--num-envs", 1), flag: value}
    argv = [flag, value, "--total-timesteps", sizes["--num-steps"] * sizes["--num-envs"]]
    error = refused(script, *argv, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert f"{flag} {value}" in error and "GiB" in error, error


BAD_ENVS = {"needs-jax": ("phys2d/CartPole-v1", ["jax", "install"]), "unknown": ("NoSuchEnv-v0", ["unknown", "--env-id"]),
            "retired-mujoco-py": ("Humanoid-v2", ["gymnasium-robotics", "e.g. Humanoid-v5"])}  # fmt: skip
BAD_GAMES = {"unknown": ("NoSuchGame-v5", ["unknown Atari id"]), "not-a-game": ("CartPole-v1", ["unknown Atari id"])}


# (script, env id, words): gymnasium, Atari and torch-native scripts each with the ids they cannot make.
TORCH_ENV_IDS = [*(env_id for env_id, _ in BAD_ENVS.values()), "Pendulum-v1", "Taxi-v3"]
UNMAKEABLE = [(s, *BAD_ENVS[case]) for s in GYM for case in BAD_ENVS]
UNMAKEABLE += [(s, *BAD_GAMES[case]) for s in ATARI for case in BAD_GAMES]
UNMAKEABLE += [(s, env_id, ["CartPole-v1, Acrobot-v1, MountainCar-v0"]) for s in TORCH_ENVS for env_id in TORCH_ENV_IDS]


@pytest.mark.parametrize("script, env_id, words", UNMAKEABLE, ids=lambda v: getattr(v, "stem", v if type(v) is str else ""))
def test_env_that_cannot_be_made_is_one_line_before_the_run_folder(script, env_id, words, tmp_path, monkeypatch, capsys):
    error = refused(script, "--env-id", env_id, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert all(word in error for word in [env_id, *words]), error


# A real SIGINT (TERMINAL: as from a terminal) after leanrl_utils's import, before the run exists.
CTRL_C_BEFORE_THE_RUN = {
    "parsing-flags": TERMINAL + "import os, signal, time, tyro\n"
    "tyro.cli = lambda *a, **k: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30))",
    "checking-flags": TERMINAL + "import os, signal, time, leanrl_utils\n"
    "leanrl_utils.checks.flags = lambda *a, **k: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30))",
}


@pytest.mark.parametrize("case", CTRL_C_BEFORE_THE_RUN)
@pytest.mark.parametrize("script", [s for s in ALL if family(s) == "dqn"], ids=lambda s: s.stem)
def test_ctrl_c_before_the_run_is_one_line_and_130(script, case, tmp_path):
    command = script_command(script, before=CTRL_C_BEFORE_THE_RUN[case])
    proc = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["notice: interrupted before the run started; nothing to save"], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


# The step of the first log point at each PPO family's tiny settings (one iteration's batch).
FIRST_LOG_STEP = {"ppo": 128, "ppo_continuous_action": 64, "ppo_atari_envpool": 32, "ppo_torchenv": 128}


@pytest.mark.parametrize("script", [s for s in ALL if family(s) in FIRST_LOG_STEP], ids=lambda s: s.stem)
def test_non_finite_ppo_loss_stops_with_one_line_and_saves_no_broken_weights(script, workdir):
    """A learning rate of 1e30: exit 1 after the summary, one line naming the step, no checkpoint."""
    args = [*TINY[family(script)], "--learning-rate", "1e30", "--save-model"]
    summary, proc = run_script(script, *args, cwd=workdir, check=False)
    assert_one_line_error(proc, "non-finite", f"at step {FIRST_LOG_STEP[family(script)]}")
    assert proc.returncode == 1 and summary["checkpoint"] is None and "no checkpoint saved" in proc.stderr


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["--seed", "abc"]], ids=["unknown-flag", "malformed-value"])
def test_unknown_or_malformed_flag_keeps_tyros_box_as_the_readme_says(argv, workdir):
    _, proc = run_script(ALL[0], *argv, cwd=workdir, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and 5 <= len(lines) <= 9, proc.stderr
    assert lines[0].startswith("\u256d") and argv[-1] in proc.stderr, proc.stderr  # the box's top-left corner
    assert "flag keeps tyro's boxed usage message" in " ".join((ROOT / "README.md").read_text().split())


TORCHRUN_BAD = {
    "flag-rule": (["--learning-rate", "nan"], ["--learning-rate nan"]),
    "batch-rule": (["--total-timesteps", "64"], ["error: --total-timesteps 64 is less than one batch (num_envs * num_steps"
                                                 " * 2 ranks = 128): give at least 128"]),
    "unknown-env": (["--env-id", "NoSuchEnv-v0"], ["NoSuchEnv-v0", "unknown"]),
}  # fmt: skip


@pytest.mark.parametrize("case", TORCHRUN_BAD)
def test_bad_input_under_torchrun_is_one_line_from_rank_0(case, workdir):
    """Rank 0 fails 3 s after rank 1: rank 1 must not exit first and cut rank 0's line."""
    argv, words = TORCHRUN_BAD[case]
    script = scripts("ppo_continuous_action_torchcompile.py")[0]
    slow_rank_0 = "import os, time\nif os.environ['LOCAL_RANK'] == '0': time.sleep(3)"
    proc = torchrun(script, *TINY[family(script)], *argv, cwd=workdir, before=slow_rank_0)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error:"), proc.stderr
    assert all(word in errors[0] for word in words), errors[0]
    # torchrun reports each rank's exit status; its own report of a failed child cannot be helped
    assert proc.stderr.count("exitcode  : 2") >= 1 and "[rank0]: Traceback" not in proc.stderr, proc.stderr
    assert not (workdir / "runs").exists()


# Each rank: torchrun's forwarded SIGINT arrives while the rank ends its loop after the terminal's Ctrl-C.
FORWARDED = """
import os, signal, time, leanrl_utils
checkpoint = leanrl_utils.Run.checkpoint
def forwarded(self, iteration):
    stop = checkpoint(self, iteration)
    if stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    return stop
leanrl_utils.Run.checkpoint = forwarded
"""


def test_ctrl_c_to_the_torchrun_group_saves_and_exits_130(workdir):
    """Ctrl-C to torchrun and every rank: rank 0 saves and prints its summary, every rank exits 130, no traceback."""
    script = LEAN_PPO[0]
    argv = tiny(script, "--save-model", total_timesteps=10_000_000)
    # Each rank's exit status goes to a file: torchrun reports none once it got a signal itself.
    wrapper = f'{shlex.quote(sys.executable)} -c "$LEANRL_TEST_SOURCE" "$@"; echo $? > "status$RANK"'
    err_path = workdir / "stderr.txt"
    with open(err_path, "w") as err_file:
        command = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "--no-python", "bash", "-c", wrapper, "bash"]
        env = script_env(LEANRL_TEST_SOURCE=script_command(script, before=FORWARDED)[2])
        # start_new_session: its own process group, as a terminal's foreground job
        options = dict(cwd=workdir, stdout=subprocess.PIPE, stderr=err_file, text=True, start_new_session=True, env=env)
        proc = subprocess.Popen([*command, str(script), *argv], **options)
        deadline = time.monotonic() + 300
        while "sps=" not in err_path.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)  # the first log point: the ranks are in their training loop
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    err = err_path.read_text()
    (summary,) = summaries(types.SimpleNamespace(stdout=out))
    assert summary["interrupted"] is True and summary["checkpoint"], summary
    assert (workdir / summary["checkpoint"]).exists()
    assert [(workdir / f"status{r}").read_text().strip() for r in (0, 1)] == ["130", "130"], err[-3000:]
    assert "KeyboardInterrupt" not in err and err.count("Traceback") <= err.count("SignalException: Process"), err[-3000:]

"""Nothing lost, nothing silent (every script, from a glob): bad input ends in one `error:` line
and exit status 2 before any training; SIGINT and SIGTERM save a finite checkpoint and print the
summary; checkpoints load as tensors only; the plumbing lives once, in leanrl_utils."""

import contextlib
import os
import pickle
import signal
import sys
from pathlib import Path

import pytest
import torch
import tyro
from conftest import (
    TINY,
    assert_refused_before_work,
    family,
    is_lean,
    last_summary,
    load_script,
    main_in_process,
    run_script,
    scripts,
    start_long_run,
    stop_and_read,
    wait_for,
)

import leanrl_utils

ALL = scripts("*.py")
PLAIN = [s for s in ALL if not is_lean(s)]

# flag -> values that each break its rule; a script is tried on every flag its Args has.
BAD = {
    "seed": ["-1", str(2**32)],
    "total_timesteps": ["-5"],
    "num_envs": ["0"],
    "num_steps": ["0"],
    "num_minibatches": ["0"],
    "update_epochs": ["0"],
    "batch_size": ["0"],
    "buffer_size": ["0"],
    "threads": ["0"],
    "learning_rate": ["nan", "-1"],
    "q_lr": ["nan"],
    "policy_lr": ["-0.1"],
    "gamma": ["1.5", "0"],
    "tau": ["2", "0"],
    "eval_episodes": ["-1"],
    "max_grad_norm": ["inf"],
}
CASES = [
    (script, flag, value)
    for script in ALL
    for flag, values in BAD.items()
    if flag in load_script(script).Args.__dataclass_fields__
    for value in values
]


@pytest.mark.parametrize("script,flag,value", CASES, ids=lambda x: getattr(x, "stem", x))
def test_bad_flag_is_one_line_before_any_work(script, flag, value, tmp_path, monkeypatch, capsys):
    code = main_in_process(
        load_script(script), f"--{flag.replace('_', '-')}", value, tmp_path=tmp_path, monkeypatch=monkeypatch
    )
    assert_refused_before_work(code, capsys, tmp_path, f"--{flag.replace('_', '-')}")


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_track_without_wandb_is_one_line(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    code = main_in_process(load_script(script), "--track", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert_refused_before_work(code, capsys, tmp_path, "wandb")


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_unwritable_run_folder_fails_at_start(script, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").write_text("a file where the runs folder should be")
    code = main_in_process(load_script(script), "--save-model", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert_refused_before_work(code, capsys, tmp_path, "runs/", started=True)


class RunsCode:
    """Unpickling this runs code; a checkpoint must never be able to do that."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def bad_checkpoints(tmp_path, algorithm):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    torch.save({"algorithm": algorithm, "env_id": "Ant-v5", "model": {}}, tmp_path / "whole.pt")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:100])
    torch.save({"algorithm": "other", "env_id": "CartPole-v1", "model": {}}, tmp_path / "other.pt")
    (tmp_path / "code.pt").write_bytes(pickle.dumps(RunsCode()))
    return {
        "empty.pt": ["empty.pt"],
        "text.pt": ["text.pt"],
        "truncated.pt": ["truncated.pt"],
        "other.pt": [algorithm, "other"],
        "whole.pt": ["Ant-v5"],  # the right algorithm, other sizes: names the env it was saved for
        "code.pt": ["code.pt"],
    }


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_a_file_that_is_not_this_pairs_checkpoint_is_one_line(script, tmp_path, monkeypatch, capsys):
    for name, words in bad_checkpoints(tmp_path, leanrl_utils.algorithm_of(script)).items():
        code = main_in_process(
            load_script(script), "--load-model", tmp_path / name, tmp_path=tmp_path, monkeypatch=monkeypatch
        )
        assert_refused_before_work(code, capsys, tmp_path, *words, started=True)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_only_finite_weights_are_saved(script, tmp_path, monkeypatch, capsys):
    """The run's end keeps the current weights if finite, else the last finite ones seen at a log
    point; with none, nothing is saved and a line says so. After a non-finite loss it keeps the
    last good ones and exits 1."""
    monkeypatch.chdir(tmp_path)
    module = load_script(script)
    args = tyro.cli(module.Args, args=[*TINY[family(script)], "--save-model"])
    net = torch.nn.Linear(2, 2)
    for last_good, stop_reason, expected in [
        (None, None, "saved"),
        ("finite", None, "saved"),
        (None, None, None),
        ("finite", "boom", "last"),
    ]:
        run = leanrl_utils.Run(args, 0, script)
        if expected is None or stop_reason:
            with torch.no_grad():
                net.weight.fill_(float("nan"))
        else:
            torch.nn.init.ones_(net.weight)
        if last_good:
            run.last_good = {"net": {k: torch.full_like(v, 7.0) for k, v in net.state_dict().items()}}
        run.stop_reason = stop_reason
        with pytest.raises(SystemExit) if stop_reason else contextlib.nullcontext():
            run.finish(0, 0, {"net": net}, None, device="cpu")
        out, err = capsys.readouterr()
        summary = last_summary(out)
        if expected is None:
            assert summary["checkpoint"] is None and "no checkpoint" in err
            continue
        weight = torch.load(summary["checkpoint"], weights_only=True)["model"]["net"]["weight"]
        assert torch.isfinite(weight).all()
        assert torch.all(weight == (7.0 if expected == "last" else 1.0))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_signal_during_training_saves_and_exits_non_zero(script, signum, workdir):
    """SIGINT exits 130 and SIGTERM 143, after saving a finite checkpoint that loads as tensors."""
    proc = start_long_run(script, workdir, "--total-timesteps", 10_000_000, "--save-model")
    summary = stop_and_read(proc, signum, wait_for(proc, "sps="))
    assert summary["interrupted"] is True and summary["total_steps"] > 0
    checkpoint = torch.load(Path(workdir) / summary["checkpoint"], weights_only=True)
    assert checkpoint["args"]["env_id"] == summary["env_id"]
    assert all(torch.isfinite(t).all() for net in checkpoint["model"].values() for t in net.values())


# Sends `signum` to the script's own process 1 s after its `evaluate` starts.
SIGNAL_IN_EVALUATION = """
import os, sys, threading
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "evaluate" and frame.f_globals["__name__"] == "__main__":
        sys.setprofile(None)
        threading.Timer(1.0, os.kill, (os.getpid(), {signum})).start()
sys.setprofile(profile)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_signal_during_evaluation_still_prints_the_summary(script, signum, workdir):
    summary, _ = run_script(script, *TINY[family(script)], "--save-model", cwd=workdir)
    before = SIGNAL_IN_EVALUATION.format(signum=int(signum))
    proc = start_long_run(
        script,
        workdir,
        "--total-timesteps",
        0,
        "--load-model",
        summary["checkpoint"],
        "--eval-episodes",
        100_000,
        before=before,
    )
    summary = stop_and_read(proc, signum, "", send=False)
    assert summary["interrupted"] is True and summary["eval_return"] is None


@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_interrupt_inside_an_import_is_an_interrupt(script, workdir):
    """A Ctrl-C that lands inside an import while the script sets up comes out as the cause of a
    RuntimeError (Python 3.11, a `__set_name__` interrupted: building a torch optimizer imports
    torch._dynamo). It still ends as an interrupted run: summary, exit 130, no traceback."""
    before = (
        "import torch.optim\n"
        "def interrupted(*args, **kwargs):\n"
        "    raise RuntimeError('Error calling __set_name__') from KeyboardInterrupt()\n"
        "torch.optim.Optimizer.__init__ = interrupted"
    )
    proc = start_long_run(script, workdir, "--total-timesteps", 10_000, "--save-model", before=before)
    summary = stop_and_read(proc, signal.SIGINT, "", send=False)
    assert summary["interrupted"] is True and summary["total_steps"] == 0 and summary["checkpoint"] is None


def test_no_script_writes_the_plumbing_again():
    """What leanrl_utils holds (Run, the argument rules, checkpoints, optimizers, seed stacking,
    env wrappers, torchrun helpers) is imported by the scripts, never defined in one of them."""
    import ast

    shared = {name for name, value in vars(leanrl_utils).items() if getattr(value, "__module__", None) == "leanrl_utils"}
    shared |= {"RULES", "COUNTS", "VALUE_GUARDS"}
    assert {"Run", "fail", "check_args", "load_checkpoint", "Adam", "RAdam", "stack_seeds", "SameStepEnvs"} <= shared
    for script in ALL:
        tree = ast.parse(script.read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }
        # The plain scripts keep their own host-side ReplayBuffer, CleanRL's code.
        allowed = set() if is_lean(script) else {"ReplayBuffer"}
        assert defined & shared <= allowed, (script.name, defined & shared)

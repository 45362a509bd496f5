"""Bad input is one `error:` line and exit 2 before any work; signals save and summarize; the plumbing lives once."""

import contextlib
import importlib
import os
import pickle
import pkgutil
import signal
import sys
from itertools import cycle
from pathlib import Path

import pytest
import torch
from conftest import (
    TERMINAL,
    TINY,
    assert_refused_before_work,
    family,
    is_lean,
    last_summary,
    load_script,
    main_in_process,
    pair,
    run_script,
    scripts,
    start_long_run,
    stop_and_read,
    tiny_args,
    wait_for,
)

import leanrl_utils

try:
    import resource
except ImportError:  # Windows
    resource = None

ALL = scripts("*.py")
PLAIN = [s for s in ALL if not is_lean(s)]
DQN, DQN_LEAN = pair("dqn")
SEEDED = [s for s in ALL if "num_seeds" in load_script(s).Args.__dataclass_fields__]
DISTRIBUTED = [s for s in ALL if "dist_timeout" in load_script(s).Args.__dataclass_fields__]


def in_turn(scripts):  # each script once, SIGINT and SIGTERM in turn: every script and both signals (handled alike)
    return [pytest.param(s, n, id=f"{s.stem}-{n.name}") for s, n in zip(scripts, cycle([signal.SIGINT, signal.SIGTERM]))]


def cases(scripts, argvs, words, missing=None):
    """(script, argv, words, a module made missing) for each script with each argv; `words` may be made from argv."""
    make = words if callable(words) else lambda *argv: words
    ids = lambda s, argv: f"{s.stem} {' '.join(map(str, argv))}"
    return [pytest.param(s, argv, make(*argv), missing, id=ids(s, argv)) for s in scripts for argv in argvs]


# flag -> values that each break its rule; a script is tried on every flag its Args has.
BAD = {"seed": ["-1", str(2**32)], "total_timesteps": ["-5"], "num_envs": ["0"], "num_steps": ["0"], "num_minibatches": ["0"],
       "update_epochs": ["0"], "batch_size": ["0"], "buffer_size": ["0"], "threads": ["0"], "learning_rate": ["nan", "-1"],
       "q_lr": ["nan"], "policy_lr": ["-0.1"], "gamma": ["1.5", "0"], "tau": ["2", "0"], "eval_episodes": ["-1"],
       "max_grad_norm": ["inf"], "policy_frequency": ["0"], "num_seeds": ["0"]}  # fmt: skip
REFUSALS = [
    *(case for s in ALL for flag, values in BAD.items() if flag in load_script(s).Args.__dataclass_fields__
      for case in cases([s], [[f"--{flag.replace('_', '-')}", v] for v in values], lambda flag, v: [f"{flag} {v}"])),
    *cases(ALL, [["--track"]], ["wandb"], missing="wandb"),
    *cases(ALL, [["--capture-video"]], ["leanrl[video]"], missing="moviepy"),
    *cases(ALL, [["--load-model", "nope.pt"]], ["nope.pt"]),
    *cases([DQN], [["--exp-name", n] for n in ["../../escape", "", "sweep/lr1", ".hidden", "..", "a\\b", "tab\there"]],
           ["--exp-name"]),
    *cases(DISTRIBUTED, [["--dist-timeout", v] for v in ["nan", "-5", "inf", "0"]], ["--dist-timeout"]),
    *cases(ALL, [["--seed", seed] for seed in [4294967295, 2**31 - 5, -1]], ["--seed", "2**31"]),  # every derived seed too
]  # fmt: skip


@pytest.mark.parametrize("script, argv, words, missing", REFUSALS)
def test_bad_input_is_one_line_before_any_work(script, argv, words, missing, tmp_path, monkeypatch, capsys):
    """A flag breaking its rule, a missing extra (its import fails) or checkpoint: exit 2, one line, no run folder."""
    if missing:
        monkeypatch.setitem(sys.modules, missing, None)
    code = main_in_process(load_script(script), *argv, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert_refused_before_work(code, capsys, tmp_path, *words)


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_unwritable_run_folder_fails_at_start(script, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").write_text("a file where the runs folder should be")
    code = main_in_process(load_script(script), "--save-model", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert_refused_before_work(code, capsys, tmp_path, "runs/", started=True)


@pytest.mark.parametrize("world_size", [1, 4])
def test_the_seed_limit_counts_seeds_envs_ranks_and_evaluation(world_size, monkeypatch, capsys):
    """seed + WORLD_SIZE + num_seeds * num_envs + 10000 (evaluation's seed) < 2**31."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    limit = 2**31 - (world_size + 3 * 2 + 10_000)
    leanrl_utils.checks.flags(tiny_args(DQN_LEAN, "--num-seeds", 3, "--num-envs", 2, "--seed", limit - 1))
    with pytest.raises(SystemExit):
        leanrl_utils.checks.flags(tiny_args(DQN_LEAN, "--num-seeds", 3, "--num-envs", 2, "--seed", limit))
    assert str(limit) in capsys.readouterr().err


@pytest.mark.parametrize("script", SEEDED, ids=lambda s: s.stem)
def test_num_seeds_beyond_the_open_file_limit_is_refused_first(script, tmp_path, monkeypatch, capsys):
    """Each seed holds files open: refused before any folder or big allocation (or by a script's memory check)."""
    with open_file_limit(1024):
        code = main_in_process(load_script(script), "--num-seeds", 100_000, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert_refused_before_work(code, capsys, tmp_path, "--num-seeds")


def test_the_open_file_check_counts_files_per_seed(capsys):
    with open_file_limit(1024):
        leanrl_utils.checks.open_files(100)
        with pytest.raises(SystemExit):
            leanrl_utils.checks.open_files(100_000)
    assert "open files" in capsys.readouterr().err


@contextlib.contextmanager
def open_file_limit(limit):
    """At most `limit` open files (the common default) for the block."""
    if resource is None:
        pytest.skip("no RLIMIT_NOFILE on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def malformed(good):
    """name -> (checkpoint, words its refusal names) for checkpoints of the right algorithm."""
    algorithm, env_id, model = good["algorithm"], good["env_id"], good["model"]
    network, weights = next(iter(model.items()))
    name = next(k for k, v in weights.items() if v.is_floating_point())
    with_weight = lambda value: {**model, network: {**weights, name: torch.full_like(weights[name], value)}}
    checkpoint = lambda **fields: {"algorithm": algorithm, "env_id": env_id, "model": model, **fields}
    return {
        "only_algorithm": ({"algorithm": algorithm}, []),
        "no_model": ({"algorithm": algorithm, "env_id": env_id}, []),
        "no_env_id": ({"algorithm": algorithm, "model": model}, []),
        "env_id_not_a_string": (checkpoint(env_id=5), []),
        "model_a_list": (checkpoint(model=[1, 2]), []),
        "model_none": (checkpoint(model=None), []),
        "network_a_list": (checkpoint(model={**model, network: [1.0]}), []),
        "weight_named_by_a_number": (checkpoint(model={**model, network: {0: weights[name]}}), []),
        "weight_a_number": (checkpoint(model={**model, network: {**weights, name: 1.5}}), []),
        "nan_weights": (checkpoint(model=with_weight(float("nan"))), ["non-finite"]),
        "inf_weights": (checkpoint(model=with_weight(float("inf"))), ["non-finite"]),
        "not_a_dict": ([algorithm, env_id, model], []),
    }


@pytest.mark.parametrize("script", [DQN, pair("ppo_continuous_action")[1]], ids=lambda s: s.stem)
def test_a_malformed_checkpoint_is_one_line(script, tmp_path, monkeypatch, capsys):
    module = load_script(script)
    assert main_in_process(module, "--save-model", tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    (saved,) = tmp_path.glob("runs/*/*.pt")
    good = torch.load(saved, weights_only=True)
    capsys.readouterr()
    for name, (checkpoint, words) in malformed(good).items():
        path = tmp_path / f"{name}.pt"
        torch.save(checkpoint, path)
        code = main_in_process(module, "--load-model", path, tmp_path=tmp_path, monkeypatch=monkeypatch)
        assert_refused_before_work(code, capsys, None, f"{name}.pt", *words, started=True)


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
        "code.pt": ["code.pt"],
        "whole.pt": ["Ant-v5"],  # the right algorithm, other sizes (last: refused once its run exists)
    }


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_a_file_that_is_not_this_pairs_checkpoint_is_one_line(script, tmp_path, monkeypatch, capsys):
    for name, words in bad_checkpoints(tmp_path, leanrl_utils.checkpoints.algorithm_of(script)).items():
        path = tmp_path / name
        code = main_in_process(load_script(script), "--load-model", path, tmp_path=tmp_path, monkeypatch=monkeypatch)
        assert_refused_before_work(code, capsys, tmp_path, *words, started=True)
        assert name == "whole.pt" or not any((tmp_path / "runs").glob("*")), list((tmp_path / "runs").rglob("*"))
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_only_finite_weights_are_saved(script, tmp_path, monkeypatch, capsys):
    """The end saves finite weights only (else the last finite ones, else none); a non-finite loss exits 1."""
    monkeypatch.chdir(tmp_path)
    args, net = tiny_args(script, "--save-model"), torch.nn.Linear(2, 2)
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
        assert torch.isfinite(weight).all() and torch.all(weight == (7.0 if expected == "last" else 1.0))


@pytest.mark.parametrize("script, signum", in_turn(ALL))
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


@pytest.mark.parametrize("script, signum", in_turn(PLAIN))
def test_signal_during_evaluation_still_prints_the_summary(script, signum, workdir):
    summary, _ = run_script(script, *TINY[family(script)], "--save-model", cwd=workdir)
    before = SIGNAL_IN_EVALUATION.format(signum=int(signum))
    argv = ["--total-timesteps", 0, "--load-model", summary["checkpoint"], "--eval-episodes", 100_000]
    proc = start_long_run(script, workdir, *argv, before=before)
    summary = stop_and_read(proc, signum, "", send=False)
    assert summary["interrupted"] is True and summary["eval_return"] is None


@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_ctrl_c_while_setting_up_is_an_interrupted_run(script, workdir):
    """A Ctrl-C before the loop: summary, exit 130, no traceback, no untrained checkpoint."""
    before = TERMINAL + (
        "import os, signal, torch.optim\n"
        "_init = torch.optim.Optimizer.__init__\n"  # the optimizer's __init__ signals, then runs
        "torch.optim.Optimizer.__init__ = lambda *a, **k: (os.kill(os.getpid(), signal.SIGINT), _init(*a, **k))[1]"
    )
    proc = start_long_run(script, workdir, "--total-timesteps", 10_000, "--save-model", before=before)
    summary = stop_and_read(proc, signal.SIGINT, "", send=False)
    assert summary["interrupted"] is True and summary["total_steps"] == 0 and summary["checkpoint"] is None


def test_no_script_writes_the_plumbing_again():
    """What leanrl_utils holds (Run, rules, checkpoints, optimizers, seeds, env wrappers, ...) no script defines again."""
    import ast

    modules = [importlib.import_module(f"leanrl_utils.{m.name}") for m in pkgutil.iter_modules(leanrl_utils.__path__)]
    shared = {name for m in modules for name, value in vars(m).items() if getattr(value, "__module__", None) == m.__name__}
    shared |= {"RULES", "COUNTS", "VALUE_GUARDS"}
    assert {"Run", "fail", "flags", "load", "Adam", "RAdam", "stack", "SameStepEnvs", "ReplayBuffer"} <= shared
    for script in ALL:
        tree = ast.parse(script.read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }
        # The plain scripts keep their own host-side ReplayBuffer, CleanRL's code.
        allowed = set() if is_lean(script) else {"ReplayBuffer"}
        assert defined & shared <= allowed, (script.name, defined & shared)

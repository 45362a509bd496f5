"""Shared helpers: run a script (subprocess or in process), read its summary, import it, compare plain and lean runs."""

import copy
import importlib.util
import json
import os
import pkgutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import leanrl_utils

# Every module of the package, so that the tests reach each as leanrl_utils.<module>.
for _module in pkgutil.iter_modules(leanrl_utils.__path__):
    importlib.import_module(f"leanrl_utils.{_module.name}")

# One intra-op thread in each test process too: OpenMP's spinning threads beside another busy worker stall tenfold.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"
# Source for `before` that restores a terminal's SIGINT: where a shell or xdist ignores it, a child inherits that.
TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def pytest_collection_modifyitems(items):  # learning runs first: under xdist they overlap short tests, not end the suite
    items.sort(key=lambda item: item.get_closest_marker("learning") is None)


def scripts(pattern):
    """Script paths matching a glob inside leanrl/, sorted; never a hand-typed list."""
    found = sorted(SCRIPTS.glob(pattern))
    assert found, f"no script matches {pattern}"
    return found


def script_env(**extra):
    """A script's environment: one intra-op thread (as the benchmark runs), unbuffered output, wandb off."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **extra}


def run_script(script, *args, cwd, timeout=600, env=None, check=True, before="", after=""):
    """Run a script in a subprocess (source `before` first, `after` at its end); return (its summary or None, proc)."""
    command = [*(script_command(script, before, after) if before or after else [sys.executable, str(script)]), *map(str, args)]
    proc = subprocess.run(command, cwd=cwd, env=script_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{Path(script).name} {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return last_summary(proc.stdout), proc


def last_summary(stdout):
    """The summary: the last stdout line as strict JSON (NaN or Infinity in it fails the test)."""
    lines = stdout.strip().splitlines()
    return json.loads(lines[-1], parse_constant=pytest.fail) if lines and lines[-1].startswith("{") else None


def script_command(script, before="", after=""):
    """The command running `script` as __main__ with the Python source `before` first and `after` once it returns."""
    run = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')"
    return [sys.executable, "-c", f"{before}\n{run}\n{after}", str(script)]


def start_script(script, cwd, *argv, before=None, **popen):
    """The script in the background (stdout and stderr piped, text); `before`: source its process runs first."""
    command = script_command(script, before=before) if before else [sys.executable, str(script)]
    options = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    return subprocess.Popen([*command, *map(str, argv)], cwd=cwd, env=script_env(), **options)


def signal_at_step(at, times=1, signum=signal.SIGTERM, where="gymnasium.wrappers:RecordEpisodeStatistics"):
    """Source sending `signum` to the process at the `at`-th `step` of `where` (module:Class), `times` times."""
    module, name = where.split(":")
    return f"""
import importlib, os, time
_class = getattr(importlib.import_module({module!r}), {name!r})
_step, _calls = _class.step, [0]
def step(self, *args):
    _calls[0] += 1
    for _ in range({times} if _calls[0] == {at} else 0):
        os.kill(os.getpid(), {int(signum)})
        time.sleep(0.001)
    return _step(self, *args)
_class.step = step
"""


def start_long_run(script, workdir, *extra, before=None):
    """The script at tiny settings but `extra`, no budget, in the background, SIGINT at its default disposition."""
    argv = tiny(script, *extra, total_timesteps=None)
    return start_script(script, workdir, *argv, before=before, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc, text, timeout=180):
    """Read the process's stderr until `text` shows (the test fails if it never does); returns it."""
    seen, deadline = "", time.time() + timeout
    while text not in seen and time.time() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
    assert text in seen, seen
    return seen


def stop_and_read(proc, signum, seen, send=True):
    """Send `signum` (send=False: wait for the script's own); the exit status it stands for, no traceback; the summary."""
    if send:
        proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, (proc.returncode, seen + stderr)
    assert "Traceback" not in stderr, stderr
    return last_summary(stdout)


def spy(monkeypatch, owner, name, keep=lambda out, *args, **kwargs: out):
    """Wrap `owner.name` for the test: each call appends keep(its result, its arguments) to the list returned."""
    seen, original = [], getattr(owner, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(keep(out, *args, **kwargs))
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return seen


def scalars(run_dir, but=("charts/SPS",)):
    """Every scalar in a run's TensorBoard events, (tag, step, value) in the order written, but the tags `but`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = [e for path in sorted(Path(run_dir).glob("events.out.tfevents.*")) for e in EventFileLoader(str(path)).Load()]
    return [(v.tag, e.step, v.tensor.float_val[0]) for e in events for v in e.summary.value
            if v.tag not in but and len(v.tensor.float_val) == 1]  # fmt: skip


final_weights = lambda workdir, summary: torch.load(Path(workdir) / summary["checkpoint"], weights_only=True)["model"]


def run_without(module, script, *args, cwd):
    """Run a script as if `module` were not installed (its import fails)."""
    command = [*script_command(script, before=f"import sys; sys.modules[{module!r}] = None"), *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=600)


def error_line(err, *words):
    """Of stderr `err`: its one line starting with 'error:', naming `words` (any case), and no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert all(word.lower() in errors[0].lower() for word in words), errors[0]
    return errors[0]


def refused_call(capsys, call, *args, words=(), **kwargs):
    """call(*args, **kwargs) exits 2, its stderr one `error:` line naming `words`; returns the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        call(*args, **kwargs)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error:") and err.count("\n") == 1 and all(w in err for w in words), err
    return error_line(err, *words)


def assert_one_line_error(proc, *words, code=None):
    """Non-zero exit (`code` if given), one `error:` line naming `words`, no traceback; returns the line."""
    assert proc.returncode != 0 if code is None else proc.returncode == code, (proc.returncode, proc.stderr)
    return error_line(proc.stderr, *words)


def assert_bad_input(script, *argv, words, cwd, **options):
    """The script run with `argv` ends with exit status 2 and one `error:` line naming `words`."""
    _, proc = run_script(script, *argv, cwd=cwd, check=False, **options)
    return assert_one_line_error(proc, *words, code=2)


def load_script(path):
    """Import a script as a module (nothing runs at import) to reach its factories."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # Registered, because dynamo looks a compiled function's globals up through sys.modules.
    spec.loader.exec_module(module)
    return module


def main_in_process(module, *argv, tmp_path, monkeypatch):
    """A script module's main at its tiny settings plus `argv`, in this process, from tmp_path; its exit code."""
    monkeypatch.chdir(tmp_path)
    import tyro

    args = tyro.cli(module.Args, args=tiny(module.__file__, *argv))
    try:
        module.main(args)
    except SystemExit as e:
        return e.code
    return 0


def trained_checkpoints(module, *argv, tmp_path, monkeypatch, capsys):
    """main_in_process with `argv` and --save-model runs through; its summary and every checkpoint's (finite) model."""
    assert main_in_process(module, *argv, "--save-model", tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    models = [torch.load(path, weights_only=True)["model"] for path in sorted(tmp_path.glob("runs/*/*.pt"))]
    assert all(torch.isfinite(t).all() for model in models for net in model.values() for t in net.values())
    return last_summary(capsys.readouterr().out), models


def refused_in_process(module, *argv, tmp_path, monkeypatch, capsys, words=()):
    """main_in_process with `argv` exits 2 with one `error:` line naming `words`, nothing on stdout; the line."""
    code = main_in_process(module, *argv, tmp_path=tmp_path, monkeypatch=monkeypatch)
    out, err = capsys.readouterr()
    assert code == 2 and out.strip() == "", (code, out, err)
    return error_line(err, *words)


def short_env(env_id, max_episode_steps):
    """The id of a registered copy of gymnasium's `env_id` with a shorter time limit."""
    import gymnasium as gym

    spec = gym.spec(env_id)
    short_id = f"LeanRLTest/{spec.name}{max_episode_steps}-v{spec.version}"
    if short_id not in gym.registry:
        gym.register(short_id, entry_point=spec.entry_point, max_episode_steps=max_episode_steps)
    return short_id


def shuffle_as_lean(x):
    """np.random.shuffle drawing the order torch.randperm draws, as the lean twin draws its minibatches."""
    x[:] = torch.randperm(len(x)).numpy()


class TorchDrawingAsLean:
    """torch for a plain PQN script, drawing each rollout's epsilon-greedy numbers as the lean `draw_exploration`."""

    def __init__(self, num_steps):
        self.num_steps, self.step = num_steps, 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def randint(self, low, high, size):
        if self.step % self.num_steps == 0:
            self.uniforms = torch.rand(self.num_steps, *size)
            self.random_actions = torch.randint(high, (self.num_steps, *size))
        self.step += 1
        return self.random_actions[(self.step - 1) % self.num_steps]

    def rand(self, size):
        return self.uniforms[(self.step - 1) % self.num_steps]


class NumpyDrawingAsLean:
    """numpy for a plain script, drawing from torch's stream as its lean twin: minibatch rows, blocks of exploration."""

    def __init__(self, draw_steps=None):
        self.random = self.Random(draw_steps)

    def __getattr__(self, name):
        return getattr(np, name)

    class Random:
        def __init__(self, draw_steps):
            self.draw_steps, self.step = draw_steps, 0

        def __getattr__(self, name):
            return getattr(np.random, name)

        def random(self, n):  # a step's uniforms
            if self.step % self.draw_steps == 0:
                self.uniforms = torch.rand(self.draw_steps, n).numpy()
            self.step += 1
            return self.uniforms[(self.step - 1) % self.draw_steps]

        def randint(self, low, high=None, size=None):
            if high is None:  # a step's random actions, randint(n_act, size=num_envs), after its uniforms
                if (self.step - 1) % self.draw_steps == 0:
                    self.actions = torch.randint(low, (self.draw_steps, size)).numpy()
                return self.actions[(self.step - 1) % self.draw_steps]
            return torch.randint(high, (size,)).numpy()  # a minibatch's rows, randint(0, rows, size=batch)


def atari_batch(n, seed, *fields, n_act=4):
    """A flat batch of Atari frames: frames, actions, `fields` (drawn by f(n, generator)), valid (1 step in 8 not)."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, n_act, (n,), generator=g)
    return (frames, actions, *(draw(n, g) for draw in fields), (torch.rand(n, generator=g) > 0.125).float())


def assert_plain_dqn_step(metrics, nets, optimizer, batch, gamma, seed_net, tolerance):
    """The plain DQN step on one seed's batch and `nets`: the lean metrics and that seed's parameters match it."""
    (q_ref, target_ref), (obs, actions, next_obs, rewards, dones) = nets, batch
    with torch.no_grad():
        td_target = rewards + gamma * target_ref(next_obs).max(dim=1).values * (1 - dones)
    old_val = q_ref(obs).gather(1, actions.unsqueeze(1)).squeeze(1)
    loss = torch.nn.functional.mse_loss(td_target, old_val)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(metrics, torch.stack([loss, old_val.mean()]).detach(), **tolerance)
    torch.testing.assert_close(seed_net.state_dict(), q_ref.state_dict(), **tolerance)


def plain_twin_critic_step(qf1, qf2, optimizer, obs, actions, next_q_value):
    """The plain SAC and TD3 scripts' critic step as in their loops; its metrics in the lean METRICS' order."""
    qf1_a_values, qf2_a_values = qf1(obs, actions).view(-1), qf2(obs, actions).view(-1)
    qf1_loss = torch.nn.functional.mse_loss(qf1_a_values, next_q_value)
    qf2_loss = torch.nn.functional.mse_loss(qf2_a_values, next_q_value)
    qf_loss = qf1_loss + qf2_loss
    optimizer.zero_grad()
    qf_loss.backward()
    optimizer.step()
    return [qf_loss / 2.0, qf1_loss, qf2_loss, qf1_a_values.mean(), qf2_a_values.mean()]


def dqn_learner(lean, nets, targets, storage, gamma=0.99, learning_rate=2.5e-4):
    """A lean DQN script's set-up over copies of `nets` and `targets`: (nets, params, target_params, update)."""
    nets, targets = copy.deepcopy(nets), copy.deepcopy(targets)
    params, target_params = leanrl_utils.seeds.stack(nets), leanrl_utils.seeds.stack(targets)
    optimizer = leanrl_utils.optimizers.Adam(params.items(), learning_rate)
    update = lean.make_update(nets[0], dict(target_params.items()), optimizer, storage, gamma, len(nets))
    return nets, params, target_params, update


def build_plain_targets_too(lean, monkeypatch, targets):
    """The lean script also builds `targets` after its first three networks, as the plain one draws their weights."""
    originals, built = {name: getattr(lean, name) for name in set(targets) | {"Actor"}}, []

    def builder(name):
        def build(*args, **kwargs):
            net = originals[name](*args, **kwargs)
            if kwargs.get("device") != "meta":
                built.append((name, args, kwargs))
                if len(built) == 3:
                    for target in targets:
                        _, a, k = next(b for b in built if b[0] == target)
                        originals[target](*a, **k)
            return net

        return build

    for name in originals:
        monkeypatch.setattr(lean, name, builder(name))


def recorded_runs(modules, args, monkeypatch):
    """Each module's main with `args` in turn; per module, every log point's metrics and the final weights."""
    threads, runs = torch.get_num_threads(), []
    values = lambda out, self, step, updates, metrics, nets: {k: float(v) for k, v in metrics.items()}
    weights = lambda out, self, step, updates, nets, *rest, **kw: {
        f"{m}.{k}": v.detach().clone() for m, net in nets.items() for k, v in net.state_dict().items()}  # fmt: skip
    torch.set_num_threads(1)
    try:
        for module in modules:  # Run lives in leanrl_utils, shared by every script: patched anew for each module
            with monkeypatch.context() as patch:
                logged, final = spy(patch, leanrl_utils.Run, "log", values), spy(patch, leanrl_utils.Run, "finish", weights)
                module.main(module.Args(**args))
            runs.append((logged, final[-1]))
    finally:
        torch.set_num_threads(threads)
    return runs


def assert_same_run(plain_run, lean_run, names, metrics_abs=1e-6, weights_rtol=1e-4, weights_atol=1e-6):
    """Two recorded runs log the same metrics `names` at every log point and end with the same weights."""
    (plain_logs, plain_final), (lean_logs, lean_final) = plain_run, lean_run
    assert len(plain_logs) == len(lean_logs) > 1 and any(name in log for log in lean_logs for name in names)
    for i, (p, q) in enumerate(zip(plain_logs, lean_logs)):
        for name in names:
            assert (name in p) == (name in q), (i, name)  # DQN logs no loss before learning starts
            if name in p:
                assert q[name] == pytest.approx(p[name], rel=1e-5, abs=metrics_abs), (i, name)
    torch.testing.assert_close(lean_final, plain_final, rtol=weights_rtol, atol=weights_atol)


@pytest.fixture
def inductor_fallback_random():
    """Compiled code draws from the eager stream (inductor's own config.patch: monkeypatch's undo breaks its config)."""
    import torch._inductor.config

    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.fixture
def workdir(tmp_path):
    """Each run writes runs/ and videos/ under its own temporary folder."""
    return tmp_path


# The algorithm a script belongs to: its file name without `_torchcompile` and `.py`.
family = lambda script: Path(script).stem.removesuffix("_torchcompile")
is_lean = lambda script: Path(script).stem.endswith("_torchcompile")


# Tiny settings per family (every script has one): updates and log points twice in seconds on a cheap env.
CARTPOLE_ROLLOUTS = "--total-timesteps 512 --num-envs 2 --num-steps 64 --num-minibatches 2 --update-epochs 2"
# Atari PPO and PQN: 2 envs, 16 steps, 2 iterations (4 minibatch updates each).
ATARI_ROLLOUTS = "--env-id Breakout-v5 --num-envs 2 --num-steps 16 --total-timesteps 64 --num-minibatches 2 --update-epochs 2"
PENDULUM = " --buffer-size 1000"
TINY = {family: argv.split() for family, argv in {
    **dict.fromkeys(["ppo", "pqn", "pqn_torchenv", "ppo_torchenv"], CARTPOLE_ROLLOUTS),
    **dict.fromkeys(["ppo_atari_envpool", "pqn_atari_envpool"], ATARI_ROLLOUTS),
    "ppo_continuous_action": "--env-id InvertedPendulum-v5 --total-timesteps 256 --num-steps 64 --num-minibatches 2"
    " --update-epochs 2",
    # Learning starts after step 64 (SAC: 236 updates; logs at steps 100, 200, 300) or 32 (TD3: 208; 100, 200, 240).
    "sac_continuous_action": "--env-id Pendulum-v1 --total-timesteps 300 --learning-starts 64 --batch-size 32" + PENDULUM,
    "td3_continuous_action": "--env-id Pendulum-v1 --total-timesteps 240 --learning-starts 32 --batch-size 16" + PENDULUM,
    # Learning starts at step 100; 75 updates; target copies every 50 steps; logs at steps 100, 200, 300, 400.
    "dqn": "--total-timesteps 400 --learning-starts 100 --batch-size 32 --buffer-size 500 --train-frequency 4"
    " --target-network-frequency 50",
    # Atari: 2 envs, as DQN's, and a buffer of 100 rows per env, which wraps.
    "dqn_atari_envpool": "--env-id Breakout-v5 --num-envs 2 --total-timesteps 400 --learning-starts 100 --batch-size 32"
    " --buffer-size 200 --target-network-frequency 50",
}.items()}  # fmt: skip


def tiny(script, *argv, **flags):
    """TINY's arguments for `script` (a path or a family), `flags` set (None: left out), then `argv`."""
    out = list(TINY[family(script)])
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            del out[out.index(flag) : out.index(flag) + 2]
        out += [] if value is None else [flag, str(value)]
    return [*out, *map(str, argv)]


def tiny_args(script, *argv):
    """The script's Args at its tiny settings plus `argv`."""
    import tyro

    return tyro.cli(load_script(script).Args, args=tiny(script, *argv))


def tiny_value(script, flag, default=None):
    """The integer TINY gives `flag` for `script`, or `default`."""
    argv = TINY[family(script)]
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


pair = lambda name: (scripts(f"{name}.py")[0], scripts(f"{name}_torchcompile.py")[0])  # a family's plain and lean scripts


# The test module's FAMILY, its plain and its lean script, each imported once for the module; `either`: each in turn.
plain = pytest.fixture(scope="module", name="plain")(lambda request: load_script(pair(request.module.FAMILY)[0]))
lean = pytest.fixture(scope="module", name="lean")(lambda request: load_script(pair(request.module.FAMILY)[1]))
either = pytest.fixture(params=["plain", "lean"], name="either")(lambda request: request.getfixturevalue(request.param))


def assert_refused_before_work(code, capsys, tmp_path, *words, started=False):
    """One `error:` line naming `words`, exit 2, no traceback, training or summary; unless `started`, no run folder."""
    out, err = capsys.readouterr()
    assert code == 2 and "sps=" not in err and out.strip() == "", (code, out, err)  # no training, no summary
    assert started or not (tmp_path / "runs").exists()  # nothing was set up
    return error_line(err, *words)


# One agent's parameters as a lean script holds them: a stack of one, the agent's own its views.
stack_of_one = lambda agent: leanrl_utils.seeds.stack([agent]).items()
# A lean update over a stack of one, called with one agent's batch and minibatch rows.
unstacked = lambda update: lambda *batch_and_idx: update(*(x[None] for x in batch_and_idx))[0]

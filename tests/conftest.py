"""Shared helpers for the script tests: run a script as a subprocess, read its summary line,
import a script as a module (for the numerics tests), list scripts by glob, and run a plain
script and its lean twin in this process on the same random draws (the whole-run tests)."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import leanrl_utils

# One intra-op thread in each test process too: pytest-xdist runs a worker per core, and
# OpenMP's spinning threads beside another busy process stall small ops tenfold.
torch.set_num_threads(1)

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


def script_command(script, before="", after=""):
    """The command that runs `script` as __main__ (its arguments go after it) in a Python that
    runs the source `before` first and `after` once the script returns."""
    run = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')"
    return [sys.executable, "-c", f"{before}\n{run}\n{after}", str(script)]


def run_without(module, script, *args, cwd):
    """Run a script as if `module` were not installed (its import fails)."""
    return subprocess.run(
        [*script_command(script, before=f"import sys; sys.modules[{module!r}] = None"), *map(str, args)],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=600,
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


def short_env(env_id, max_episode_steps):
    """The id of a registered copy of gymnasium's `env_id` with a shorter time limit, so that
    short runs see episodes truncated (and, with random play, terminated)."""
    import gymnasium as gym

    spec = gym.spec(env_id)
    short_id = f"LeanRLTest/{spec.name}{max_episode_steps}-v{spec.version}"
    if short_id not in gym.registry:
        gym.register(short_id, entry_point=spec.entry_point, max_episode_steps=max_episode_steps)
    return short_id


def shuffle_as_lean(x):
    """np.random.shuffle for a plain script, with the order torch.randperm draws, as its lean
    twin draws a minibatch order."""
    x[:] = torch.randperm(len(x)).numpy()


class TorchDrawingAsLean:
    """torch for a plain PQN script, but for its per-step epsilon-greedy draws: at a rollout's
    first step it draws the whole rollout's uniforms and random actions as the lean script's
    `draw_exploration` does (two calls, in its order), then serves them one step at a time."""

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
    """numpy for a plain script, with its random draws taken from torch's stream in the order
    its lean twin draws them: each minibatch's row indices as the device buffers' `sample` draws
    them, and (DQN) every `draw_steps` steps the block of epsilon-greedy uniforms and of random
    actions that `draw_exploration` draws, served one step at a time."""

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


def build_plain_targets_too(lean, monkeypatch, targets):
    """The plain SAC and TD3 scripts build their target networks as modules, whose initial
    weights (overwritten by copies at once) draw from torch's stream; the lean scripts clone
    parameters, which draws nothing. So that the lean script's later draws meet the same
    stream, its actor and two Q-networks (its first three networks, as in the plain script) are
    followed by throwaway builds of the plain script's target networks: `targets`, class names
    in the plain script's order."""
    originals = {name: getattr(lean, name) for name in set(targets) | {"Actor"}}
    built = []

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
    """Each script module's main with `args` (a dict of Args fields), one after the other in this
    process with one intra-op thread (as the lean scripts set it; another count sums in another
    order); returns per module the metrics of every log point and the final weights of the
    networks its Run.finish saves, as "network.parameter" -> tensor."""
    import leanrl_utils

    threads, runs = torch.get_num_threads(), {}
    log, finish = leanrl_utils.Run.log, leanrl_utils.Run.finish
    torch.set_num_threads(1)
    try:
        for module in modules:
            logged, final = [], {}

            def recording_log(self, step, updates, metrics, networks, logged=logged):
                logged.append({k: float(v) for k, v in metrics.items()})
                return log(self, step, updates, metrics, networks)

            def recording_finish(self, step, updates, networks, *rest, final=final, **fields):
                final.update(
                    {f"{name}.{k}": v.detach().clone() for name, net in networks.items() for k, v in net.state_dict().items()}
                )
                return finish(self, step, updates, networks, *rest, **fields)

            # Run lives in leanrl_utils, shared by every script: patched anew for each module.
            monkeypatch.setattr(leanrl_utils.Run, "log", recording_log)
            monkeypatch.setattr(leanrl_utils.Run, "finish", recording_finish)
            module.main(module.Args(**args))
            runs[module] = logged, final
    finally:
        torch.set_num_threads(threads)
    return [runs[module] for module in modules]


def assert_same_run(plain_run, lean_run, names, metrics_abs=1e-6, weights_rtol=1e-4, weights_atol=1e-6):
    """Two recorded runs (`recorded_runs`) log the same metrics `names` at every log point and
    end with the same weights, within the given tolerances."""
    (plain_logs, plain_final), (lean_logs, lean_final) = plain_run, lean_run
    assert len(plain_logs) == len(lean_logs) > 1
    assert any(name in log for log in lean_logs for name in names)
    for i, (p, q) in enumerate(zip(plain_logs, lean_logs)):
        for name in names:
            assert (name in p) == (name in q), (i, name)  # DQN logs no loss before learning starts
            if name in p:
                assert q[name] == pytest.approx(p[name], rel=1e-5, abs=metrics_abs), (i, name)
    assert plain_final.keys() == lean_final.keys()
    for name in plain_final:
        torch.testing.assert_close(
            lean_final[name], plain_final[name], rtol=weights_rtol, atol=weights_atol, msg=lambda m, name=name: f"{name}: {m}"
        )


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
        "--env-id",
        "InvertedPendulum-v5",
        "--total-timesteps",
        "256",
        "--num-steps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
    # CartPole: 2 envs, 64 steps: 4 iterations of 4 minibatch updates, a log point after each.
    "ppo": [
        "--total-timesteps",
        "512",
        "--num-envs",
        "2",
        "--num-steps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
    # CartPole on torch-native envs: as "ppo"; the lean script's rollout in calls of 8 steps.
    "ppo_torchenv": [
        "--total-timesteps",
        "512",
        "--num-envs",
        "2",
        "--num-steps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
    # Learning starts after step 64; 236 updates; logs at steps 100, 200 and 300.
    "sac_continuous_action": [
        "--env-id",
        "Pendulum-v1",
        "--total-timesteps",
        "300",
        "--learning-starts",
        "64",
        "--batch-size",
        "32",
        "--buffer-size",
        "1000",
    ],
    # Learning starts after step 32; 208 updates; logs at steps 100, 200 and 240.
    "td3_continuous_action": [
        "--env-id",
        "Pendulum-v1",
        "--total-timesteps",
        "240",
        "--learning-starts",
        "32",
        "--batch-size",
        "16",
        "--buffer-size",
        "1000",
    ],
    # Learning starts at step 100; 75 updates (one per 4 steps); target copies every 50 steps;
    # logs at steps 100, 200, 300 and 400.
    "dqn": [
        "--total-timesteps",
        "400",
        "--learning-starts",
        "100",
        "--batch-size",
        "32",
        "--buffer-size",
        "500",
        "--train-frequency",
        "4",
        "--target-network-frequency",
        "50",
    ],
    # Atari: 2 envs; learning starts after step 100; 75 updates (one per 4 steps); target copies
    # every 50 steps; a buffer of 100 rows per env, which wraps; logs at steps 100, 200, 300 and 400.
    "dqn_atari_envpool": [
        "--env-id",
        "Breakout-v5",
        "--num-envs",
        "2",
        "--total-timesteps",
        "400",
        "--learning-starts",
        "100",
        "--batch-size",
        "32",
        "--buffer-size",
        "200",
        "--target-network-frequency",
        "50",
    ],
    # Atari: 2 envs, 16 steps, 2 iterations (4 minibatch updates each).
    "ppo_atari_envpool": [
        "--env-id",
        "Breakout-v5",
        "--num-envs",
        "2",
        "--num-steps",
        "16",
        "--total-timesteps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
    # 2 envs, 64 steps: 4 iterations of 4 minibatch updates, a log point after each.
    "pqn": [
        "--total-timesteps",
        "512",
        "--num-envs",
        "2",
        "--num-steps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
    # Atari: 2 envs, 16 steps, 2 iterations (4 minibatch updates each).
    "pqn_atari_envpool": [
        "--env-id",
        "Breakout-v5",
        "--num-envs",
        "2",
        "--num-steps",
        "16",
        "--total-timesteps",
        "64",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "2",
    ],
}


def assert_refused_before_work(code, capsys, tmp_path, *words, started=False):
    """One `error:` line naming `words`, exit 2, no traceback, no training and no summary; unless
    `started`, no run folder either. Returns the line."""
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for word in words:
        assert word.lower() in errors[0].lower(), errors[0]
    assert "sps=" not in err and out.strip() == "", (out, err)  # no training, no summary
    if not started:
        assert not (tmp_path / "runs").exists()  # nothing was set up
    return errors[0]


# ---------------------------------------------------------------- PPO updates (CartPole and MuJoCo pairs)


def ppo_lean_update(lean, agent, args, compiled):
    """A lean PPO script's minibatch update of one agent, eager (fused Adam) or compiled into one
    graph (per-tensor Adam), and the lr tensor it reads."""
    lr = torch.tensor(args.learning_rate)
    optimizer = leanrl_utils.optimizers.Adam(agent.named_parameters(), lr, eps=1e-5, fused=not compiled)
    update = lean.make_update(agent, optimizer, args)
    options = {"guard_filter_fn": leanrl_utils.speed.value_guards}
    return (torch.compile(update, fullgraph=True, options=options) if compiled else update), lr


def ppo_plain_step(agent, optimizer, args, minibatch):
    """The plain PPO scripts' minibatch step, as written in their loops."""
    obs, actions, logprobs, advantages, returns, values = minibatch
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
    logratio = newlogprob - logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
    newvalue = newvalue.view(-1)
    v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
    v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()


def ppo_minibatches(generator, batch_size, minibatch_size, updates, rates, learning_rate):
    """Per update: the lr tensors annealed in place as the loops do, and a minibatch's indices."""
    for step in range(updates):
        for rate in rates:
            rate.copy_((1.0 - step / updates) * learning_rate)
        yield torch.randperm(batch_size, generator=generator)[:minibatch_size]


def changed_mlp(n_in, n_out, activation, device=None):
    """A researcher's edit of a PPO network: other widths, `activation` first, ReLU after, and an
    extra layer."""
    return nn.Sequential(
        nn.Linear(n_in, 32, device=device),
        activation(),
        nn.Linear(32, 48, device=device),
        nn.ReLU(),
        nn.Linear(48, 16, device=device),
        nn.ReLU(),
        nn.Linear(16, n_out, device=device),
    )


def assert_ppo_lean_update_is_plain(plain_agent, lean, lean_agent, args, batch, minibatch_size, generator):
    """From the plain agent's parameters, 4 lean steps (torch.func, clipping on the gradient dict,
    fused functional Adam with a tensor lr annealed in place) give the plain steps' metrics and
    parameters (`loss.backward()`, `clip_grad_norm_`, `optim.Adam(eps=1e-5)`) on the same
    minibatches. Tolerance: rtol 1e-5, atol 1e-6 (float32 round-off of two summation orders; a
    wrong term moves the values by far more). Returns the plain steps' summed clip fractions."""
    lean_agent.load_state_dict(plain_agent.state_dict())
    initial = copy.deepcopy(plain_agent)
    update, lr = ppo_lean_update(lean, lean_agent, args, compiled=False)
    optimizer = torch.optim.Adam(plain_agent.parameters(), lr=args.learning_rate, eps=1e-5)
    clipped = 0.0
    for idx in ppo_minibatches(generator, len(batch[0]), minibatch_size, 4, (lr,), args.learning_rate):
        optimizer.param_groups[0]["lr"] = float(lr)
        expected = ppo_plain_step(plain_agent, optimizer, args, [t[idx] for t in batch])
        torch.testing.assert_close(update(*batch, idx), expected, rtol=1e-5, atol=1e-6)
        clipped += float(expected[-1])
    for name, value in plain_agent.state_dict().items():
        torch.testing.assert_close(lean_agent.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(not torch.equal(a, b) for a, b in zip(plain_agent.parameters(), initial.parameters()))
    return clipped


def assert_ppo_compiled_update_matches_eager(lean, agent, batch, minibatch_size, generator):
    """Three compiled steps (one graph, per-tensor Adam) agree with three eager steps (fused
    Adam) from the same agent, with the lr tensor changed in place between them. Tolerance: rtol
    1e-4, atol 1e-5 (inductor reorders float32 reductions, ~1e-6; a wrong term moves them by far
    more)."""
    args = lean.Args()
    agents = [agent, copy.deepcopy(agent)]
    (eager, lr_eager), (compiled, lr_compiled) = (ppo_lean_update(lean, a, args, c) for a, c in zip(agents, (False, True)))
    for idx in ppo_minibatches(generator, len(batch[0]), minibatch_size, 3, (lr_eager, lr_compiled), args.learning_rate):
        torch.testing.assert_close(compiled(*batch, idx), eager(*batch, idx), rtol=1e-4, atol=1e-5)
    for (name, a), (_, b) in zip(agents[0].named_parameters(), agents[1].named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def assert_ppo_stack_of_one_is_the_one_agent(lean, single, args, batch, minibatch_size, generator):
    """One seed is a stack of one: make_update over stack_seeds([agent]) with num_seeds 1 (the
    rollout and indices with a leading seed dimension of 1) runs the one agent's own ops and the
    same fused Adam kernel as the unstacked agent's update: its metrics and parameters bit for bit."""
    stacked, initial = copy.deepcopy(single), copy.deepcopy(single)
    single_update, single_lr = ppo_lean_update(lean, single, args, compiled=False)
    lr = torch.tensor(args.learning_rate)
    params = leanrl_utils.seeds.stack([stacked])
    optimizer = leanrl_utils.optimizers.Adam(params.items(), lr, eps=1e-5, fused=True)
    stacked_update = lean.make_update(stacked, optimizer, args, num_seeds=1)
    for idx in ppo_minibatches(generator, len(batch[0]), minibatch_size, 3, (lr, single_lr), args.learning_rate):
        expected = single_update(*batch, idx)
        metrics = stacked_update(*(x[None] for x in batch), idx[None])
        assert metrics.shape == (1, len(lean.METRICS))
        torch.testing.assert_close(metrics[0], expected, rtol=0, atol=0)
    for name, value in single.state_dict().items():
        torch.testing.assert_close(stacked.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert all(not torch.equal(a, b) for a, b in zip(single.parameters(), initial.parameters()))

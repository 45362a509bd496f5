"""TD3 (continuous actions): compiled update against eager, the lerp_ target update against the
Polyak formula, the replay buffer across episode boundaries, --num-envs, learning, bad input."""

import copy
import sys

import numpy as np
import pytest
import torch

from conftest import TINY, assert_one_line_error, load_script, run_script, scripts

PAIR = scripts("td3_continuous_action*.py")
LEAN = scripts("td3_continuous_action_torchcompile.py")[0]
N_OBS, N_ACT = 11, 3
# One intra-op thread for the runs that train: on a 2-core machine shared with other jobs, two
# OpenMP threads wait on each other at every op and each update runs many times slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def load(path):
    """The script as a module, registered under its name: dynamo looks up the globals of the
    functions it inlines (F.relu in forward) through sys.modules."""
    module = load_script(path)
    sys.modules[module.__name__] = module
    return module


def fill(rb, n, generator):
    """`n` random transitions, written as main writes them (numpy in, float32 stored)."""
    rb.add(
        torch.randn(n, N_OBS, generator=generator).numpy(),
        torch.randn(n, N_OBS, generator=generator).numpy(),
        (torch.rand(n, N_ACT, generator=generator) * 2 - 1).numpy(),
        torch.randn(n, generator=generator).numpy(),
        (torch.rand(n, generator=generator) < 0.1).numpy(),
    )


def make_lean(lean, networks, compiled, batch_size=64):
    args = lean.Args(batch_size=batch_size, buffer_size=512)
    low, high = -torch.ones(N_ACT), torch.ones(N_ACT)
    actor, qf1, qf2 = copy.deepcopy(networks)
    # The optimizer each mode runs with in main: fused Adam eager, the single-tensor Adam compiled.
    learner = lean.make_learner(actor, qf1, qf2, low, high, args, {} if compiled else {"fused": True})
    rb = lean.ReplayBuffer(args.buffer_size, N_OBS, N_ACT, torch.device("cpu"))
    fill(rb, 300, torch.Generator().manual_seed(2))
    update_critic, update_both = lean.make_update(learner, lean.make_target(learner, rb, args))
    if compiled:
        # fullgraph: each update is one graph (a graph break raises), as main compiles it.
        update_critic, update_both = (torch.compile(f, fullgraph=True) for f in (update_critic, update_both))
    return learner, update_critic, update_both, lean.make_soft_update(learner.targets, learner.online, args.tau), rb


def test_compiled_update_matches_eager(inductor_fallback_random):
    """From the same parameters, the same buffer and the same random stream, four compiled
    update steps (batch sampling, target policy smoothing, twin-critic loss, delayed actor
    loss, Adam, lerp_ targets) agree with four eager ones: the losses and every parameter.

    Tolerance: rtol 1e-4, atol 1e-5. Inductor reorders float32 reductions (and the eager side
    runs fused Adam, the compiled side the single-tensor one), which moves results by ~1e-6; a
    wrong coefficient, a swapped critic or a dropped term moves them by 1e-3 or more.
    fallback_random makes compiled code draw from the eager random stream."""
    import torch._dynamo.utils
    import torch._inductor.config

    lean = load(LEAN)
    torch.manual_seed(0)
    low, high = -np.ones(N_ACT, np.float32), np.ones(N_ACT, np.float32)
    networks = (lean.Actor(N_OBS, N_ACT, low, high), lean.QNetwork(N_OBS, N_ACT), lean.QNetwork(N_OBS, N_ACT))
    runs = [make_lean(lean, networks, compiled) for compiled in (False, True)]
    stats = [[], []]
    for i, (learner, update_critic, update_both, soft_update, _) in enumerate(runs):
        torch.manual_seed(1)
        for step in range(4):
            if step % 2:
                stats[i].append(update_both())
                soft_update()
            else:
                stats[i].append(update_critic())
    for eager, compiled in zip(*stats):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    (eager, *_), (compiled, *_) = runs
    for tree in ("online", "targets"):
        for key, value in getattr(eager, tree).items(True, True):
            torch.testing.assert_close(getattr(compiled, tree)[key], value, rtol=1e-4, atol=1e-5, msg=f"{tree} {key}")
    # The steps moved the parameters (else the comparison above proves nothing).
    assert not torch.equal(eager.online["actor", "fc1", "weight"], networks[0].fc1.weight)
    assert not torch.equal(eager.q_stacked["fc2", "weight"][1], networks[2].fc2.weight)
    # Later calls reuse the graphs: the buffer's fill level and Adam's state are tensors.
    _, update_critic, update_both, _, rb = runs[1]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        fill(rb, 10, torch.Generator().manual_seed(3))
        update_critic(), update_both()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the compiled update recompiled"


def test_lerp_target_update_is_polyak_averaging():
    """One lerp_ on the target TensorDict equals target <- tau * online + (1 - tau) * target for
    every parameter of the actor and both critics, and the modules the update reads (the target
    actor, the target critics' parameter dict) see the new values: they share the storage."""
    lean = load(LEAN)
    torch.manual_seed(0)
    low, high = -np.ones(N_ACT, np.float32), np.ones(N_ACT, np.float32)
    actor, qf1, qf2 = lean.Actor(N_OBS, N_ACT, low, high), lean.QNetwork(N_OBS, N_ACT), lean.QNetwork(N_OBS, N_ACT)
    learner = lean.make_learner(actor, qf1, qf2, torch.tensor(low), torch.tensor(high), lean.Args(), {"fused": True})
    tau = 0.005
    with torch.no_grad():
        for value in learner.online.values(True, True):
            value.add_(torch.randn_like(value))
    before = learner.targets.clone()
    lean.make_soft_update(learner.targets, learner.online, tau)()
    for key, online in learner.online.items(True, True):
        expected = tau * online + (1 - tau) * before[key]
        torch.testing.assert_close(learner.targets[key], expected, rtol=1e-6, atol=1e-7, msg=str(key))
    assert not torch.equal(learner.targets["qnet", "fc1", "weight"], before["qnet", "fc1", "weight"])
    torch.testing.assert_close(learner.target_actor.fc2.weight, learner.targets["actor", "fc2", "weight"], rtol=0, atol=0)
    torch.testing.assert_close(learner.q_target_params["fc3.bias"], learner.targets["qnet", "fc3", "bias"], rtol=0, atol=0)


def pendulum_step(obs, action):
    """Pendulum-v1's dynamics (gymnasium 1.x): the observation a transition must reach."""
    g, m, length, dt = 10.0, 1.0, 1.0, 0.05
    th = np.arctan2(obs[:, 1], obs[:, 0])
    thdot = obs[:, 2]
    u = np.clip(action[:, 0], -2.0, 2.0)
    newthdot = np.clip(thdot + (3 * g / (2 * length) * np.sin(th) + 3.0 / (m * length**2) * u) * dt, -8, 8)
    newth = th + newthdot * dt
    return np.stack([np.cos(newth), np.sin(newth), newthdot], axis=1)


def stored(rb, rows):
    as_np = (lambda x: x[rows]) if isinstance(rb.observations, np.ndarray) else (lambda x: x[rows].numpy())
    return as_np(rb.observations), as_np(rb.actions), as_np(rb.next_observations), as_np(rb.dones)


def collect(module, env_id, num_envs, steps, buffer_size):
    """Random actions through the script's own vector env and buffer, stored as main stores
    them; returns the buffer and the (step, env, final obs, reset obs) of each finished episode."""
    args = module.Args(env_id=env_id, num_envs=num_envs)
    envs = module.make_envs(args, "test", num_envs)
    envs.action_space.seed(0)
    space = envs.single_observation_space
    rb = module.ReplayBuffer(buffer_size, space.shape[0], envs.single_action_space.shape[0], torch.device("cpu"))
    obs, _ = envs.reset(seed=0)
    ends = []
    for step in range(steps):
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        obs_in = obs if isinstance(rb.observations, np.ndarray) else torch.as_tensor(obs, dtype=torch.float)
        rb.add(obs_in, module.real_next_obs(next_obs, infos), actions, rewards, terminations)
        for i in np.flatnonzero(np.logical_or(terminations, truncations)):
            ends.append((step, i, infos["final_obs"][i], next_obs[i].copy(), bool(terminations[i])))
        obs = next_obs
    envs.close()
    return rb, ends


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_buffer_never_spans_an_episode_boundary(script):
    """Two Pendulum envs run past their 200-step time limit under SAME_STEP autoreset. Every
    stored transition obeys Pendulum's dynamics from its observation and action, which a
    transition from a final state to the next episode's reset state cannot; at each boundary
    the stored next observation is the final one (not the reset one) and the stored done is 0
    (a truncation bootstraps)."""
    module = load(script)
    num_envs, steps = 2, 230
    rb, ends = collect(module, "Pendulum-v1", num_envs, steps, buffer_size=1000)
    assert [(step, i) for step, i, *_ in ends] == [(199, 0), (199, 1)]
    obs, actions, next_obs, dones = stored(rb, slice(0, steps * num_envs))
    np.testing.assert_allclose(next_obs, pendulum_step(obs, actions), atol=1e-4)
    assert not dones.any()
    for step, i, final_obs, reset_obs, _ in ends:
        row = step * num_envs + i
        np.testing.assert_allclose(next_obs[row], final_obs, atol=1e-6)
        # The check above can fail: the reset observation breaks the dynamics.
        assert np.abs(pendulum_step(obs[row : row + 1], actions[row : row + 1])[0] - reset_obs).max() > 1e-2
        np.testing.assert_allclose(obs[row + num_envs], reset_obs, atol=1e-6)


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_buffer_keeps_terminations_apart_and_wraps(script):
    """InvertedPendulum terminates when the pole falls: those rows store done 1 and the final
    observation; every other row stores done 0. The ring buffer (7 rows, 2 envs: the writes
    straddle its end) holds the last 7 transitions in place, and samples only valid rows."""
    module = load(script)
    rb, ends = collect(module, "InvertedPendulum-v5", 2, 40, buffer_size=7)
    terminated = [(step, i, final) for step, i, final, _, term in ends if term]
    assert terminated, "no episode terminated: the test saw no termination"
    assert rb.observations.shape == (7, 4) and rb.dones.shape == (7,)
    # 80 transitions written in pairs: row r holds the last transition k with k % 7 == r.
    _, _, next_obs, dones = stored(rb, slice(0, 7))
    for k in range(80 - 7, 80):
        step, i = divmod(k, 2)
        ended = [final for s, j, final in terminated if (s, j) == (step, i)]
        assert dones[k % 7] == (1.0 if ended else 0.0), (step, i)
        if ended:
            np.testing.assert_allclose(next_obs[k % 7], ended[0], atol=1e-6)

    small = module.ReplayBuffer(50, N_OBS, N_ACT, torch.device("cpu"))
    fill(small, 5, torch.Generator().manual_seed(0))
    observations = small.sample(256)[0]
    valid = torch.as_tensor(small.observations[:5])
    assert all(any(torch.equal(o, v) for v in valid) for o in observations)


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_num_envs_steps_all_envs_and_updates_once_per_step(script, workdir):
    """--num-envs 2: each step stores two transitions and makes one update, so the same
    total steps take half the updates of one env."""
    tiny = TINY["td3_continuous_action"]
    one, _ = run_script(script, *tiny, cwd=workdir, env=ONE_THREAD)
    two, _ = run_script(script, *tiny, "--num-envs", "2", cwd=workdir, env=ONE_THREAD)
    total, starts = int(tiny[tiny.index("--total-timesteps") + 1]), int(tiny[tiny.index("--learning-starts") + 1])
    assert one["total_steps"] == two["total_steps"] == total
    assert one["updates"] == total - starts
    assert two["updates"] == (total - starts) // 2


# Learning: a budget of 8,000 env steps on Pendulum-v1 (random returns about -1,200; a solved
# swing-up about -150), with a larger learning rate (1e-3) and a smaller batch (128) than the
# HalfCheetah defaults, so that a run takes about a minute on a 2-core CPU (4-5 minutes at load
# average 7). Mean of the last 10 episodes seen on seeds 1, 2, 3: plain -152.6, -173.5, -222.4;
# lean -151.8, -175.7, -222.2. The threshold leaves a margin of about 180 below the worst.
LEARN_ARGS = [
    "--env-id", "Pendulum-v1", "--total-timesteps", "8000", "--learning-starts", "1000",
    "--batch-size", "128", "--learning-rate", "1e-3", "--buffer-size", "10000",
]
THRESHOLD = -400.0
# Every seed tried passed; the suite runs the first only, to stay within its time budget.
SEEDS = [1, 2, 3]


@pytest.mark.learning
@pytest.mark.parametrize("seed", SEEDS[:1])
@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_learns_pendulum(script, seed, workdir):
    summary, _ = run_script(script, *LEARN_ARGS, "--seed", seed, cwd=workdir, env=ONE_THREAD)
    assert summary["episodic_return"] is not None and summary["episodic_return"] > THRESHOLD, summary


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--env-id", "CartPole-v1", "--learning-starts", "64", "--batch-size", "32"], ["CartPole-v1", "Discrete", "continuous"]),
        (["--batch-size", "300", "--learning-starts", "200"], ["--batch-size 300", "--learning-starts 200"]),
        (["--policy-frequency", "0"], ["--policy-frequency 0"]),
    ],
    ids=["discrete-actions", "batch-over-learning-starts", "policy-frequency-0"],
)
def test_bad_input_is_one_line(script, flags, words, workdir):
    _, proc = run_script(script, *flags, cwd=workdir, check=False)
    assert_one_line_error(proc, *words)
    assert proc.returncode == 2

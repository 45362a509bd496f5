"""leanrl_envs against gymnasium's classic-control envs: transitions, episodes, reset draws, the compiled step."""

import io

import gymnasium as gym
import numpy as np
import pytest
import torch

import leanrl_envs

torch.set_num_threads(1)

ENV_IDS = list(leanrl_envs.ENVS)

# Physical states to start from, reaching past each env's termination limits.
STATE_BOXES = {"CartPole-v1": ([-2.6, -3.0, -0.25, -3.5], [2.6, 3.0, 0.25, 3.5]),
               "Acrobot-v1": ([-np.pi, -np.pi, -4 * np.pi, -9 * np.pi], [np.pi, np.pi, 4 * np.pi, 9 * np.pi]),
               "MountainCar-v0": ([-1.2, -0.07], [0.6, 0.07])}  # fmt: skip
# gymnasium's reset draws (each env's `reset`): uniform in [low, high), column by column.
RESET_BOXES = {"CartPole-v1": ([-0.05] * 4, [0.05] * 4), "Acrobot-v1": ([-0.1] * 4, [0.1] * 4),
               "MountainCar-v0": ([-0.6, 0.0], [-0.4, 0.0])}  # fmt: skip
# Observations within float32 rounding: both sides compute in float64 (sin/cos may differ in the last bit), round once.
OBS_TOL = dict(rtol=1e-5, atol=0.0)


def sample_states(env_id, n, generator):
    low, high = (torch.tensor(b, dtype=torch.float64) for b in STATE_BOXES[env_id])
    return low + (high - low) * torch.rand(n, len(low), generator=generator, dtype=torch.float64)


def gym_step(env, physics, action, elapsed=0):
    """One step of gymnasium's env (TimeLimit and all) from a physical state and step count; also the state reached."""
    env.reset()
    env.unwrapped.state = physics.numpy().copy()
    env._elapsed_steps = elapsed
    obs, reward, terminated, truncated, _ = env.step(action)
    return obs, reward, terminated, truncated, np.array(env.unwrapped.state, dtype=np.float64)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_sizes_match_gymnasium(env_id):
    env, reference = leanrl_envs.make(env_id, 1), gym.make(env_id)
    assert (env.obs_dim, env.num_actions) == (reference.observation_space.shape[0], reference.action_space.n)
    assert env.max_episode_steps == reference.spec.max_episode_steps


def test_unknown_id_names_the_supported_ones():
    with pytest.raises(ValueError, match="CartPole-v1, Acrobot-v1, MountainCar-v0"):
        leanrl_envs.make("Pendulum-v1", 1)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_transitions_match_gymnasium(env_id):
    n, g = 10_000, torch.Generator().manual_seed(0)
    env, physics = leanrl_envs.make(env_id, n), sample_states(env_id, n, g)
    action = torch.randint(env.num_actions, (n,), generator=g)
    limit = env.max_episode_steps  # half the steps start anywhere in an episode, half within 3 of its end
    anywhere, late = torch.randint(limit, (n,), generator=g), torch.randint(limit - 3, limit, (n,), generator=g)
    elapsed = torch.where(torch.rand(n, generator=g) < 0.5, anywhere, late)
    _, out = env.step(env.state_from(physics, elapsed), action)
    reference = gym.make(env_id)
    rows = [gym_step(reference, physics[i], action[i].item(), elapsed[i].item()) for i in range(n)]
    obs, reward, terminated, truncated, reached = (np.array(column) for column in zip(*rows))
    torch.testing.assert_close(out.final_obs, torch.from_numpy(obs), **OBS_TOL)
    # The physical states too (Acrobot's angle wraps show only here): within the last bits of a sin or cos.
    torch.testing.assert_close(env.dynamics(physics, action)[0], torch.from_numpy(reached), rtol=1e-12, atol=1e-12)
    for got, expected in [(out.reward, reward.astype(np.float32)), (out.terminated, terminated), (out.truncated, truncated)]:
        assert torch.equal(got, torch.from_numpy(expected))
    # The samples reach every branch many times: termination and not, truncation and not.
    assert all(300 < flag.sum() < n - 300 for flag in (out.terminated, out.truncated)), out
    done = out.terminated | out.truncated
    assert torch.equal(out.obs[~done], out.final_obs[~done]) and torch.equal(out.episode_length, elapsed + 1)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_flags_match_right_at_the_thresholds(env_id):
    """States a float64 ulp either side of termination (bisected with gymnasium's step) get gymnasium's flags."""
    env, reference = leanrl_envs.make(env_id, 1), gym.make(env_id)
    physics = sample_states(env_id, 1000, torch.Generator().manual_seed(3))
    action = torch.zeros(1000, dtype=torch.int64)
    ends, edges = env.dynamics(physics, action)[2], []
    for inside, outside in list(zip(physics[~ends], physics[ends]))[:15]:
        lo, hi = 0.0, 1.0
        while lo < (lo + hi) / 2 < hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if gym_step(reference, inside + mid * (outside - inside), 0)[2] else (mid, hi)
        edges += [inside + lo * (outside - inside), inside + hi * (outside - inside)]
    edges = torch.stack(edges)
    _, out = env.step(env.state_from(edges), action[: len(edges)])
    assert torch.equal(out.terminated, torch.tensor([False, True] * (len(edges) // 2)))


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reset_draws(env_id):
    n, env = 1024, leanrl_envs.make(env_id, 1024)
    state, obs = env.reset(seed=7)
    low, high = (torch.tensor(b, dtype=torch.float64) for b in RESET_BOXES[env_id])
    assert state.physics.dtype == torch.float64 and obs.dtype == torch.float32
    assert ((state.physics >= low) & ((state.physics < high) | (low == high))).all()
    width, spread = (high - low)[high > low], state.physics[:, high > low]
    assert (spread.amax(0) - spread.amin(0) > 0.99 * width).all()  # fills its range
    assert ((spread.mean(0) - (low + high)[high > low] / 2).abs() < 0.02 * width).all()  # uniform: 0.009 sd
    assert torch.equal(obs, env.observe(state.physics)) and not state.elapsed.any() and not state.episode_return.any()
    assert torch.unique(state.physics, dim=0).shape[0] == n  # every env its own draw
    assert torch.equal(env.reset(seed=7)[0].physics, state.physics)
    other = env.reset(seed=8)[0].physics[:, high > low]
    assert (other == spread).float().mean() < 1e-3  # another key, other draws


def lowbias32(x):  # Wellons' hash on a Python int: the reference for leanrl_envs' int64 tensors
    x = (x ^ x >> 16) * 0x7FEB352D & 0xFFFFFFFF
    x = (x ^ x >> 15) * 0x846CA68B & 0xFFFFFFFF
    return x ^ x >> 16


def test_draws_are_uniform_bits():
    """Each draw is lowbias32 of (key, counter, index), at keys and counters with the top bit set too;
    a histogram of them is flat (the hash's independence across counters is lowbias32's)."""
    for key, counter in [(5, 9), (2**32 - 1, 2**31 + 7)]:
        u = leanrl_envs.uniform(torch.tensor(key), torch.tensor(counter), 1000, 2).flatten().tolist()
        assert u == [(lowbias32(lowbias32(lowbias32(key) ^ counter) ^ i) >> 8) * 2.0**-24 for i in range(2000)]
    u = leanrl_envs.uniform(torch.tensor(5), torch.tensor(9), 1 << 16, 4)
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert (counts - u.numel() / 16).abs().max() < 5 * (u.numel() / 16) ** 0.5


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_episodes_match_record_episode_statistics(env_id):
    """Whole episodes under fixed actions end, return and restart as RecordEpisodeStatistics says."""
    n = 2
    env = leanrl_envs.make(env_id, n)
    steps = 2 * env.max_episode_steps + 50  # MountainCar and most Acrobot episodes run to the time limit
    g = torch.Generator().manual_seed(1)
    actions = torch.randint(env.num_actions, (steps, n), generator=g)
    references = [gym.wrappers.RecordEpisodeStatistics(gym.make(env_id)) for _ in range(n)]
    [reference.reset(seed=0) for reference in references]
    state, obs = env.reset(seed=3)
    low, high = (torch.tensor(b, dtype=torch.float64) for b in RESET_BOXES[env_id])
    episodes = 0
    for t in range(steps):
        before = state.physics
        state, out = env.step(state, actions[t])
        for i, reference in enumerate(references):
            reference.unwrapped.state = before[i].numpy().copy()
            obs_i, reward, terminated, truncated, info = reference.step(actions[t, i].item())
            torch.testing.assert_close(out.final_obs[i], torch.from_numpy(obs_i), **OBS_TOL)
            assert (out.reward[i].item(), out.terminated[i].item(), out.truncated[i].item()) == (reward, terminated, truncated)
            if not (terminated or truncated):
                continue
            episodes += 1
            assert (out.episode_return[i].item(), out.episode_length[i].item()) == (info["episode"]["r"], info["episode"]["l"])
            assert ((state.physics[i] >= low) & (state.physics[i] <= high)).all()
            assert torch.equal(out.obs[i], env.observe(state.physics[i : i + 1])[0])
            assert state.elapsed[i] == 0 and state.episode_return[i] == 0
            reference.reset()
    assert episodes >= 2 * n


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_compiled_step_matches_eager(env_id):
    """fullgraph (no graph break, no host sync), near the time limit so that autoresets happen in the compared steps."""
    n = 16
    env = leanrl_envs.make(env_id, n)
    state, _ = env.reset(seed=2)
    state = state._replace(elapsed=torch.arange(n) + env.max_episode_steps - n)
    compiled, g = torch.compile(env.step, fullgraph=True), torch.Generator().manual_seed(2)
    eager_state = compiled_state = state
    for _ in range(n + 2):
        action = torch.randint(env.num_actions, (n,), generator=g)
        eager_state, eager = env.step(eager_state, action)
        compiled_state, out = compiled(compiled_state, action)
        torch.testing.assert_close((out, compiled_state), (eager, eager_state), atol=1e-12, rtol=1e-12)
    assert (eager_state.elapsed < n + 2).all()  # every env was reset


def test_state_saves_and_loads():
    state, _ = leanrl_envs.make("Acrobot-v1", 3).reset(seed=4)
    torch.save(tuple(state), buffer := io.BytesIO())
    buffer.seek(0)
    assert all(map(torch.equal, leanrl_envs.State(*torch.load(buffer, weights_only=True)), state))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("env_id", ENV_IDS)
def test_cuda_matches_cpu(env_id):
    n = 1024
    cpu, cuda = leanrl_envs.make(env_id, n), leanrl_envs.make(env_id, n, "cuda")
    (cpu_state, cpu_obs), (cuda_state, cuda_obs) = cpu.reset(seed=5), cuda.reset(seed=5)
    assert torch.equal(cuda_state.physics.cpu(), cpu_state.physics)  # the same draws
    torch.testing.assert_close(cuda_obs.cpu(), cpu_obs, **OBS_TOL)
    physics = sample_states(env_id, n, torch.Generator().manual_seed(5))
    elapsed, action = torch.full((n,), cpu.max_episode_steps - 1), torch.randint(cpu.num_actions, (n,))
    cpu_state, cpu_out = cpu.step(cpu.state_from(physics, elapsed), action)
    cuda_state, cuda_out = cuda.step(cuda.state_from(physics, elapsed), action.cuda())
    torch.testing.assert_close(cuda_out.final_obs.cpu(), cpu_out.final_obs, **OBS_TOL)
    assert torch.equal(cuda_out.terminated.cpu(), cpu_out.terminated)
    assert torch.equal(cuda_state.physics.cpu(), cpu_state.physics)  # every env truncated: all fresh draws

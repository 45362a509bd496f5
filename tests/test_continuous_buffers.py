"""The SAC and TD3 pairs' replay buffers through SAME_STEP autoresets: real transitions, terminations, a ring."""

import numpy as np
import pytest
import torch
from conftest import is_lean, load_script, pair

SCRIPTS = [path for family in ("sac_continuous_action", "td3_continuous_action") for path in pair(family)]
KEYS = ("obs", "actions", "rewards", "next_obs", "dones")


def make_buffer(module, buffer_size, n_obs, n_act, stage_rows):
    if is_lean(module.__file__):
        shapes = {"obs": (n_obs,), "actions": (n_act,), "rewards": (), "next_obs": (n_obs,), "dones": ()}
        return module.ReplayBuffer(buffer_size, {k: (shape, torch.float32) for k, shape in shapes.items()}, stage_rows, "cpu")
    return module.ReplayBuffer(buffer_size, n_obs, n_act)


def stored(rb):
    """The buffer's fields as numpy arrays, whichever design it has."""
    if hasattr(rb, "storage"):
        rb.flush()
        return {k: rb.storage[k].numpy() for k in KEYS}
    return {k: getattr(rb, k).reshape(len(rb.obs), -1)[:, 0] if k in ("rewards", "dones") else getattr(rb, k) for k in KEYS}


def collect(module, env_id, num_envs, steps, buffer_size, stage_steps):
    """Random actions through the script's envs into its buffer; the buffer and each end's (step, env, final, reset, term)."""
    envs = module.make_envs(module.Args(env_id=env_id, num_envs=num_envs), "test", num_envs)
    envs.action_space.seed(0)
    n_obs, n_act = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    rb = make_buffer(module, buffer_size, n_obs, n_act, stage_rows=stage_steps * num_envs)
    obs, _ = envs.reset(seed=0)
    ends = []
    for step in range(steps):
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        real_next_obs = module.vector.real_next_obs(next_obs, infos)
        rb.add(obs=obs, actions=actions, rewards=rewards, next_obs=real_next_obs, dones=terminations)
        for i in np.flatnonzero(np.logical_or(terminations, truncations)):
            ends.append((step, i, infos["final_obs"][i], next_obs[i].copy(), bool(terminations[i])))
        obs = next_obs
    envs.close()
    return rb, ends


def pendulum_step(obs, action):
    """Pendulum-v1's dynamics (gymnasium 1.x, g=10, m=l=1, dt=0.05): the observation a transition must reach."""
    th, u = np.arctan2(obs[:, 1], obs[:, 0]), np.clip(action[:, 0], -2.0, 2.0)
    newthdot = np.clip(obs[:, 2] + (3 * 10.0 / 2 * np.sin(th) + 3.0 * u) * 0.05, -8.0, 8.0)
    newth = th + newthdot * 0.05
    return np.stack([np.cos(newth), np.sin(newth), newthdot], axis=1)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.stem)
def test_buffer_never_spans_an_autoreset(script):
    """Every transition obeys Pendulum's dynamics and ends at the final obs; truncations are not done."""
    num_envs, steps = 2, 450
    rb, ends = collect(load_script(script), "Pendulum-v1", num_envs, steps, steps * num_envs, stage_steps=7)
    assert [(step, i) for step, i, *_ in ends] == [(199, 0), (199, 1), (399, 0), (399, 1)]
    data = stored(rb)
    assert rb.size == steps * num_envs
    obs, actions, next_obs = data["obs"], data["actions"], data["next_obs"]
    assert np.abs(pendulum_step(obs, actions) - next_obs).max() < 1e-4 and not data["dones"].any()
    for step, i, final_obs, reset_obs, terminated in ends:
        row = step * num_envs + i
        assert not terminated
        np.testing.assert_allclose(next_obs[row], final_obs, rtol=0, atol=1e-6)
        assert np.abs(next_obs[row] - reset_obs).max() > 1e-3
        # The dynamics check above can fail: the reset observation breaks them.
        assert np.abs(pendulum_step(obs[row : row + 1], actions[row : row + 1])[0] - reset_obs).max() > 1e-2
        np.testing.assert_allclose(obs[row + num_envs], reset_obs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.stem)
def test_buffer_keeps_terminations_apart_and_wraps(script):
    """Terminations alone store done 1; a ring of 7 holds the last 7; only filled rows are sampled."""
    module = load_script(script)
    rb, ends = collect(module, "InvertedPendulum-v5", 2, 150, 300, stage_steps=7)
    data, terminal_rows = stored(rb), {step * 2 + i for step, i, _, _, terminated in ends if terminated}
    assert len(terminal_rows) >= 2 and set(np.flatnonzero(data["dones"])) == terminal_rows
    for step, i, final_obs, reset_obs, _ in ends:
        np.testing.assert_allclose(data["next_obs"][step * 2 + i], final_obs, rtol=0, atol=1e-6)
        assert np.abs(final_obs - reset_obs).max() > 1e-3
    rb, ends = collect(module, "InvertedPendulum-v5", 2, 40, buffer_size=7, stage_steps=3)
    terminated = [(step, i, final) for step, i, final, _, term in ends if term]
    assert terminated, "no episode terminated: the test saw no termination"
    data = stored(rb)
    assert data["obs"].shape == (7, 4) and data["dones"].shape == (7,)
    for k in range(80 - 7, 80):  # 80 transitions written in pairs: row r holds the last k with k % 7 == r
        ended = [final for s, j, final in terminated if (s, j) == divmod(k, 2)]
        assert data["dones"][k % 7] == (1.0 if ended else 0.0), divmod(k, 2)
        if ended:
            np.testing.assert_allclose(data["next_obs"][k % 7], ended[0], atol=1e-6)
    small, rng = make_buffer(module, 50, 11, 3, stage_rows=10), np.random.default_rng(0)
    rows = {k: rng.normal(size=(5, *shape)).astype(np.float32) for k, shape in zip(KEYS, [(11,), (3,), (), (11,), ()])}
    small.add(**rows)
    if hasattr(small, "storage"):
        sample = small.sample(256)
        assert 0 <= int(sample.min()) and int(sample.max()) < 5
    else:
        valid = torch.as_tensor(rows["obs"])
        assert all(any(torch.equal(o, v) for v in valid) for o in small.sample(256, "cpu")[0])

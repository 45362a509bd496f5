"""DQN on Atari (envpool): frame buffers, sampling, the update, a changed network. No learning test (hours)."""

import copy

import envpool
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_plain_dqn_step, dqn_learner, refused_call, trained_checkpoints

import leanrl_utils

FAMILY = "dqn_atari_envpool"
NUM_ENVS, STEPS, ROWS = 3, 400, 64


@pytest.fixture(scope="module")
def games():
    """STEPS steps of random Breakout (cut at 70) as the scripts make them: (obs, actions, rewards, term, trunc, next)."""
    options = dict(env_type="gymnasium", episodic_life=True, reward_clip=True, seed=3, max_episode_steps=70)
    envs, rng = envpool.make("Breakout-v5", num_envs=NUM_ENVS, **options), np.random.default_rng(0)
    obs, _ = envs.reset()
    steps = []
    for _ in range(STEPS):
        actions = rng.integers(4, size=NUM_ENVS)
        next_obs, rewards, terminations, truncations, _ = envs.step(actions)
        steps.append((obs, actions, rewards.astype(np.float32), terminations, truncations, next_obs))
        obs = next_obs
    envs.close()
    lives_lost, truncated = (np.array([step[k] for step in steps]) for k in (3, 4))
    # The case covers what it must: lost lives, truncations and, after game overs, full-stack resets.
    assert lives_lost.sum() >= 5 and truncated.sum() >= 2 and (lives_lost | truncated).sum() >= 10
    starts = [(o[:, :3] == o[:, 3:]).all(axis=(1, 2, 3)).sum() for o, *_ in steps]
    assert sum(starts) >= NUM_ENVS + 2
    return steps


def fill(buffer, steps):
    """Feed `steps` to a buffer as the loops do; returns which steps were reset steps."""
    reset_step, resets = np.zeros(NUM_ENVS, dtype=bool), []
    for obs, actions, rewards, terminations, truncations, _ in steps:
        buffer.add(obs, actions, rewards, terminations, reset_step)
        resets.append(reset_step)
        reset_step = terminations | truncations
    return np.array(resets)


def naive_transitions(steps, resets, first_step):
    """A buffer of whole stacks: (obs, action, reward, done, next obs) per (step, env) from `first_step`, no reset steps."""
    return {(t, i): (obs[i], actions[i], rewards[i], float(term[i]), next_obs[i])
            for t, (obs, actions, rewards, term, _, next_obs) in enumerate(steps) for i in range(NUM_ENVS)
            if t >= first_step and not resets[t, i]}  # fmt: skip


def buffers(plain, lean):
    """Both scripts' buffers of ROWS rows of NUM_ENVS transitions, and each one's stacks(rows, envs)."""
    plain_rb = plain.ReplayBuffer(ROWS * NUM_ENVS, NUM_ENVS)
    lean_rb = lean.FrameReplay(ROWS * NUM_ENVS, NUM_ENVS, 1, 3, torch.device("cpu"))

    def lean_stacks(rows, envs):
        lean_rb.flush()
        frames, first = lean_rb.storage["frames"], lean_rb.storage["first"]
        return lean.frame_stacks(frames, first, torch.as_tensor(rows), torch.as_tensor(envs)).numpy()

    return [(plain_rb, plain_rb.stacks), (lean_rb, lean_stacks)]


@pytest.mark.parametrize("steps_taken", [40, STEPS], ids=["filling", "wrapped"])
@pytest.mark.parametrize("which", ["plain", "lean"])
def test_frame_buffer_rebuilds_every_stack(plain, lean, games, which, steps_taken):
    """Each sampleable transition gives back envpool's stacks and fields across lives, games and wraps."""
    rb, stacks = buffers(plain, lean)[which == "lean"]
    steps = games[:steps_taken]
    resets = fill(rb, steps)
    if which == "lean":
        rb.flush()  # the staged rows go to the storage, as before each sample
    size = min(steps_taken, ROWS)
    assert rb.size == size
    low = 3 if steps_taken > ROWS else 0
    first_step = steps_taken - size + low
    expected, checked = naive_transitions(steps[: steps_taken - 1], resets, first_step), 0
    for t in range(first_step, steps_taken - 1):
        row, envs = t % ROWS, np.arange(NUM_ENVS)
        assert (rb.skip[row] == resets[t]).all()
        obs, next_obs = stacks(np.full(NUM_ENVS, row), envs), stacks(np.full(NUM_ENVS, (row + 1) % ROWS), envs)
        for i in envs:
            if (t, i) not in expected:
                continue
            want_obs, action, reward, done, want_next = expected[t, i]
            assert np.array_equal(obs[i], want_obs), (t, i)
            assert np.array_equal(next_obs[i], want_next), (t, i)
            held = vars(rb) if which == "plain" else {k: v.numpy() for k, v in rb.storage.items()}
            actions, rewards, dones = (held[k] for k in ("actions", "rewards", "dones"))
            assert (actions[row, i], rewards[row, i], dones[row, i]) == (action, reward, done)
            checked += 1
    assert checked >= 0.9 * len(expected) > 0


@pytest.mark.parametrize("which", ["plain", "lean"])
def test_sampling_draws_only_held_game_transitions(plain, lean, games, which):
    """Samples are held whole-stack transitions only, each drawn in about its share."""
    torch.manual_seed(0)
    np.random.seed(0)
    rb, stacks = buffers(plain, lean)[which == "lean"]
    resets = fill(rb, games)
    expected = naive_transitions(games[:-1], resets, STEPS - ROWS + 3)
    keys = {}  # a few transitions share stacks and action (a still screen), with another done
    for (t, _), (o, a, r, d, n) in expected.items():
        keys.setdefault((o.tobytes(), int(a), n.tobytes()), []).append((t, r, d))
    drawn = set()
    for _ in range(20):
        if which == "plain":
            obs, actions, next_obs, dones, rewards = (x.numpy() for x in rb.sample(100, "cpu"))
            actions, dones, rewards = actions[:, 0], dones[:, 0], rewards[:, 0]
        else:
            rows, cols = rb.sample(100).numpy()
            obs, next_obs = stacks(rows, cols), stacks((rows + 1) % ROWS, cols)
            actions, dones, rewards = (rb.storage[k][rows, cols].numpy() for k in ("actions", "dones", "rewards"))
        for o, a, n, d, r in zip(obs, actions, next_obs, dones, rewards):
            key = (o.tobytes(), int(a), n.tobytes())
            matches = [t for t, want_r, want_d in keys.get(key, []) if (want_r, want_d) == (r, d)]
            assert matches, "a sampled transition that is no held game transition"
            drawn.update(matches)
    assert len(drawn) >= 0.8 * len({t for t, _ in expected})


def update_case(lean, num_seeds, num_envs=2, rows=40):
    """A filled lean storage of random frames (some rows begin games) with seeds' networks."""
    g, cols = torch.Generator().manual_seed(0), num_seeds * num_envs
    storage = {
        "frames": torch.randint(0, 256, (rows, cols, 84, 84), generator=g, dtype=torch.uint8),
        "first": torch.rand(rows, cols, generator=g) < 0.2,
        "actions": torch.randint(0, 4, (rows, cols), generator=g),
        "rewards": torch.randint(0, 2, (rows, cols), generator=g).float(),
        "dones": (torch.rand(rows, cols, generator=g) < 0.1).float(),
    }
    torch.manual_seed(1)
    nets, targets = [lean.QNetwork(4) for _ in range(num_seeds)], [lean.QNetwork(4) for _ in range(num_seeds)]
    batches = []
    for _ in range(3):
        r = torch.randint(0, rows - 1, (num_seeds * 8,), generator=g)
        c = torch.randint(0, num_envs, (num_seeds * 8,), generator=g) + num_envs * torch.arange(num_seeds).repeat_interleave(8)
        batches.append(torch.stack([r, c]))
    return nets, targets, storage, batches


# One seed runs the module's own ops: bit for bit; stacked seeds run vmapped (grouped) convolutions.
EXACT = {1: dict(rtol=0, atol=0), 2: dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_lean_update_is_the_plain_update(plain, lean, num_seeds):
    """The lean update against dqn_atari_envpool.py's step per seed: bit for bit for one seed."""
    nets, targets, storage, batches = update_case(lean, num_seeds)
    seed_nets, *_, update = dqn_learner(lean, nets, targets, storage, learning_rate=1e-4)
    refs = [(copy.deepcopy(net), copy.deepcopy(target)) for net, target in zip(nets, targets)]
    optimizers = [torch.optim.Adam(q.parameters(), lr=1e-4) for q, _ in refs]
    rb = plain.ReplayBuffer(40 * num_seeds * 2, num_seeds * 2)  # the plain buffer's stacks over the same storage
    rb.frames, rb.first = storage["frames"].numpy(), storage["first"].numpy()
    for idx in batches:
        metrics = update(idx)
        for k, ((q_ref, target_ref), optimizer) in enumerate(zip(refs, optimizers)):
            rows, cols = idx.view(2, num_seeds, -1)[:, k].numpy()
            obs, next_obs = (torch.from_numpy(rb.stacks(r, cols)) for r in (rows, (rows + 1) % 40))
            actions, rewards, dones = (storage[key][rows, cols] for key in ("actions", "rewards", "dones"))
            batch, nets = (obs, actions, next_obs, rewards, dones), (q_ref, target_ref)
            assert_plain_dqn_step(metrics[:, k], nets, optimizer, batch, 0.99, seed_nets[k], EXACT[num_seeds])


def test_compiled_update_matches_eager(lean):
    """Compiled against eager on the same batches (1e-5: Adam turns reordered sums into 3e-6 where a gradient is ~0)."""
    nets, targets, storage, batches = update_case(lean, 1)
    eager_nets, *_, eager = dqn_learner(lean, nets, targets, storage, learning_rate=1e-4)
    compiled_nets, *_, compiled = dqn_learner(lean, nets, targets, storage, learning_rate=1e-4)
    compiled = torch.compile(compiled, options={"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp_wrapper": True})
    for idx in batches:
        torch.testing.assert_close(compiled(idx), eager(idx), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_nets[0].state_dict(), eager_nets[0].state_dict(), rtol=1e-5, atol=1e-5)


def changed_network(lean, activation=nn.Tanh):
    """QNetwork as a researcher might change it: other widths, another activation, an extra layer."""

    class ChangedQNetwork(lean.QNetwork):
        def __init__(self, n_act, device=None):
            nn.Module.__init__(self)
            self.network = nn.Sequential(
                nn.Conv2d(4, 16, 8, stride=4, device=device), activation(),
                nn.Conv2d(16, 32, 4, stride=2, device=device), activation(),
                nn.Flatten(),
                nn.Linear(32 * 9 * 9, 128, device=device), nn.ReLU(),
                nn.Linear(128, 64, device=device), activation(),
                nn.Linear(64, n_act, device=device),
            )  # fmt: skip

    return ChangedQNetwork


@pytest.mark.parametrize("num_seeds", [1, 3])
def test_a_changed_network_acts_as_its_module(lean, monkeypatch, num_seeds, capsys):
    """make_policy acts with each seed's changed module; numpy_forward refuses the convolution."""
    monkeypatch.setattr(lean, "QNetwork", changed_network(lean))
    torch.manual_seed(0)
    nets = [lean.QNetwork(4) for _ in range(num_seeds)]
    params = dict(leanrl_utils.seeds.stack(nets).items())
    policy = lean.make_policy(nets[0], params, num_seeds)
    obs = torch.randint(0, 256, (num_seeds * 5, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        q_values = torch.cat([net(block) for net, block in zip(nets, obs.view(num_seeds, 5, 4, 84, 84))])
        assert torch.equal(policy(obs), q_values.argmax(1))
        stacked = leanrl_utils.seeds.forward(nets[0])(params, obs.view(num_seeds, 5, 4, 84, 84)).flatten(0, 1)
        if num_seeds == 1:
            assert torch.equal(stacked, q_values)
        torch.testing.assert_close(stacked, q_values)
    refused_call(capsys, leanrl_utils.acting.numpy_forward, nets[0], params, words=["network.0 (Conv2d)"])


def test_a_changed_network_trains_and_saves(lean, monkeypatch, tmp_path, capsys):
    """A two-seed run with QNetwork changed: each seed's checkpoint has the changed shapes and finite weights."""
    monkeypatch.setattr(lean, "QNetwork", changed_network(lean))
    summary, saved = trained_checkpoints(lean, "--num-seeds", 2, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert summary["updates"] == 75 and summary["total_steps"] == 400 and len(saved) == 2
    for model in saved:
        assert model["q_network"]["network.0.weight"].shape == (16, 4, 8, 8)
        assert model["q_network"]["network.7.weight"].shape == (64, 128)

"""PQN on Atari (envpool): returns under autoreset, the update, a changed network. No learning test (hours)."""

import copy

import numpy as np
import torch
import torch.nn as nn
from conftest import atari_batch, refused_call, trained_checkpoints

import leanrl_utils

FAMILY = "pqn_atari_envpool"


def reference_returns(rewards, values, next_value, terminations, dones, gamma, q_lambda):
    """Q(lambda) under envpool's autoreset: a truncation bootstraps from its episode's last frame."""
    num_steps, num_envs = rewards.shape
    returns = np.zeros((num_steps, num_envs))
    for env in range(num_envs):
        for t in reversed(range(num_steps)):
            next_q = next_value[env] if t == num_steps - 1 else values[t + 1, env]
            bootstrap = 0.0 if terminations[t, env] else next_q
            if dones[t, env] or t == num_steps - 1:
                tail = bootstrap
            else:
                tail = (1 - q_lambda) * bootstrap + q_lambda * returns[t + 1, env]
            returns[t, env] = rewards[t, env] + gamma * tail
    return returns


def test_returns_match_the_reference_loop(lean):
    """A lost life, a truncation, a last-step termination and an unended env (1e-5)."""
    g = torch.Generator().manual_seed(0)
    num_steps, num_envs = 16, 4
    rewards = torch.randint(0, 2, (num_steps, num_envs), generator=g).float()
    values, next_value = torch.randn(num_steps, num_envs, generator=g) * 3, torch.randn(num_envs, generator=g)
    terminations, dones = torch.zeros(num_steps, num_envs), torch.zeros(num_steps, num_envs)
    terminations[4, 0] = dones[4, 0] = dones[9, 1] = terminations[-1, 2] = dones[-1, 2] = 1
    case, returns_fn = (rewards, values, next_value, terminations, dones), lean.make_returns(0.99, 0.65)
    expected, returns = reference_returns(*[x.double().numpy() for x in case], 0.99, 0.65), returns_fn(*case)
    torch.testing.assert_close(returns.double(), torch.from_numpy(expected), rtol=0, atol=1e-5)
    assert returns[4, 0] == rewards[4, 0]
    torch.testing.assert_close(returns[9, 1], rewards[9, 1] + 0.99 * values[10, 1])


# A rollout batch (`atari_batch`) with Q(lambda) returns.
make_batch = lambda n, seed=0: atari_batch(n, seed, lambda n, g: 3 * torch.rand(n, generator=g))


def test_lean_network_is_the_plain_network(plain, lean):
    """The channels-last lean QNetwork is the plain one's function of the same named parameters."""
    torch.manual_seed(0)
    q_network, reference = lean.QNetwork(6), plain.QNetwork(6)
    assert q_network.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(q_network.state_dict())
    frames = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    torch.testing.assert_close(q_network(frames), reference(frames), rtol=1e-5, atol=1e-5)


def test_lean_update_is_the_plain_update(plain, lean):
    """The lean step against pqn_atari_envpool.py's written out (masked error, clipping biting, RAdam, lr annealed)."""
    torch.manual_seed(0)
    q_network, reference = lean.QNetwork(4), plain.QNetwork(4)
    reference.load_state_dict(q_network.state_dict())
    lr = torch.tensor(2.5e-4)
    update = lean.make_update(q_network, leanrl_utils.optimizers.RAdam(q_network.named_parameters(), lr), max_grad_norm=0.5)
    optimizer = torch.optim.RAdam(reference.parameters(), lr=2.5e-4)
    b_obs, b_actions, b_returns, b_valid = batch = make_batch(64, seed=2)
    clipped = 0
    for k, mb_inds in enumerate(torch.randperm(64).split(16)):
        lr.fill_(2.5e-4 * (1 - k / 4))
        optimizer.param_groups[0]["lr"] = 2.5e-4 * (1 - k / 4)
        metrics, mb_valid = update(*batch, mb_inds), b_valid[mb_inds]
        n_valid = mb_valid.sum().clamp(min=1)
        old_val = reference(b_obs[mb_inds]).gather(1, b_actions[mb_inds].unsqueeze(1)).squeeze(1)
        loss = ((b_returns[mb_inds] - old_val) ** 2 * mb_valid).sum() / n_valid
        optimizer.zero_grad()
        loss.backward()
        clipped += torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5) > 0.5
        optimizer.step()
        expected = torch.stack([loss, (old_val * mb_valid).sum() / n_valid]).detach()
        torch.testing.assert_close(metrics, expected, rtol=1e-4, atol=1e-6)
    assert clipped > 0
    torch.testing.assert_close(dict(q_network.named_parameters()), dict(reference.named_parameters()), rtol=1e-4, atol=1e-6)


def test_reset_steps_are_left_out_of_the_update(lean):
    """A minibatch with reset steps (valid 0) steps as it does without them, whatever they hold."""
    torch.manual_seed(0)
    init, batch = lean.QNetwork(4), make_batch(32, seed=1)
    valid = batch[-1].bool()
    assert 0 < valid.sum() < 32

    def step(batch, idx):
        q_network = copy.deepcopy(init)
        update = lean.make_update(q_network, leanrl_utils.optimizers.RAdam(q_network.named_parameters(), 2.5e-4), 10.0)
        return update(*batch, idx), q_network

    masked, masked_net = step(batch, torch.arange(32))
    garbage = [t.clone() for t in batch]
    garbage[2][~valid] = 1e3
    for metrics, net in (
        step(batch[:-1] + (torch.ones(32),), torch.arange(32)[valid]),
        step(tuple(garbage), torch.arange(32)),
    ):
        torch.testing.assert_close(metrics, masked, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(dict(net.named_parameters()), dict(masked_net.named_parameters()), rtol=1e-4, atol=1e-6)


def test_compiled_update_matches_eager(lean):
    """As --compile builds it (fullgraph, RAdam capturable) against eager (rtol 1e-4: convolutions in another order)."""
    torch.manual_seed(0)
    q_eager = lean.QNetwork(4)
    q_compiled = copy.deepcopy(q_eager)
    radam = lambda net, **options: leanrl_utils.optimizers.RAdam(net.named_parameters(), torch.tensor(2.5e-4), **options)
    eager = lean.make_update(q_eager, radam(q_eager), 10.0)
    compiled = lean.make_update(q_compiled, radam(q_compiled, capturable=True), 10.0)
    compiled = torch.compile(compiled, fullgraph=True, options={"guard_filter_fn": leanrl_utils.speed.value_guards})
    batch = make_batch(32, seed=3)
    for idx in torch.randperm(32).split(8):
        torch.testing.assert_close(compiled(*batch, idx), eager(*batch, idx), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dict(q_compiled.named_parameters()), dict(q_eager.named_parameters()), rtol=1e-4, atol=1e-6)


def changed_network(lean, head_activation=nn.Tanh):
    """QNetwork changed (widths, Tanh, a deeper head), its LayerNorms random to test channels-last order."""

    class ChangedQNetwork(lean.QNetwork):
        def __init__(self, n_act, device=None):
            nn.Module.__init__(self)
            self.network = nn.Sequential(
                nn.Conv2d(4, 16, 8, stride=4, device=device), nn.LayerNorm([16, 20, 20], device=device), nn.Tanh(),
                nn.Conv2d(16, 32, 4, stride=2, device=device), nn.LayerNorm([32, 9, 9], device=device), nn.Tanh(),
                nn.Flatten(),
                nn.Linear(32 * 9 * 9, 128, device=device), nn.LayerNorm(128, device=device), head_activation(),
                nn.Linear(128, 64, device=device), nn.ReLU(),
                nn.Linear(64, n_act, device=device),
            )  # fmt: skip
            with torch.no_grad():
                for m in self.network:
                    if isinstance(m, nn.LayerNorm):
                        m.weight.normal_(1.0, 0.3)
                        m.bias.normal_(0.0, 0.3)

    return ChangedQNetwork


def test_a_changed_network_acts_as_its_module(lean, monkeypatch, capsys):
    """With QNetwork changed every derived form follows the module; numpy refuses what it cannot do."""
    monkeypatch.setattr(lean, "QNetwork", changed_network(lean))
    torch.manual_seed(0)
    q_network, other = lean.QNetwork(6), lean.QNetwork(6)
    frames = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        expected = q_network(frames)
        torch.testing.assert_close(expected, q_network.network(frames / 255.0), rtol=1e-5, atol=1e-5)
        explore, random_actions = torch.tensor([True, False, False, True, False]), torch.tensor([5, 4, 3, 2, 1])
        actions, values = lean.make_policy(q_network)(frames, explore, random_actions)
        assert torch.equal(actions, torch.where(explore, random_actions, expected.argmax(1)))
        assert torch.equal(values, expected.max(1).values)
        params = dict(leanrl_utils.seeds.stack([q_network]).items())
        assert torch.equal(leanrl_utils.seeds.forward(q_network)(params, frames[None])[0], expected)
        refused_call(capsys, leanrl_utils.acting.numpy_forward, q_network, params, words=["network.0 (Conv2d)"])
        head = q_network.network[7:]  # after Flatten; its layers keep their names ("7", ...)
        features = [net.network[:7](frames / 255.0) for net in (q_network, other)]
        for nets in ([q_network], [q_network, other]):
            stacked = dict(leanrl_utils.seeds.stack(nets).items())
            head_params = {name: p for name, p in stacked.items() if int(name.split(".")[1]) >= 7}
            x = torch.stack(features[: len(nets)])
            in_numpy = leanrl_utils.acting.numpy_forward(head, head_params, prefix="network.")(x.numpy().copy())
            in_torch = leanrl_utils.seeds.forward(head)({k.removeprefix("network."): p for k, p in head_params.items()}, x)
            exact = dict(rtol=0, atol=0) if len(nets) == 1 else dict(rtol=1e-5, atol=1e-6)  # one seed: the module's own ops
            for k, net in enumerate(nets):
                expected = net.network[7:](features[k])
                torch.testing.assert_close(torch.from_numpy(in_numpy[k]), expected, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(in_torch[k], expected, **exact)
    gelu = changed_network(lean, head_activation=nn.GELU)(6)
    params = {name: p for name, p in leanrl_utils.seeds.stack([gelu]).items() if int(name.split(".")[1]) >= 7}
    numpy_head = leanrl_utils.acting.numpy_forward
    refused_call(capsys, numpy_head, gelu.network[7:], params, prefix="network.", words=["network.9 (GELU)"])


def test_a_changed_network_trains_and_saves(lean, monkeypatch, tmp_path, capsys):
    """A run with QNetwork changed: the update and the checkpoint follow the module (its shapes, finite weights)."""
    monkeypatch.setattr(lean, "QNetwork", changed_network(lean))
    summary, (model,) = trained_checkpoints(lean, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert summary["updates"] == 8 and summary["total_steps"] == 64
    saved = model["q_network"]
    assert saved["network.0.weight"].shape == (16, 4, 8, 8) and saved["network.10.weight"].shape == (64, 128)

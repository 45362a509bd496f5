"""PQN pair on CartPole: Q(lambda) returns, the epsilon schedule, acting, time limits, the update, learning."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from conftest import (
    TINY,
    family,
    load_script,
    main_in_process,
    pair,
    refused_call,
    refused_in_process,
    run_script,
    scripts,
    short_env,
    spy,
)

import leanrl_utils

FAMILY = "pqn"
PLAIN_PATH, LEAN_PATH = BOTH = pair(FAMILY)


def reference_returns(rewards, values, next_value, dones, gamma, q_lambda):
    """Q(lambda) by its definition, one env and step at a time: the reward alone where an episode ended."""
    num_steps, num_envs = rewards.shape
    returns = np.zeros((num_steps, num_envs))
    for env in range(num_envs):
        for t in reversed(range(num_steps)):
            if dones[t, env]:
                tail = 0.0
            elif t == num_steps - 1:
                tail = next_value[env]
            else:
                tail = (1 - q_lambda) * values[t + 1, env] + q_lambda * returns[t + 1, env]
            returns[t, env] = rewards[t, env] + gamma * tail
    return returns


def rollout_case(num_steps=16, num_envs=3, seed=0):
    """A rollout: env 0 ends at steps 5 and 11, env 1 at the last step, env 2 never (it bootstraps from next_value)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(num_steps, num_envs, generator=g) + 0.5
    values, next_value = torch.randn(num_steps, num_envs, generator=g) * 3, torch.randn(num_envs, generator=g) * 3
    dones = torch.zeros(num_steps, num_envs)
    dones[5, 0] = dones[11, 0] = dones[-1, 1] = 1
    return rewards, values, next_value, dones


def test_returns_match_the_reference_loop(lean):
    """Tolerance: float32 against float64, over 16 steps of sums of terms below 10: 1e-5."""
    case, returns_fn = rollout_case(), lean.make_returns(0.99, 0.65)
    expected = reference_returns(*[x.double().numpy() for x in case], 0.99, 0.65)
    torch.testing.assert_close(returns_fn(*case).double(), torch.from_numpy(expected), rtol=0, atol=1e-5)


def test_returns_at_lambda_zero_and_one(lean):
    """Lambda 0 is one-step Q-learning, lambda 1 the discounted sum of rewards and the bootstrap at the rollout's end."""
    case = rewards, values, next_value, dones = rollout_case()
    env = 2  # never ends
    one_step = lean.make_returns(0.9, 0.0)(*case)
    expected = rewards[:, env] + 0.9 * torch.cat([values[1:, env], next_value[env : env + 1]])
    torch.testing.assert_close(one_step[:, env], expected)
    monte_carlo, discounts = lean.make_returns(0.9, 1.0)(*case), 0.9 ** torch.arange(16.0)
    torch.testing.assert_close(monte_carlo[0, env], (discounts * rewards[:, env]).sum() + 0.9**16 * next_value[env])
    # env 0: an episode's last step gets its reward only, and nothing of the next episode
    torch.testing.assert_close((monte_carlo[5, 0], monte_carlo[0, 0]), (rewards[5, 0], (discounts[:6] * rewards[:6, 0]).sum()))
    torch.testing.assert_close(monte_carlo[1, 1], (discounts[:15] * rewards[1:, 1]).sum())


@pytest.mark.parametrize("path", scripts("pqn*_torchcompile.py"), ids=lambda p: p.stem)
def test_lean_rollouts_draw_with_the_scheduled_epsilon_at_every_step(path, monkeypatch, tmp_path):
    """Each rollout step draws at the schedule's epsilon."""
    lean = load_script(path)
    draws = spy(monkeypatch, lean, "draw_exploration", lambda out, epsilons, *rest: list(epsilons))
    assert main_in_process(lean, "--exploration-fraction", "0.5", tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    args = tyro.cli(lean.Args, args=[*TINY[family(path)], "--exploration-fraction", "0.5"])
    steps, seen = args.total_timesteps // args.num_envs, sum(draws, [])
    expected = [lean.linear_schedule(1.0, args.end_e, args.total_timesteps / 2, args.num_envs * (k + 1)) for k in range(steps)]
    assert seen == pytest.approx(expected, abs=1e-12) and seen[-1] == pytest.approx(args.end_e)


def test_lean_draws_explore_below_epsilon(lean):
    """Rows at epsilon 0 never explore, at 1 always, at 0.5 about half the time; random actions cover the actions."""
    torch.manual_seed(0)
    explore, random_actions = lean.draw_exploration([0.0, 1.0, 0.0, 1.0, 0.5], 1000, 2, "cpu")
    assert explore.shape == random_actions.shape == (5, 1000) and not explore[[0, 2]].any() and explore[[1, 3]].all()
    assert 400 < explore[4].sum() < 600  # 1000 draws at 0.5: the standard deviation is 16
    assert set(random_actions.unique().tolist()) == {0, 1}


def network_like(lean, hidden, activation):
    """QNetwork as a researcher might edit it: other widths, another number of layers, another activation."""

    class Edited(lean.QNetwork):
        def __init__(self, n_obs, n_act, device=None):
            super().__init__(n_obs, n_act, device)
            layers = []
            for n_in, n_out in zip((n_obs, *hidden), hidden):
                layers += [nn.Linear(n_in, n_out, device=device), nn.LayerNorm(n_out, device=device), activation()]
            self.network = nn.Sequential(*layers, nn.Linear(hidden[-1], n_act, device=device))

    return Edited


# None: the script's own QNetwork.
EDITS = {"cleanrl": None, "wider-tanh": ((64,), nn.Tanh), "deeper-relu": ((32, 48, 16), nn.ReLU), "silu": ((120, 84), nn.SiLU)}


@pytest.mark.parametrize("num_seeds", [1, 3])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_network_is_what_the_policies_act_with(lean, edit, host, num_seeds, monkeypatch):
    """Both policies act with each seed's (edited) module, before and after steps."""
    if EDITS[edit]:
        monkeypatch.setattr(lean, "QNetwork", network_like(lean, *EDITS[edit]))
    torch.manual_seed(0)
    nets = [lean.QNetwork(4, 3) for _ in range(num_seeds)]
    with torch.no_grad():  # LayerNorm starts with scale 1 and shift 0: move them
        for norm in (m for net in nets for m in net.modules() if isinstance(m, nn.LayerNorm)):
            for p in norm.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    params = leanrl_utils.seeds.stack(nets)
    policy = lean.make_policy(nets[0], dict(params.items()), num_seeds, host)
    if not host:
        policy = leanrl_utils.acting.host_arrays(policy, torch.device("cpu"))
    obs = torch.randn(num_seeds * 200, 4)
    for _ in range(2):
        with torch.no_grad():
            q = torch.cat([net(x) for net, x in zip(nets, obs.chunk(num_seeds))])
        greedy, value = (torch.from_numpy(x) for x in policy(obs.numpy()))
        if not host and num_seeds == 1:
            assert torch.equal(value, q.max(dim=1).values)
        torch.testing.assert_close(value, q.max(dim=1).values)
        torch.testing.assert_close(greedy, q.argmax(dim=1), rtol=0, atol=0)
        assert len(greedy.unique()) > 1
        with torch.no_grad():  # an optimizer step, in place on the stacked storage
            for p in params.values():
                p.mul_(1.5)


@pytest.mark.parametrize("edit", ["wider-tanh", "deeper-relu"])
def test_the_lean_script_trains_an_edited_network(lean, edit, monkeypatch, tmp_path):
    """The whole script trains the edited network: its final weights have the edited shapes and moved."""
    monkeypatch.setattr(lean, "QNetwork", network_like(lean, *EDITS[edit]))
    stacks = spy(monkeypatch, lean.seeds, "stack", lambda out, nets: copy.deepcopy(nets[0].state_dict()))
    finals = spy(monkeypatch, leanrl_utils.Run, "finish", lambda out, self, step, updates, networks, *rest, **fields: (
        copy.deepcopy(networks["q_network"].state_dict())))  # fmt: skip
    assert main_in_process(lean, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    (initial, *_), (final,) = stacks, finals
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in lean.QNetwork(4, 2).state_dict().items()}
    assert all(not torch.equal(final[k], initial[k]) for k in final if k.endswith("weight"))


def test_a_layer_numpy_cannot_follow_is_refused_in_one_line(lean, monkeypatch, tmp_path, capsys):
    """GELU is refused in one line by make_policy and by the script (exit 2)."""
    monkeypatch.setattr(lean, "QNetwork", network_like(lean, (16,), nn.GELU))
    net, words = lean.QNetwork(4, 2), ["network.2", "GELU"]
    refused_call(capsys, lean.make_policy, net, dict(leanrl_utils.seeds.stack([net]).items()), 1, host=True, words=words)
    refused_in_process(lean, words=["GELU"], tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


SHORT_ID = short_env("CartPole-v1", 20)  # random play both terminates and truncates


def test_time_limits_end_the_return_as_terminations_do(lean, monkeypatch, tmp_path):
    """Truncations end the returns as terminations do: an episode's last step is its reward."""
    seen, make_returns = [], lean.make_returns
    steps = spy(monkeypatch, lean.vector.SameStepEnvs, "step", lambda out, self, actions: (out[2].copy(), out[3].copy()))

    def recording_make_returns(gamma, q_lambda):
        returns_fn = make_returns(gamma, q_lambda)

        def recording(*args):
            returns = returns_fn(*args)
            seen.append([a.clone() for a in (*args, returns)])
            return returns

        return recording

    monkeypatch.setattr(lean, "make_returns", recording_make_returns)
    assert main_in_process(lean, "--env-id", SHORT_ID, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    rewards, _, _, dones, returns = (torch.cat(x) for x in zip(*seen))
    terminations, truncations = (torch.as_tensor(np.stack(x)[: len(dones)]) for x in zip(*steps))
    assert terminations.any() and truncations.any() and torch.equal(dones.bool(), terminations | truncations)
    torch.testing.assert_close(returns[dones.bool()], rewards[dones.bool()], rtol=0, atol=0)


def update_case(lean, seed=0, n=256):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch = (torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g), 10 * torch.rand(n, generator=g))
    minibatches = [idx for _ in range(2) for idx in torch.randperm(n, generator=g).split(n // 4)]
    return lean.QNetwork(4, 2), batch, minibatches


def one_seed_update(lean, q_network, lr, max_grad_norm, capturable=False):
    """The script's update for one seed (a stack of one), called with one run's batch and rows."""
    optimizer = leanrl_utils.optimizers.RAdam(leanrl_utils.seeds.stack([q_network]).items(), lr, capturable=capturable)
    update = lean.make_update(q_network, optimizer, max_grad_norm, 1)
    return lambda obs, actions, returns, idx: update(obs[None], actions[None], returns[None], idx[None])[:, 0]


def test_lean_update_is_the_plain_update(plain, lean):
    """The lean step (torch.func, clipping, functional RAdam, lr annealed in place) against pqn.py's (rtol 1e-5)."""
    q_network, (b_obs, b_actions, b_returns), minibatches = update_case(lean)
    reference = plain.QNetwork(4, 2)
    reference.load_state_dict(q_network.state_dict())
    lr = torch.tensor(2.5e-4)
    update = one_seed_update(lean, q_network, lr, max_grad_norm=1.0)
    optimizer, clipped = torch.optim.RAdam(reference.parameters(), lr=2.5e-4), 0
    for k, mb_inds in enumerate(minibatches):
        lr.fill_(2.5e-4 * (1 - k / 8))
        optimizer.param_groups[0]["lr"] = 2.5e-4 * (1 - k / 8)
        metrics = update(b_obs, b_actions, b_returns, mb_inds)
        old_val = reference(b_obs[mb_inds]).gather(1, b_actions[mb_inds].unsqueeze(1)).squeeze(1)  # pqn.py's minibatch step
        loss = F.mse_loss(b_returns[mb_inds], old_val)
        optimizer.zero_grad()
        loss.backward()
        clipped += torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0) > 1.0
        optimizer.step()
        torch.testing.assert_close(metrics, torch.stack([loss, old_val.mean()]).detach(), rtol=1e-5, atol=1e-6)
    assert clipped > 0
    torch.testing.assert_close(q_network.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)


def test_compiled_update_matches_eager(lean):
    """Compiled as the script does (fullgraph, capturable RAdam) against eager, the lr annealed in place (rtol 1e-5)."""
    q_eager, batch, minibatches = update_case(lean)
    q_compiled, initial = copy.deepcopy(q_eager), copy.deepcopy(q_eager.state_dict())
    lr_eager, lr_compiled = torch.tensor(2.5e-4), torch.tensor(2.5e-4)
    eager = one_seed_update(lean, q_eager, lr_eager, 10.0)
    radam = leanrl_utils.optimizers.RAdam(leanrl_utils.seeds.stack([q_compiled]).items(), lr_compiled, capturable=True)
    options = {"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp_wrapper": True}
    compiled = torch.compile(lean.make_update(q_compiled, radam, 10.0, 1), fullgraph=True, options=options)
    for k, idx in enumerate(minibatches):
        lr_eager.fill_(2.5e-4 * (1 - k / 8))
        lr_compiled.fill_(2.5e-4 * (1 - k / 8))
        got = compiled(*(x[None] for x in batch), idx[None])[:, 0]
        torch.testing.assert_close(got, eager(*batch, idx), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q_compiled.state_dict(), q_eager.state_dict(), rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(v, initial[k]) for k, v in q_eager.state_dict().items() if k.endswith("weight"))


# CleanRL's defaults (500k steps): 475 of 500 on seed 3 (pqn) and 1 (torch-native), as seen on seeds 1-3.
LEARNING = {"plain": (PLAIN_PATH, 3), "lean-compile": (LEAN_PATH, 3), "torchenv-lean-compile": (pair("pqn_torchenv")[1], 1)}
LEARNING_THRESHOLD = 475.0


@pytest.mark.learning
@pytest.mark.parametrize("case", LEARNING)
def test_cartpole_learns(case, workdir):
    path, seed = LEARNING[case]
    mode = ["--compile"] if "lean" in case else []
    summary, _ = run_script(path, *mode, "--seed", seed, cwd=workdir, timeout=300)
    assert summary["total_steps"] == 499_712 and summary["episodic_return"] >= LEARNING_THRESHOLD, summary

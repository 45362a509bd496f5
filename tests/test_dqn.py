"""DQN pair: the epsilon schedule, the replay buffer, the network's derived forms, the update, learning."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_plain_dqn_step, dqn_learner, main_in_process, pair, refused_call, run_script, short_env, spy
from torch.func import functional_call

import leanrl_utils

FAMILY = "dqn"
PLAIN_PATH, LEAN_PATH = BOTH = pair(FAMILY)


def run_in_process(module, monkeypatch, tmp_path, **kwargs):
    monkeypatch.chdir(tmp_path)
    module.main(module.Args(**kwargs))


def test_lean_draws_use_the_scheduled_epsilon_from_step_zero(lean, monkeypatch, tmp_path):
    """Each step's draws use the schedule's value at that step: 1.0 at the start (the original LeanRL held end_e)."""
    draws = spy(monkeypatch, lean, "draw_exploration", lambda out, epsilons, *rest: list(epsilons))
    # Learning starts near the end (a budget that ends before it is refused): the schedule is under test.
    run_in_process(lean, monkeypatch, tmp_path, total_timesteps=600, learning_starts=580, exploration_fraction=0.5, num_envs=2)
    seen, expected = sum(draws, []), [lean.linear_schedule(1.0, 0.05, 300, t) for t in range(0, 600, 2)]
    assert seen[0] == 1.0 and seen[: len(expected)] == pytest.approx(expected, abs=1e-12)


def test_plain_loop_asks_the_schedule_at_every_step(plain, monkeypatch, tmp_path):
    calls = spy(monkeypatch, plain, "linear_schedule", lambda out, *args: args)
    run_in_process(plain, monkeypatch, tmp_path, total_timesteps=300, learning_starts=280, num_envs=2)
    assert calls == [(1.0, 0.05, 150.0, t) for t in range(0, 300, 2)]


SHORT_LIMIT = 20  # random play both terminates and truncates CartPole
SHORT_ID = short_env("CartPole-v1", SHORT_LIMIT)
# CartPole terminates past these bounds (gymnasium's CartPoleEnv); a reset state lies in +-0.05.
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360


def test_stored_transitions_follow_the_episodes(either, monkeypatch, tmp_path):
    """Each stored transition is one real step: the final obs where an episode ended, done on terminations."""
    # The plain buffer takes the fields by position, the lean one by name, in one column per seed.
    stored = lambda args, rows: (args[0], args[1], args[4]) if args else [rows[k][:, 0] for k in ("obs", "next_obs", "dones")]
    copies = lambda out, self, *args, **rows: [np.array(x, copy=True) for x in stored(args, rows)]
    module, records, num_envs = either, spy(monkeypatch, either.ReplayBuffer, "add", copies), 2
    # Random play (about 22 steps) falls and reaches the limit; the few updates at the end change no random action.
    run_in_process(module, monkeypatch, tmp_path, env_id=SHORT_ID, total_timesteps=600, num_envs=num_envs, learning_starts=580,
                   start_e=1.0, end_e=1.0)  # fmt: skip
    obs, next_obs, dones = (np.stack(x).astype(np.float64) for x in zip(*records))
    assert obs.shape == (300, num_envs, 4) and dones.shape == (300, num_envs)
    terminations = truncations = 0
    for env in range(num_envs):
        length = 0
        for t in range(len(obs) - 1):
            length += 1
            out_of_bounds = abs(next_obs[t, env, 0]) > X_LIMIT or abs(next_obs[t, env, 2]) > THETA_LIMIT
            assert bool(dones[t, env]) == out_of_bounds, (env, t, next_obs[t, env], dones[t, env])
            if np.array_equal(obs[t + 1, env], next_obs[t, env]):
                assert not dones[t, env]
                continue
            # An episode ended at t: the next transition starts from a reset state, the stored next obs is the true last one.
            assert np.all(np.abs(obs[t + 1, env]) <= 0.05), obs[t + 1, env]
            assert dones[t, env] or length == SHORT_LIMIT, (env, t, length)
            terminations, truncations = terminations + bool(dones[t, env]), truncations + (not dones[t, env])
            length = 0
    assert terminations > 0 and truncations > 0, (terminations, truncations)


def fields(n_obs, num_seeds=1):
    """The lean buffer's fields, as main declares them: a row holds one transition of each seed."""
    vector, scalar = ((num_seeds, n_obs), torch.float32), ((num_seeds,), torch.float32)
    return {"obs": vector, "next_obs": vector, "actions": ((num_seeds,), torch.int64), "rewards": scalar, "dones": scalar}


@pytest.mark.parametrize("num_envs", [1, 3])
def test_lean_buffer_holds_what_the_plain_buffer_holds(plain, lean, num_envs):
    """Wrapped and staged in blocks, the lean storage holds the plain buffer's transitions in place."""
    buffer_size, n_obs, steps = 50, 3, 90
    rng, plain_rb = np.random.default_rng(0), plain.ReplayBuffer(buffer_size, n_obs)
    lean_rb = lean.ReplayBuffer(buffer_size, fields(n_obs), stage_rows=4 * num_envs, device="cpu")
    for step in range(steps):
        obs = rng.normal(size=(num_envs, n_obs)).astype(np.float32)
        next_obs, actions = rng.normal(size=(num_envs, n_obs)).astype(np.float32), rng.integers(0, 5, size=num_envs)
        rewards, dones = rng.normal(size=num_envs), rng.random(num_envs) < 0.2
        plain_rb.add(obs, next_obs, actions, rewards, dones)
        # As main's rows() hands them over: env i of every seed (here one) in row i.
        rows = {"obs": obs, "next_obs": next_obs, "actions": actions, "rewards": rewards, "dones": dones}
        lean_rb.add(**{key: value[:, None] for key, value in rows.items()})
        if step == 5:
            assert lean_rb.size + lean_rb.pending == plain_rb.size == 6 * num_envs
    lean_rb.flush()
    assert lean_rb.size == plain_rb.size == buffer_size
    assert lean_rb.pos == plain_rb.pos == steps * num_envs % buffer_size
    for key, value in lean_rb.storage.items():
        np.testing.assert_array_equal(value[:, 0].numpy().reshape(getattr(plain_rb, key).shape), getattr(plain_rb, key), key)


def test_plain_buffer_samples_only_filled_rows(plain):
    rb = plain.ReplayBuffer(100, 2)
    rb.add(np.ones((3, 2), np.float32), np.ones((3, 2), np.float32), np.zeros(3), np.ones(3), np.zeros(3))
    obs, actions, next_obs, dones, rewards = rb.sample(256, "cpu")
    assert obs.shape == (256, 2) and actions.shape == (256, 1) and torch.all(obs == 1) and torch.all(rewards == 1)


SEEDS = pytest.mark.parametrize("num_seeds", [1, 2], ids=["1seed", "2seeds"])
HOST = pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])


def loop_policy(lean, q_network, params, num_seeds, host):
    """make_policy as the loop calls it: host arrays in and out (the torch form behind `host_arrays`, as on a device)."""
    policy = lean.make_policy(q_network, dict(params.items()), num_seeds, host)
    return policy if host else leanrl_utils.acting.host_arrays(policy, torch.device("cpu"))


def module_actions(nets, obs):
    """The greedy actions of each seed's module on its block of `obs` (seed k's envs in block k)."""
    with torch.no_grad():
        return torch.cat([net(block).argmax(dim=1) for net, block in zip(nets, obs.view(len(nets), -1, obs.shape[-1]))])


@SEEDS
@HOST
@pytest.mark.parametrize("changed", [False, True], ids=["cleanrl", "changed"])
def test_lean_policy_is_greedy_and_draws_explore_below_epsilon(lean, host, num_seeds, changed):
    """Both policies act with each seed's (changed) argmax; draws explore at epsilon."""
    torch.manual_seed(0)
    n_act = 3
    nets = [(ChangedQNetwork if changed else lean.QNetwork)(4, n_act) for _ in range(num_seeds)]
    params = leanrl_utils.seeds.stack(nets)
    policy, obs = loop_policy(lean, nets[0], params, num_seeds, host), torch.randn(num_seeds * 4096, 4)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(torch.from_numpy(policy(obs.numpy())), module_actions(nets, obs), rtol=0, atol=0)
            for p in params.values():
                p.add_(torch.randn_like(p))  # as Adam steps: in place
    explore, random_actions = lean.draw_exploration([0.0, 1.0, 0.5], 4096, n_act, "cpu")
    assert explore.shape == random_actions.shape == (3, 4096) and not explore[0].any() and explore[1].all()
    assert 1900 < explore[2].sum() < 2200  # 4096 draws at 0.5: the standard deviation is 32
    counts = torch.bincount(random_actions[1], minlength=n_act).float() / 4096
    # 4096 draws: the standard error of each frequency is 0.007; 0.04 is over 5 of them.
    torch.testing.assert_close(counts, torch.full((n_act,), 1 / n_act), rtol=0, atol=0.04)


class ChangedQNetwork(nn.Module):
    """A researcher's edit of QNetwork: other widths, Tanh, LayerNorm, SiLU and an extra layer."""

    def __init__(self, n_obs, n_act, device=None, activation=nn.Tanh):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(n_obs, 64, device=device),
            activation(),
            nn.Linear(64, 32, device=device),
            nn.LayerNorm(32, device=device),
            nn.ReLU(),
            nn.Linear(32, 16, device=device),
            nn.SiLU(),
            nn.Linear(16, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x)


def test_changed_network_acts_as_the_module_in_a_whole_run(lean, monkeypatch, tmp_path):
    """A 2-seed run with a changed QNetwork: every (numpy) policy call picks each seed's argmax at its current weights."""
    make_policy, calls = lean.make_policy, []

    def checked_make_policy(q_network, params, num_seeds, host):
        policy = make_policy(q_network, params, num_seeds, host)

        def checked(obs):
            actions, blocks = policy(obs), torch.from_numpy(obs).view(num_seeds, -1, obs.shape[-1])
            with torch.no_grad():
                seed_params = [{n: p[k] for n, p in params.items()} for k in range(num_seeds)]
                seed_q = [functional_call(q_network, seed_params[k], blocks[k]) for k in range(num_seeds)]
            np.testing.assert_array_equal(actions, torch.cat(seed_q).argmax(dim=1).numpy())
            calls.append(float(params["network.0.weight"].sum()))  # changes with every Adam step
            return actions

        return checked

    monkeypatch.setattr(lean, "QNetwork", ChangedQNetwork)
    monkeypatch.setattr(lean, "make_policy", checked_make_policy)
    # Mostly greedy from step 40, and a learning rate at which the greedy actions change.
    argv = ["--num-seeds", 2, "--exploration-fraction", 0.1, "--learning-rate", 0.01]
    assert main_in_process(lean, *argv, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    assert len(calls) > 100 and len(set(calls)) > 10, (len(calls), len(set(calls)))  # acted greedily while learning


def test_layer_without_a_numpy_form_is_one_line(lean, capsys):
    """GELU: the numpy policy is one `error:` line naming it; the torch one follows the module."""
    torch.manual_seed(0)
    nets = [ChangedQNetwork(6, 3, activation=nn.GELU) for _ in range(2)]
    params = leanrl_utils.seeds.stack(nets)
    refused_call(capsys, lean.make_policy, nets[0], dict(params.items()), 2, host=True, words=["network.1", "GELU"])
    obs = torch.randn(2 * 64, 6)
    actions = loop_policy(lean, nets[0], params, 2, host=False)(obs.numpy())
    torch.testing.assert_close(torch.from_numpy(actions), module_actions(nets, obs), rtol=0, atol=0)


def update_case(lean, num_seeds, batch_size=32, buffer_size=500):
    """Q-networks, targets, a filled storage [buffer_size, seeds, ...] and 5 batches of num_seeds blocks, at TINY sizes."""
    torch.manual_seed(0)
    args = lean.Args(batch_size=batch_size, buffer_size=buffer_size)
    nets, targets = [lean.QNetwork(4, 2) for _ in range(num_seeds)], [lean.QNetwork(4, 2) for _ in range(num_seeds)]
    storage = lean.ReplayBuffer(buffer_size, fields(4, num_seeds), 10, "cpu").storage
    storage["obs"].normal_(), storage["next_obs"].normal_(), storage["actions"].random_(0, 2)
    storage["rewards"].fill_(1.0), storage["dones"].bernoulli_(0.1)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(buffer_size, (num_seeds * batch_size,), generator=generator) for _ in range(5)]
    return args, nets, targets, storage, batches


# One seed runs the module's own ops, bit for bit; stacked seeds' batched matmuls sum in another order (seen 3e-7).
EXACT = {1: dict(rtol=0, atol=0), 2: dict(rtol=1e-5, atol=1e-6)}


@SEEDS
def test_lean_update_is_the_plain_update(lean, num_seeds):
    """The lean update against dqn.py's step per seed: the same numbers, bit for bit for one seed."""
    args, nets, targets, storage, batches = update_case(lean, num_seeds)
    seed_nets, _, _, update = dqn_learner(lean, nets, targets, storage, args.gamma, args.learning_rate)
    refs = [(copy.deepcopy(net), copy.deepcopy(target)) for net, target in zip(nets, targets)]
    optimizers = [torch.optim.Adam(q_ref.parameters(), lr=args.learning_rate) for q_ref, _ in refs]
    for idx in batches:
        metrics = update(idx)
        assert metrics.shape == (len(lean.METRICS), num_seeds)
        for k, ((q_ref, target_ref), optimizer) in enumerate(zip(refs, optimizers)):
            rows = idx.view(num_seeds, -1)[k]
            batch = [storage[key][rows, k] for key in ("obs", "actions", "next_obs", "rewards", "dones")]
            nets, tolerance = (q_ref, target_ref), EXACT[num_seeds]
            assert_plain_dqn_step(metrics[:, k], nets, optimizer, batch, args.gamma, seed_nets[k], tolerance)


@SEEDS
def test_compiled_update_matches_eager(lean, num_seeds):
    """Compiled (as on a CPU) against eager on the same 5 batches (float32 reductions reordered: seen 1e-6)."""
    args, nets, targets, storage, batches = update_case(lean, num_seeds)
    eager_nets, eager_params, eager_targets, eager = dqn_learner(lean, nets, targets, storage, args.gamma, args.learning_rate)
    compiled_nets, compiled_params, compiled_targets, compiled = dqn_learner(lean, nets, targets, storage, args.gamma)
    compiled = torch.compile(compiled, options={"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp_wrapper": True})
    for k, idx in enumerate(batches):
        if k == 3:  # a target copy in place, as the loop does: the graph must read the current target weights
            eager_targets.lerp_(eager_params, 1.0), compiled_targets.lerp_(compiled_params, 1.0)
        torch.testing.assert_close(compiled(idx), eager(idx), rtol=1e-5, atol=1e-5)
        state = lambda nets: [net.state_dict() for net in nets]
        torch.testing.assert_close(state(compiled_nets), state(eager_nets), rtol=1e-5, atol=1e-6)


def test_update_compiled_again_with_another_gamma_compiles_anew(lean):
    """Made again with another gamma (a graph constant), the update gets its own graph under `value_guards`."""
    args, nets, targets, storage, batches = update_case(lean, 1)
    for gamma in (0.99, 0.5):
        *_, eager = dqn_learner(lean, nets, targets, storage, gamma, args.learning_rate)
        *_, compiled = dqn_learner(lean, nets, targets, storage, gamma, args.learning_rate)
        compiled = torch.compile(compiled, options={"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp_wrapper": True})
        torch.testing.assert_close(compiled(batches[0]), eager(batches[0]), rtol=1e-5, atol=1e-5, msg=f"gamma {gamma}")


# CleanRL's defaults, 30k steps (seen on seeds 1, 2, 3: plain 166.7, 181.2, 240.0; lean 296.9, 133.4, 131.0).
LEARNING = ["--total-timesteps", "30000", "--learning-starts", "1000"]
LEARNING_SEEDS, LEARNING_THRESHOLD = [1, 2, 3], 100.0


@pytest.mark.learning
@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=["plain", "lean-compile"])
def test_cartpole_learns(mode, workdir):
    path = LEAN_PATH if mode else PLAIN_PATH
    for seed in LEARNING_SEEDS[:1]:
        summary, _ = run_script(path, *LEARNING, *mode, "--seed", seed, cwd=workdir, env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert summary["total_steps"] == 30_000
        assert summary["episodic_return"] >= LEARNING_THRESHOLD, (seed, summary)

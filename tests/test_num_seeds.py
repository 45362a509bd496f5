"""`--num-seeds N`: stacked updates against single ones, independent seeds, per-seed runs, bad input, learning."""

import copy
import csv
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TINY,
    assert_one_line_error,
    dqn_learner,
    family,
    load_script,
    main_in_process,
    pair,
    refused_in_process,
    run_script,
    spy,
    stack_of_one,
    start_long_run,
    stop_and_read,
    unstacked,
    wait_for,
)
from tensordict import from_module
from test_dqn import LEARNING, LEARNING_THRESHOLD
from test_ppo_family import LEARNING as PPO_LEARNING

import leanrl_utils

PATH, PQN_PATH, PPO_PATH, DISCRETE_PATH = (pair(f)[1] for f in ("dqn", "pqn", "ppo_continuous_action", "ppo"))
ATARI_PATH, PQN_TORCHENV_PATH, DQN_ATARI_PATH = (
    pair(f)[1] for f in ("ppo_atari_envpool", "pqn_torchenv", "dqn_atari_envpool")
)
N, N_OBS, N_ACT, BUFFER, BATCH = 3, 4, 2, 500, 32

# The lean scripts, each imported once for the module: fixtures `lean` (DQN), `pqn`, `ppo` (continuous), `discrete`, `atari`.
for _name, _path in {"lean": PATH, "pqn": PQN_PATH, "ppo": PPO_PATH, "discrete": DISCRETE_PATH, "atari": ATARI_PATH}.items():
    globals()[_name] = pytest.fixture(scope="module", name=_name)(lambda path=_path: load_script(path))


def compiled_as_main(update, module, compiled, fullgraph=True, cpp_wrapper=False):
    """`update` compiled as the scripts compile it on a CPU, or as it is."""
    options = {"guard_filter_fn": module.speed.value_guards, **({"cpp_wrapper": True} if cpp_wrapper else {})}
    return torch.compile(update, fullgraph=fullgraph, options=options) if compiled else update


# Seed 1's minibatch indices changed, the other seeds' kept.
changed_indices = lambda idx: [torch.cat([i[:1], i[1:2].flip(1) // 2, i[2:]]) for i in idx]


def dqn_case(lean, change=None):
    """N Q-networks with their targets, N filled single-seed storages and 5 batches [N, BATCH]."""
    torch.manual_seed(0)
    nets, targets = ([lean.QNetwork(N_OBS, N_ACT) for _ in range(N)] for _ in range(2))
    fields = {key: ((N_OBS,), torch.float32) for key in ("obs", "next_obs")}
    fields.update(actions=((), torch.int64), rewards=((), torch.float32), dones=((), torch.float32))
    storages = [lean.ReplayBuffer(BUFFER, fields, 10, "cpu").storage for _ in range(N)]
    for storage in storages:
        storage["obs"].normal_(), storage["next_obs"].normal_(), storage["actions"].random_(0, N_ACT)
        storage["rewards"].normal_(), storage["dones"].bernoulli_(0.1)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(BUFFER, (N, BATCH), generator=generator) for _ in range(5)]
    if change == "params":
        nets[1].network[0].weight.data.mul_(1.5)
    if change == "data":
        storages[1]["rewards"].add_(1.0)
    return nets, targets, storages, changed_indices(batches) if change == "batch" else batches


# The script's --num-seeds set-up (`dqn_learner`), the storage as [buffer_size, seeds, ...].
def dqn_stacked(lean, nets, targets, storages):
    return dqn_learner(lean, nets, targets, {key: torch.stack([s[key] for s in storages], dim=1) for key in storages[0]})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stacked_update_is_n_single_updates(lean, compiled):
    """3 stacked seeds against 3 single-seed updates on the same 5 batches, a target copy after the third (rtol 1e-5)."""
    nets, targets, storages, batches = dqn_case(lean)
    seed_nets, params, target_params, update = dqn_stacked(lean, nets, targets, storages)
    singles = [dqn_stacked(lean, [nets[k]], [targets[k]], [storages[k]]) for k in range(N)]
    update = compiled_as_main(update, lean, compiled, fullgraph=False, cpp_wrapper=True)
    for step, idx in enumerate(batches):
        if step == 3:
            for _, source, target, _ in [(None, params, target_params, None), *singles]:
                target.lerp_(source, 1.0)
        metrics = update(idx.flatten())
        assert metrics.shape == (len(lean.METRICS), N)
        for k, ((net,), _, _, single_update) in enumerate(singles):
            torch.testing.assert_close(metrics[:, k], single_update(idx[k])[:, 0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(seed_nets[k].state_dict(), net.state_dict(), rtol=1e-5, atol=1e-6)


def test_each_seed_stores_its_own_sub_envs(lean, tmp_path, monkeypatch):
    """With 2 seeds of 2 envs, buffer row i, column k holds sub-env k * 2 + i's action, reward and next obs."""
    steps = spy(monkeypatch, leanrl_utils.vector.SameStepEnvs, "step", lambda out, self, actions: (
        np.array(actions), out[0].copy(), out[1].copy(), out[4].get("_final_obs", np.zeros(4, bool))))  # fmt: skip
    adds = spy(monkeypatch, lean.ReplayBuffer, "add", lambda out, self, **rows: {k: np.array(v) for k, v in rows.items()})
    assert main_in_process(lean, "--num-seeds", 2, "--num-envs", 2, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    assert len(steps) == len(adds) == 200
    ended = 0
    for (actions, next_obs, rewards, final), rows in zip(steps, adds):
        assert rows["obs"].shape == (2, 2, 4) and rows["actions"].shape == (2, 2)
        for k in range(2):
            for i in range(2):
                j = k * 2 + i
                assert rows["actions"][i, k] == actions[j] and rows["rewards"][i, k] == rewards[j]
                ended += bool(final[j])
                if not final[j]:
                    np.testing.assert_array_equal(rows["next_obs"][i, k], next_obs[j])
    assert ended > 0


seed_dirs = lambda workdir: sorted((Path(workdir) / "runs").iterdir(), key=lambda d: int(d.name.split("__")[2]))


@pytest.mark.parametrize("script", ["dqn", "pqn"])
def test_sigterm_saves_every_seed_and_prints_one_summary(script, workdir):
    """SIGTERM mid-training: exit 143 with the summary, and a finite checkpoint for each seed."""
    argv = ["--total-timesteps", 10_000_000, "--num-seeds", 2, "--save-model"]
    proc = start_long_run(pair(script)[1], workdir, *argv)
    summary = stop_and_read(proc, signal.SIGTERM, wait_for(proc, "sps="))
    assert summary["interrupted"] is True and summary["num_seeds"] == 2
    checkpoints = [list(d.glob(f"{script}_torchcompile.pt")) for d in seed_dirs(workdir)]
    assert [len(c) for c in checkpoints] == [1, 1]
    for (path,) in checkpoints:
        weights = torch.load(path, weights_only=True)["model"]["q_network"]
        assert all(torch.isfinite(t).all() for t in weights.values())


# Per script: the words of the one line, and whether each seed keeps a checkpoint (None: either way).
DIVERGED = {
    "dqn": (PATH, ["non-finite td_loss", "(seed "], True),
    "pqn": (PQN_PATH, ["non-finite td_loss", "(seed "], None),
    "pqn-torchenv": (PQN_TORCHENV_PATH, ["non-finite td_loss", "(seed "], None),
    "ppo-atari": (ATARI_PATH, ["non-finite", "at step 32 (seed 1)"], False),  # finite at no log point
}


@pytest.mark.parametrize("script", DIVERGED)
def test_a_diverged_seed_stops_the_run_with_no_non_finite_checkpoint(script, workdir):
    """A learning rate of 1e30: exit 1 after the summary, one line naming the seed, only finite checkpoints."""
    path, words, saved = DIVERGED[script]
    argv = [*TINY[family(path)], "--num-seeds", 2, "--learning-rate", 1e30, "--save-model"]
    summary, proc = run_script(path, *argv, cwd=workdir, check=False)
    assert proc.returncode == 1 and summary["num_seeds"] == 2
    assert_one_line_error(proc, *words)
    checkpoints = [list(d.glob("*.pt")) for d in seed_dirs(workdir)]
    assert saved is None or [len(c) for c in checkpoints] == [int(saved)] * 2
    assert saved is not False or summary["checkpoint"] is None
    for path in sum(checkpoints, []):
        weights = torch.load(path, weights_only=True)["model"]["q_network"]
        assert all(torch.isfinite(t).all() for t in weights.values())


def ppo_rollout(n_obs, n_act, discrete=False):
    """A rollout of `n` steps: obs, actions, old log-probabilities, advantages, returns and values."""

    def rollout(n):
        actions = torch.randint(0, n_act, (n,)) if discrete else torch.randn(n, n_act)
        logprobs = torch.randn(n) * 0.3 - np.log(n_act) if discrete else torch.randn(n) - 3.0
        return torch.randn(n, n_obs), actions, logprobs, *(torch.randn(n) for _ in range(3))

    return rollout


def atari_rollout(n):
    """As the Atari script feeds its update: about 1 step in 8 a reset step (valid 0)."""
    frames, actions = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 4, (n,))
    return frames, actions, -torch.rand(n) - 1.0, *(torch.randn(n) for _ in range(3)), (torch.rand(n) > 0.125).float()


def moved_agent(module):
    """A continuous agent whose policy has moved from its initial, near-zero, output layer."""
    agent = module.Agent(4, 2)
    agent.actor_mean[4].weight.data.normal_(0, 0.3)
    return agent


# Per script: fixture, seeds, agent, rollout, sizes, steps, Args (clipping that bites), first weight, a change.
PPO_SCRIPTS = {
    "ppo-continuous": dict(fixture="ppo", seeds=N, agent=moved_agent, rollout=ppo_rollout(4, 2), batch=64, minibatch=16,
                           steps=4, args={}, first=lambda a: a.critic[0].weight, change=lambda r: (*r[:3], r[3] + 1, *r[4:])),
    "ppo-discrete": dict(fixture="discrete", seeds=N, agent=lambda m: m.Agent(4, 3), rollout=ppo_rollout(4, 3, discrete=True),
                         batch=64, minibatch=16, steps=4, args={"max_grad_norm": 0.05}, first=lambda a: a.critic[0].weight,
                         change=lambda r: (*r[:3], r[3] + 1.0, *r[4:])),
    "ppo-atari": dict(fixture="atari", seeds=2, agent=lambda m: m.Agent(4), rollout=atari_rollout, batch=16, minibatch=8,
                      steps=3, args={"max_grad_norm": 0.05}, first=lambda a: a.network[0].weight,
                      change=lambda r: (255 - r[0], *r[1:])),
}  # fmt: skip


def ppo_case(request, script, change=None):
    """A PPO script, its agents, a rollout per seed, minibatch indices [seeds, minibatch]; seed 1's `change`d."""
    spec = PPO_SCRIPTS[script]
    module = request.getfixturevalue(spec["fixture"])
    torch.manual_seed(0)
    agents = [spec["agent"](module) for _ in range(spec["seeds"])]
    rollouts = [spec["rollout"](spec["batch"]) for _ in agents]
    idx = [torch.stack([torch.randperm(spec["batch"])[: spec["minibatch"]] for _ in agents]) for _ in range(spec["steps"])]
    if change == "params":
        spec["first"](agents[1]).data.mul_(1.5)
    if change == "data":
        rollouts[1] = spec["change"](rollouts[1])
    return module, agents, rollouts, changed_indices(idx) if change == "batch" else idx


def ppo_updates(request, script, compiled=False, change=None):
    """The case, the --num-seeds update over copies of its agents (one Adam), the stacked batch, single-seed updates."""
    module, agents, rollouts, idx = ppo_case(request, script, change)
    spec = PPO_SCRIPTS[script]
    args = module.Args(num_minibatches=spec["batch"] // spec["minibatch"], **spec["args"])
    adam = lambda params: module.optimizers.Adam(params, torch.tensor(args.learning_rate), eps=1e-5, fused=not compiled)
    seed_agents = copy.deepcopy(agents)
    stacked = module.make_update(seed_agents[0], adam(module.seeds.stack(seed_agents).items()), args, num_seeds=len(agents))
    single = lambda agent: module.make_update(agent, adam(stack_of_one(agent)), args)
    singles = [(a, unstacked(compiled_as_main(single(a), module, compiled))) for a in copy.deepcopy(agents)]
    batch = tuple(torch.stack(fields) for fields in zip(*rollouts))
    return module, agents, rollouts, idx, seed_agents, compiled_as_main(stacked, module, compiled), batch, singles


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("script", PPO_SCRIPTS)
def test_ppo_stacked_update_is_n_single_updates(script, compiled, request):
    """Stacked agents (vmap over the gradient and its clipping, one Adam) against single-seed updates (rtol 1e-5)."""
    module, agents, rollouts, idx, seed_agents, update, batch, singles = ppo_updates(request, script, compiled)
    for step_idx in idx:
        metrics = update(*batch, step_idx)
        assert metrics.shape == (len(agents), len(module.METRICS))
        for k, (agent, single_update) in enumerate(singles):
            torch.testing.assert_close(metrics[k], single_update(*rollouts[k], step_idx[k]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(seed_agents[k].state_dict(), agent.state_dict(), rtol=1e-5, atol=1e-6)
    first = PPO_SCRIPTS[script]["first"]
    assert not torch.equal(first(seed_agents[0]), first(agents[0]))  # the steps moved the weights


Q_BATCH, Q_MINIBATCH, Q_CLIP = 64, 16, 20.0  # --max-grad-norm: between the case's gradient norms


def pqn_updates(pqn, compiled=False, change=None):
    """As ppo_updates, for N Q-networks whose returns' scales put their gradient norms either side of Q_CLIP."""
    torch.manual_seed(0)
    nets = [pqn.QNetwork(N_OBS, N_ACT) for _ in range(N)]
    rollouts = [
        (torch.randn(Q_BATCH, N_OBS), torch.randint(0, N_ACT, (Q_BATCH,)), torch.randn(Q_BATCH) * scale + shift)
        for scale, shift in ((0.1, 0.0), (10.0, 2.0), (1.0, 2.0))
    ]
    idx = [torch.stack([torch.randperm(Q_BATCH)[:Q_MINIBATCH] for _ in range(N)]) for _ in range(4)]
    if change == "params":
        nets[1].network[0].weight.data.mul_(1.5)
    if change == "data":
        rollouts[1] = (*rollouts[1][:2], rollouts[1][2] + 1.0)
    radam = lambda params: pqn.optimizers.RAdam(params, torch.tensor(2.5e-4), capturable=compiled)
    seed_nets = copy.deepcopy(nets)
    stacked = pqn.make_update(seed_nets[0], radam(pqn.seeds.stack(seed_nets).items()), Q_CLIP, N)
    singles = [(net, pqn.make_update(net, radam(stack_of_one(net)), Q_CLIP, 1)) for net in copy.deepcopy(nets)]
    unstack = lambda single: lambda *b: single(*(x[None] for x in b))[:, 0]
    singles = [(net, compiled_as_main(unstack(single), pqn, compiled, cpp_wrapper=True)) for net, single in singles]
    batch = tuple(torch.stack(fields) for fields in zip(*rollouts))
    stacked = compiled_as_main(stacked, pqn, compiled, cpp_wrapper=True)
    return pqn, nets, rollouts, changed_indices(idx) if change == "batch" else idx, seed_nets, stacked, batch, singles


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pqn_stacked_update_is_n_single_updates(pqn, compiled):
    """3 stacked Q-networks (one RAdam, each seed clipped by its own norm) against single-seed updates (rtol 1e-5)."""
    _, nets, rollouts, idx, seed_nets, update, batch, singles = pqn_updates(pqn, compiled)
    norms = []  # the first step's gradient norms: the clipping bites for some seeds and not for others
    for k, (net, (obs, actions, returns)) in enumerate(zip(nets, rollouts)):
        rows = idx[0][k]
        torch.nn.functional.mse_loss(returns[rows], net(obs[rows]).gather(1, actions[rows, None]).squeeze(1)).backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])).item())
    assert min(norms) < Q_CLIP < max(norms), norms
    for step_idx in idx:
        metrics = update(*batch, step_idx)
        assert metrics.shape == (len(pqn.METRICS), N)
        for k, (net, single_update) in enumerate(singles):
            torch.testing.assert_close(metrics[:, k], single_update(*rollouts[k], step_idx[k]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(seed_nets[k].state_dict(), net.state_dict(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(seed_nets[0].network[0].weight, nets[0].network[0].weight)


def assert_only_seed_one_moved(results, seed_dim):
    """`results`: metrics and each seed's parameters without and with a change to seed 1: only seed 1's differ."""
    (before, params_before), (after, params_after) = results
    for k in range(len(params_before)):
        if k != 1:
            torch.testing.assert_close(after.select(seed_dim, k), before.select(seed_dim, k), rtol=0, atol=0)
            torch.testing.assert_close(params_after[k], params_before[k], rtol=0, atol=0)
    assert not torch.equal(after.select(seed_dim, 1), before.select(seed_dim, 1))


@pytest.mark.parametrize("change", ["batch", "data", "params"])
@pytest.mark.parametrize("script", ["dqn", "pqn", *PPO_SCRIPTS])
def test_changing_one_seed_changes_no_other_seed(script, change, request):
    """Seed 1's minibatch indices, data or parameters changed: every other seed updates as before, bit for bit."""
    results = []
    for changed in (None, change):
        if script == "dqn":
            lean = request.getfixturevalue("lean")
            nets, targets, storages, batches = dqn_case(lean, changed)
            seed_nets, *_, update = dqn_stacked(lean, nets, targets, storages)
            metrics = [update(idx.flatten()) for idx in batches]
        else:
            updates = pqn_updates(request.getfixturevalue("pqn"), change=changed) if script == "pqn" else None
            _, _, _, idx, seed_nets, update, batch, _ = updates or ppo_updates(request, script, change=changed)
            metrics = [update(*batch, i) for i in idx]
        results.append((torch.stack(metrics), [from_module(net).data.clone() for net in seed_nets]))
    assert_only_seed_one_moved(results, seed_dim=1 if script in PPO_SCRIPTS else 2)


def test_ppo_atari_explained_variance_is_per_seed(atari):
    """On [seeds, batch], each seed's explained variance is the single-seed value of its row (rtol 1e-6)."""
    g = torch.Generator().manual_seed(4)
    values, returns = torch.randn(2, 256, generator=g), torch.randn(2, 256, generator=g)
    returns[1] = 3 * returns[1] + values[1]
    valid = (torch.rand(2, 256, generator=g) > 0.2).float()
    per_seed = atari.explained_variance(values, returns, valid)
    assert per_seed.shape == (2,)
    single = torch.stack([atari.explained_variance(values[k], returns[k], valid[k]) for k in range(2)])
    torch.testing.assert_close(per_seed, single, rtol=1e-6, atol=0)
    assert not torch.isclose(per_seed[0], per_seed[1])


def test_ppo_atari_finished_games_go_to_their_seeds_run(atari):
    """Envpool infos of 2 seeds x 2 envs (nested `players` too) where sub-envs 1 and 2 end: each goes to its seed."""
    infos = {"env_id": np.arange(4), "players": {"env_id": np.arange(4)}, "lives": np.array([3, 0, 0, 2]),
             "reward": np.zeros(4), "terminated": np.array([0, 1, 1, 0]), "ram": np.zeros((4, 128), np.uint8),
             "elapsed_step": np.arange(4), "episode": {"r": np.array([1.0, 2.0, 3.0, 4.0]), "l": np.array([10, 20, 30, 40])},
             "_episode": np.array([False, True, True, False])}  # fmt: skip
    ended = [leanrl_utils.vector.ended_episodes(7, leanrl_utils.seeds.seed_slice(infos, k, 2)) for k in range(2)]
    assert ended == [[(7, 2.0, 20)], [(7, 3.0, 30)]]


def record_rollouts(module, env_class, factory, monkeypatch):
    """Records the observations and actions of `env_class` and each update's batch as a run goes."""
    observations, actions, batches, make_update = [], [], [], getattr(module, factory)
    spy(monkeypatch, env_class, "reset", lambda out, self, **kwargs: observations.append(out[0].copy()))
    spy(monkeypatch, env_class, "step", lambda out, self, a: (actions.append(np.array(a)), observations.append(out[0].copy())))
    record = lambda update: lambda *batch: (batches.append([t.clone() for t in batch[:-1]]), update(*batch))[1]
    monkeypatch.setattr(module, factory, lambda *args: record(make_update(*args)))
    return observations, actions, batches


def assert_rows_hold_their_seeds_sub_envs(batch, observations, actions, num_steps, num_envs=2):
    """Row k of a --num-seeds batch holds sub-envs k * num_envs + i, step by step: their obs and actions."""
    obs, acts = batch[0], batch[1]
    for t in range(num_steps):
        for k in range(len(obs)):
            for i in range(num_envs):
                np.testing.assert_array_equal(obs[k, t * num_envs + i].numpy(), observations[t][k * num_envs + i])
                assert acts[k, t * num_envs + i] == actions[t][k * num_envs + i]
    assert not torch.equal(obs[0], obs[1])


# Per script: its fixture, the env class whose steps are recorded, the first batch's shape, the steps per rollout.
OWN_SUB_ENVS = {"pqn": ("pqn", "SameStepEnvs", (2, 128, 4), 64),
                "ppo-atari": ("atari", "RecordEpisodeStatistics", (2, 32, 4, 84, 84), 16)}  # fmt: skip


@pytest.mark.parametrize("script", OWN_SUB_ENVS)
def test_each_seed_learns_from_its_own_sub_envs(script, request, tmp_path, monkeypatch):
    """With 2 seeds of 2 envs, row k of the update's first batch holds sub-envs 2k and 2k + 1."""
    fixture, env_class, shape, num_steps = OWN_SUB_ENVS[script]
    module, env_class = request.getfixturevalue(fixture), getattr(leanrl_utils.vector, env_class)
    observations, actions, batches = record_rollouts(module, env_class, "make_update", monkeypatch)
    assert main_in_process(module, "--num-seeds", 2, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    assert batches[0][0].shape == shape and batches[0][1].shape == shape[:2]
    assert_rows_hold_their_seeds_sub_envs(batches[0], observations, actions, num_steps=num_steps)


def test_pqn_seed_k_starts_as_a_single_run_of_seed_k(pqn, tmp_path, monkeypatch):
    """Seed 6 of a two-seed run from seed 5 starts from the weights and first observations of a single run of seed 6."""
    stacked = spy(monkeypatch, pqn.seeds, "stack", lambda out, nets: [copy.deepcopy(net.state_dict()) for net in nets])
    first_seed = lambda out, net, params, *rest, **kw: {k: t[0].clone() for k, t in params.items()}
    policies = spy(monkeypatch, pqn, "make_policy", first_seed)
    obs = spy(monkeypatch, pqn.vector.SameStepEnvs, "reset", lambda out, self, **kwargs: out[0].copy())
    assert main_in_process(pqn, "--num-seeds", 2, "--seed", 5, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    assert main_in_process(pqn, "--seed", 6, tmp_path=tmp_path, monkeypatch=monkeypatch) == 0
    (two_seeds,), single = [nets for nets in stacked if len(nets) == 2], policies[-1]  # a single run stacks its one too
    torch.testing.assert_close(dict(two_seeds[1]), single, rtol=0, atol=0)
    assert not torch.equal(two_seeds[0]["network.0.weight"], single["network.0.weight"])
    np.testing.assert_array_equal(obs[0][2:], obs[1])


# Per script: extra arguments, steps and updates (None: some) per seed, its checkpoint's network and first layer.
Q_NETWORK = ("q_network", "network.0.weight", (120, 4))
TWO_SEEDS = {
    "dqn": (PATH, [], 400, None, Q_NETWORK),
    "pqn": (PQN_PATH, [], 512, 16, Q_NETWORK),
    "pqn-torchenv": (PQN_TORCHENV_PATH, [], 512, 16, Q_NETWORK),
    "ppo": (PPO_PATH, ["--num-envs", 2], 256, 8, ("agent", "critic.0.weight", (64, 4))),
    "ppo-discrete": (DISCRETE_PATH, [], 512, 16, ("agent", "actor.0.weight", (64, 4))),
    "ppo-atari": (
        ATARI_PATH,
        ["--total-timesteps", 1024, "--num-steps", 32],
        1024,
        64,
        ("agent", "network.0.weight", (32, 4, 8, 8)),
    ),
}


@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=["eager", "compile"])
@pytest.mark.parametrize("script", TWO_SEEDS)
def test_two_seeds_run_with_a_folder_each(script, mode, workdir):
    """Seeds 5 and 6: a folder, curve, return, checkpoint (and wandb run) each; seed 6's evaluates alone as reported."""
    path, extra, steps, updates, (network, first, shape) = TWO_SEEDS[script]
    save, track = ([], []) if mode else (["--save-model"], ["--track"] if script in ("dqn", "pqn") else [])
    argv = [*TINY[family(path)], *mode, *extra, *save, *track, "--num-seeds", 2, "--seed", 5, "--eval-episodes", 1]
    summary, _ = run_script(path, *argv, cwd=workdir, env={"WANDB_MODE": "offline"})
    assert len(list((Path(workdir) / "wandb").glob("offline-run-*"))) == 2 * len(track)  # a wandb run per seed
    assert summary["num_seeds"] == 2 and summary["total_steps"] == steps
    assert summary["updates"] == (updates or summary["updates"]) > 0
    assert len(summary["episodic_returns"]) == len(summary["eval_returns"]) == 2
    assert None not in summary["episodic_returns"] and None not in summary["eval_returns"], summary
    assert summary["episodic_return"] == pytest.approx(sum(summary["episodic_returns"]) / 2, abs=1e-3)
    assert summary["eval_return"] == pytest.approx(sum(summary["eval_returns"]) / 2, abs=1e-3)
    dirs = seed_dirs(workdir)
    assert [d.name.split("__")[2] for d in dirs] == ["5", "6"] and len({d.name.split("__")[3] for d in dirs}) == 1
    for d in dirs:
        rows = list(csv.DictReader(open(d / "curve.csv")))
        assert rows and int(rows[-1]["step"]) == steps, d
    if mode:
        return
    checkpoints = [next(d.glob("*.pt")) for d in dirs]
    assert str(checkpoints[0]).endswith(summary["checkpoint"])
    models = [torch.load(c, weights_only=True)["model"] for c in checkpoints]
    rms = models[1].get("obs_rms")  # PPO continuous: each seed's own envs' statistics
    assert torch.load(checkpoints[1], weights_only=True)["args"]["seed"] == 6
    assert set(models[1]) == {network, *(["obs_rms"] if script == "ppo" else [])}
    assert rms is None or (rms["mean"].shape == (2, 4) and not torch.equal(models[0]["obs_rms"]["mean"], rms["mean"]))
    assert models[1][network][first].shape == shape  # Each seed's own weights, not a view of both seeds' storage.
    assert not torch.equal(models[0][network][first], models[1][network][first])
    argv = ["--env-id", summary["env_id"], "--total-timesteps", 0, "--eval-episodes", 1, "--seed", 6]
    loaded, _ = run_script(path, "--load-model", checkpoints[1], *argv, cwd=workdir)
    assert loaded["num_seeds"] == 1 and "episodic_returns" not in loaded
    assert loaded["eval_return"] == summary["eval_returns"][1]


# "--num-seeds 0" in every script that has it: test_faults.py.
BAD = {
    "dqn-zero": (PATH, ["--num-seeds", 0], ["--num-seeds", "1 or more"]),
    "dqn-no-memory": (PATH, ["--num-seeds", 4, "--buffer-size", 10**12], ["--num-seeds 4", "GiB"]),
    "dqn-atari-no-memory": (DQN_ATARI_PATH, ["--num-seeds", 3, "--buffer-size", 10**12],
                            ["--num-seeds 3", "--buffer-size 1000000000000", "GiB"]),
    "pqn-seed-overflow": (PQN_PATH, ["--num-seeds", 2, "--seed", 2**32 - 1], ["--num-seeds 2", "2**31"]),
    "pqn-no-memory": (PQN_PATH, ["--num-seeds", 10**6], ["--num-seeds 1000000", "GiB"]),
    "pqn-torchenv-no-memory": (PQN_TORCHENV_PATH, ["--num-seeds", 10**6], ["--num-seeds 1000000", "GiB"]),
    "ppo-target-kl": (PPO_PATH, ["--num-seeds", 2, "--target-kl", 0.01], ["--target-kl", "--num-seeds 1"]),
    "ppo-no-memory": (PPO_PATH, ["--num-seeds", 10**6], ["--num-seeds 1000000", "GiB"]),
    "ppo-discrete-target-kl": (DISCRETE_PATH, ["--num-seeds", 2, "--target-kl", 0.01], ["--target-kl", "--num-seeds 1"]),
    "ppo-discrete-no-memory": (DISCRETE_PATH, ["--num-seeds", 10**6], ["--num-seeds 1000000", "GiB"]),
    "atari-target-kl": (ATARI_PATH, ["--num-seeds", 2, "--target-kl", 0.01], ["--target-kl", "--num-seeds 1"]),
    "atari-seed-overflow": (ATARI_PATH, ["--num-seeds", 2, "--seed", 2**32 - 1], ["--num-seeds 2", "2**31"]),
    "atari-no-memory": (ATARI_PATH, ["--num-seeds", 10**6], ["--num-seeds 1000000", "GiB"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_num_seeds_is_one_line(case, tmp_path, monkeypatch, capsys):
    path, argv, words = BAD[case]
    refused_in_process(load_script(path), *argv, words=words, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


# Per script: the single-seed learning run (arguments, budget per seed, threshold; PQN's 200: 2 of 180 runs below).
LEARNS = {
    "dqn-cartpole": (PATH, [*LEARNING, "--compile"], 30_000, LEARNING_THRESHOLD),
    "ppo-inverted-pendulum": (PPO_PATH, [*PPO_LEARNING["ppo_continuous_action"][0], "--seed", 1, "--compile"], 40_960,
                              PPO_LEARNING["ppo_continuous_action"][1]),
    "pqn-cartpole": (PQN_PATH, ["--seed", 1, "--compile"], 499_712, 200.0),
    "pqn-torchenv-cartpole": (PQN_TORCHENV_PATH, ["--seed", 1, "--compile"], 499_712, 200.0),
}  # fmt: skip


@pytest.mark.learning
@pytest.mark.parametrize("task", LEARNS)
def test_every_seed_of_four_learns(task, workdir):
    """Each of 4 seeds trained at once reaches the single-seed test's threshold on its budget per seed."""
    path, argv, steps, threshold = LEARNS[task]
    summary, _ = run_script(path, *argv, "--num-seeds", 4, cwd=workdir, timeout=1800)
    print("per-seed returns:", summary["episodic_returns"])
    assert summary["total_steps"] == steps and summary["num_seeds"] == 4
    assert all(r is not None and r >= threshold for r in summary["episodic_returns"]), summary

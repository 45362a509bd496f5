"""Both gym PPO pairs: the update, GAE, --target-kl, numpy refusals, determinism, learning."""

import copy
import csv
import math
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TINY, family, load_script, pair, refused_call, refused_in_process, run_script, stack_of_one, unstacked

import leanrl_utils

FAMILIES = ["ppo", "ppo_continuous_action"]
PATHS = [path for family in FAMILIES for path in pair(family)]
N_OBS, N_ACT, BATCH, MINIBATCH = {"ppo": 4, "ppo_continuous_action": 11, "ppo_torchenv": 4}, 3, 256, 64


def discrete_batch(g, n_obs=4, n_act=N_ACT, n=BATCH):
    """A rollout: obs, actions, old log-probabilities near log(1/3), advantages, returns, values."""
    logprobs = torch.randn(n, generator=g) * 0.3 - np.log(n_act)
    obs, actions = torch.randn(n, n_obs, generator=g), torch.randint(0, n_act, (n,), generator=g)
    return obs, actions, logprobs, *(torch.randn(n, generator=g) for _ in range(3))


def continuous_batch(g, n_obs=11, n_act=N_ACT, n=BATCH):
    obs, actions = torch.randn(n, n_obs, generator=g), torch.randn(n, n_act, generator=g)
    return obs, actions, *(torch.randn(n, generator=g) - shift for shift in (3.0, 0.0, 0.0, 0.0))


def changed_mlp(n_in, n_out, activation, device=None):
    """A researcher's edit of a PPO network: other widths, `activation` first, ReLU after, an extra layer."""
    widths = [n_in, 32, 48, 16, n_out]
    layers = [nn.Linear(a, b, device=device) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(layers[0], activation(), layers[1], nn.ReLU(), layers[2], nn.ReLU(), layers[3])


def changed_agent(lean, activation=nn.ReLU):
    """A researcher's edit of Agent, its forward kept: the critic and the actor changed (`changed_mlp`)."""
    continuous = "continuous" in lean.__name__

    class ChangedAgent(lean.Agent):
        def __init__(self, n_obs, n_act, device=None):
            nn.Module.__init__(self)
            self.critic = changed_mlp(n_obs, 1, activation, device)
            setattr(self, "actor_mean" if continuous else "actor", changed_mlp(n_obs, n_act, activation, device))
            if continuous:
                self.actor_logstd = nn.Parameter(torch.full((1, n_act), -0.5, device=device))

    return ChangedAgent


def stacked_policy(lean, agents, host):
    """The agents stacked, their lean policy (numpy seed 5), its generator's twin, obs, and the tolerance."""
    params = leanrl_utils.seeds.stack(agents)
    policy = lean.make_policy(agents[0], dict(params.items()), len(agents), host, seed=5)
    exact = dict(rtol=0, atol=0) if len(agents) == 1 and not host else dict(rtol=1e-5, atol=1e-5)
    return params, policy, np.random.default_rng(5), torch.randn(len(agents) * 64, 6), exact


def inverse_cdf(logits, uniforms):
    """The action the lean policy draws from `logits` [rows, n] for uniforms [rows, 1] in [0, 1)."""
    cdf = (logits - logits.max(-1, keepdim=True).values).exp().cumsum(-1)
    return (cdf <= uniforms * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)


def discrete_torch_act(agent, obs):
    """What the lean torch policy acts: the inverse CDF of the actor's softmax at torch.rand, and the value."""
    logits, value = agent(obs)
    return inverse_cdf(logits, torch.rand(len(obs), 1)), value


def continuous_torch_act(agent, obs):
    mean, logstd, value = agent(obs)
    return mean + logstd.exp() * torch.randn(mean.shape), value


def discrete_draws(plain, rng, monkeypatch):
    """The plain Categorical draws as the lean CPU policy's; returns the lean bootstrap's unused draw."""

    class Categorical(torch.distributions.Categorical):
        def sample(self, sample_shape=torch.Size()):
            return inverse_cdf(self.logits, torch.from_numpy(rng.random((len(self.logits), 1), dtype=np.float32)))

    monkeypatch.setattr(plain, "Categorical", Categorical)
    return lambda agent, obs: rng.random((len(obs), 1), dtype=np.float32)


def continuous_draws(plain, rng, monkeypatch):
    """The plain script's Normal draws as the lean CPU policy does (numpy's float32 standard normals)."""

    class Normal(torch.distributions.Normal):
        def sample(self, sample_shape=torch.Size()):
            return self.loc + self.scale * torch.from_numpy(rng.standard_normal(tuple(self.loc.shape), dtype=np.float32))

    monkeypatch.setattr(plain, "Normal", Normal)
    return lambda agent, obs: rng.standard_normal((len(obs), agent.actor_logstd.shape[1]), dtype=np.float32)


# Per family: batch, Args (clipping that bites), actor's name, torch policy's acting, plain draws as lean, env.
SPEC = {
    "ppo": dict(batch=discrete_batch, args=dict(max_grad_norm=0.05), actor="actor", torch_act=discrete_torch_act,
                draws=discrete_draws, env_id="CartPole-v1"),
    "ppo_continuous_action": dict(batch=continuous_batch, args=dict(max_grad_norm=0.05, ent_coef=0.01), actor="actor_mean",
                                  torch_act=continuous_torch_act, draws=continuous_draws, env_id="InvertedPendulum-v5"),
}  # fmt: skip
SPEC["ppo_torchenv"] = SPEC["ppo"]  # its update is lean PPO's, on the same discrete batches


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    """A family's plain and lean scripts, imported, with its SPEC."""
    return family_spec(request.param)


@pytest.fixture(scope="module", params=[*FAMILIES, "ppo_torchenv"])
def update_fam(request):
    """As `fam`, for the update's tests: the torch-native PPO pair's update is checked here too."""
    return family_spec(request.param)


def family_spec(family):
    plain, lean = (load_script(path) for path in pair(family))
    spec = dict(SPEC[family], args=lean.Args(**SPEC[family]["args"]))
    return types.SimpleNamespace(plain=plain, lean=lean, n_obs=N_OBS[family], **spec)


def lean_update(lean, agent, args, compiled):
    """A lean minibatch update of one agent, eager (fused Adam) or compiled (per-tensor Adam), and its lr tensor."""
    lr = torch.tensor(args.learning_rate)
    update = lean.make_update(agent, leanrl_utils.optimizers.Adam(stack_of_one(agent), lr, eps=1e-5, fused=not compiled), args)
    options = {"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp.use_decompose_tanh": True}  # as the scripts
    return unstacked(torch.compile(update, fullgraph=True, options=options) if compiled else update), lr


def minibatches(generator, updates, rates, learning_rate):
    """Per update: the lr tensors annealed in place as the loops do, and a minibatch's indices."""
    for step in range(updates):
        for rate in rates:
            rate.copy_((1.0 - step / updates) * learning_rate)
        yield torch.randperm(BATCH, generator=generator)[:MINIBATCH]


def plain_step(agent, optimizer, args, minibatch):
    """The plain PPO scripts' minibatch step, as written in their loops."""
    obs, actions, logprobs, advantages, returns, values = minibatch
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
    logratio = newlogprob - logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl, clipfrac = ((ratio - 1) - logratio).mean(), ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
    newvalue = newvalue.view(-1)
    v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
    v_loss, entropy_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean(), entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()


def test_lean_update_is_the_plain_update(update_fam):
    """4 lean steps give the plain steps' metrics and parameters (rtol 1e-5), the clipping biting."""
    fam = update_fam
    torch.manual_seed(0)
    plain_agent, lean_agent = fam.plain.Agent(fam.n_obs, N_ACT), fam.lean.Agent(fam.n_obs, N_ACT)
    g = torch.Generator().manual_seed(2)
    batch = fam.batch(g)
    lean_agent.load_state_dict(plain_agent.state_dict())
    initial = copy.deepcopy(plain_agent)
    update, lr = lean_update(fam.lean, lean_agent, fam.args, compiled=False)
    optimizer, clipped = torch.optim.Adam(plain_agent.parameters(), lr=fam.args.learning_rate, eps=1e-5), 0.0
    for idx in minibatches(g, 4, (lr,), fam.args.learning_rate):
        optimizer.param_groups[0]["lr"] = float(lr)
        expected = plain_step(plain_agent, optimizer, fam.args, [t[idx] for t in batch])
        torch.testing.assert_close(update(*batch, idx), expected, rtol=1e-5, atol=1e-6)
        clipped += float(expected[-1])
    torch.testing.assert_close(lean_agent.state_dict(), plain_agent.state_dict(), rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(a, b) for a, b in zip(plain_agent.parameters(), initial.parameters()))
    assert clipped > 0  # some ratios left the clip range


def test_compiled_update_matches_eager(update_fam):
    """3 compiled steps (one graph, per-tensor Adam) agree with eager ones (fused Adam), lr changed in place (1e-4)."""
    fam = update_fam
    torch.manual_seed(0)
    args, g = fam.lean.Args(), torch.Generator().manual_seed(1)
    agents = [fam.lean.Agent(fam.n_obs, N_ACT)]
    agents.append(copy.deepcopy(agents[0]))
    batch = fam.batch(g)
    (eager, lr_eager), (compiled, lr_compiled) = (lean_update(fam.lean, a, args, c) for a, c in zip(agents, (False, True)))
    for idx in minibatches(g, 3, (lr_eager, lr_compiled), args.learning_rate):
        torch.testing.assert_close(compiled(*batch, idx), eager(*batch, idx), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(agents[1].state_dict(), agents[0].state_dict(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changed", [False, True], ids=["agent", "changed-agent"])
def test_stack_of_one_update_is_the_one_agent_update(update_fam, changed):
    """make_update over a stack of one runs the agent's own ops and Adam: the unstacked update's numbers, bit for bit."""
    fam = update_fam
    torch.manual_seed(0)
    single = (changed_agent(fam.lean) if changed else fam.lean.Agent)(fam.n_obs, N_ACT)
    g = torch.Generator().manual_seed(3)
    batch = fam.batch(g)
    stacked, initial = copy.deepcopy(single), copy.deepcopy(single)
    single_update, single_lr = lean_update(fam.lean, single, fam.args, compiled=False)
    lr = torch.tensor(fam.args.learning_rate)
    optimizer = leanrl_utils.optimizers.Adam(stack_of_one(stacked), lr, eps=1e-5, fused=True)
    stacked_update = fam.lean.make_update(stacked, optimizer, fam.args, num_seeds=1)
    for idx in minibatches(g, 3, (lr, single_lr), fam.args.learning_rate):
        metrics = stacked_update(*(x[None] for x in batch), idx[None])
        assert metrics.shape == (1, len(fam.lean.METRICS))
        torch.testing.assert_close(metrics[0], single_update(*batch, idx), rtol=0, atol=0)
    torch.testing.assert_close(stacked.state_dict(), single.state_dict(), rtol=0, atol=0)
    assert all(not torch.equal(a, b) for a, b in zip(single.parameters(), initial.parameters()))


def test_layer_without_a_numpy_form_is_one_line(fam, monkeypatch, tmp_path, capsys):
    """GELU: one `error:` line from make_policy and main; the torch form follows the module."""
    gelu_agent = changed_agent(fam.lean, activation=nn.GELU)
    torch.manual_seed(0)
    agents = [gelu_agent(fam.n_obs, 2) for _ in range(2)]
    params, words = dict(leanrl_utils.seeds.stack(agents).items()), [f"{fam.actor}.1", "GELU"]
    refused_call(capsys, fam.lean.make_policy, agents[0], params, 2, host=True, words=words)
    agent, obs = agents[0], torch.randn(64, fam.n_obs)
    policy = fam.lean.make_policy(agent, dict(leanrl_utils.seeds.stack([agent]).items()), 1, host=False)
    torch.manual_seed(7)
    action, _, value = policy(obs)
    torch.manual_seed(7)
    with torch.no_grad():
        expected_action, expected_value = fam.torch_act(agent, obs)
    torch.testing.assert_close((value, action), (expected_value, expected_action), atol=0, rtol=0)
    monkeypatch.setattr(fam.lean, "Agent", gelu_agent)
    refused_in_process(fam.lean, words=[f"{fam.actor}.1 (GELU)"], tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


def reference_gae(rewards, values, dones, next_value, gamma, gae_lambda):
    """CleanRL's loop, element by element."""
    num_steps, num_envs = rewards.shape
    advantages = torch.zeros_like(rewards)
    for env in range(num_envs):
        lastgaelam = 0.0
        for t in reversed(range(num_steps)):
            nextvalue, nonterminal = next_value[env] if t == num_steps - 1 else values[t + 1, env], 1.0 - dones[t, env]
            delta = rewards[t, env] + gamma * nextvalue * nonterminal - values[t, env]
            lastgaelam = delta + gamma * gae_lambda * nonterminal * lastgaelam
            advantages[t, env] = lastgaelam
    return advantages


@pytest.mark.parametrize("family", FAMILIES)
def test_gae_matches_reference_loop(family):
    """dones[t]: step t ended an episode (Atari's are shifted by a step: test_ppo_atari_envpool.py)."""
    lean, g = load_script(pair(family)[1]), torch.Generator().manual_seed(0)
    rewards, values = torch.randn(50, 3, generator=g), torch.randn(50, 3, generator=g)
    dones = (torch.rand(50, 3, generator=g) < 0.1).float()
    dones[-1, 0] = 1.0
    next_value = torch.randn(3, generator=g)
    advantages, returns = lean.make_gae(0.99, 0.95)(rewards, values, dones, next_value)
    expected = reference_gae(rewards, values, dones, next_value, 0.99, 0.95)
    torch.testing.assert_close((advantages, returns), (expected, expected + values))
    # At a done step the advantage is the last reward minus the value: nothing flows back.
    torch.testing.assert_close(advantages[-1, 0], rewards[-1, 0] - values[-1, 0])


# Scripted approx_kl: epoch 0 ends below the target but averages above it, epoch 1 ends above it: 2 epochs run.
TARGET_KL, OFFSET = 1.0, 2.0  # a log-ratio offset of 2 gives approx_kl = e^2 - 1 - 2 = 4.39
SCRIPTED = {(0, 0), (1, 1)}
KL_ENVS = {"ppo": dict(num_envs=1), "ppo_continuous_action": dict(env_id="InvertedPendulum-v5")}


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_target_kl_stops_after_the_epoch_whose_last_minibatch_exceeds_it(path, monkeypatch, tmp_path):
    module = load_script(path)
    minibatches, calls, logged = 2, [0], []
    scripted = lambda k: (k // minibatches, k % minibatches) in SCRIPTED
    if "torchcompile" not in path.stem:
        # The plain loop computes approx_kl from the log-ratio: shift the new log-probabilities.
        get_action_and_value = module.Agent.get_action_and_value

        def shifted(self, x, action=None):
            out = get_action_and_value(self, x, action)
            if action is None:  # acting: a new rollout, a new update phase
                calls[0] = 0
                return out
            calls[0] += 1
            return out[0], out[1] + (OFFSET if scripted(calls[0] - 1) else 0.0), *out[2:]

        monkeypatch.setattr(module.Agent, "get_action_and_value", shifted)
    else:
        make_policy, make_update = module.make_policy, module.make_update

        def counting_policy(*args, **kwargs):
            policy = make_policy(*args, **kwargs)
            return lambda obs: (calls.__setitem__(0, 0), policy(obs))[1]

        def scripted_update(agent, optimizer, args, *rest):
            update = make_update(agent, optimizer, args, *rest)

            def wrapped(*args):
                metrics = update(*args).clone()
                calls[0] += 1
                metrics[..., module.APPROX_KL] = math.exp(OFFSET) - 1 - OFFSET if scripted(calls[0] - 1) else 0.0
                return metrics

            return wrapped

        monkeypatch.setattr(module, "make_policy", counting_policy)
        monkeypatch.setattr(module, "make_update", scripted_update)
    monkeypatch.setattr(leanrl_utils.Run, "log", lambda self, step, updates, metrics, nets: logged.append((
        updates, metrics["losses/approx_kl"])))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    kl_args = dict(total_timesteps=256, num_steps=64, num_minibatches=minibatches, update_epochs=4, target_kl=TARGET_KL)
    module.main(module.Args(**kl_args, **KL_ENVS[family(path)]))
    updates = [u for u, _ in logged]
    assert [b - a for a, b in zip([0] + updates, updates)] == [4, 4, 4, 4]
    assert all(kl > TARGET_KL for _, kl in logged)  # the logged approx_kl is the last minibatch's


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_same_seed_same_run(path, workdir):
    """Two runs of one seed: the same summary (but timings) and learning curve (but wall clock)."""
    timing = {"wall_s", "sps", "warmup_s", "peak_rss_mb", "run_dir"}
    runs = [run_script(path, *TINY[family(path)], cwd=workdir)[0] for _ in range(2)]
    first, second = ({k: v for k, v in run.items() if k not in timing} for run in runs)
    assert first == second and first["updates"] == 16 and first["episodic_return"] is not None
    rows = lambda run: csv.DictReader(open(workdir / run["run_dir"] / "curve.csv"))
    curve = lambda run: [(r["step"], r["episodic_return"]) for r in rows(run)]
    curves = [curve(run) for run in runs]
    assert curves[0] == curves[1] and curves[0]


# Mean of the last 10 episodes on seed 1 (held on seeds 1-3 for both scripts, the torch-native CartPole's too).
LEARNING = {
    "ppo": (["--total-timesteps", "100000"], 150.0),
    "ppo_torchenv": (["--total-timesteps", "100000"], 150.0),
    "ppo_continuous_action": ("--env-id InvertedPendulum-v5 --total-timesteps 40960 --num-steps 1024".split(), 500.0),
}


@pytest.mark.learning
@pytest.mark.parametrize("path", [*PATHS, *pair("ppo_torchenv")], ids=lambda p: p.stem)
def test_learns(path, workdir):
    argv, threshold = LEARNING[family(path)]
    extra = ["--compile"] if "torchcompile" in path.stem else []
    summary, _ = run_script(path, *argv, "--seed", "1", *extra, cwd=workdir, timeout=900)
    assert summary["episodic_return"] >= threshold, summary

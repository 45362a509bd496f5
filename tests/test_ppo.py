"""PPO pair (discrete actions): the lean update against the plain update's math, compiled against
eager, a stack of one seed against one agent and stacked seeds against single ones, GAE against
the reference loop, the lean policy's inverse-CDF draw against the module's softmax, every form of
the networks derived from the module (also once the module is changed), the two scripts' whole
run on the same random draws, determinism, bad input, and learning."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import (
    TINY,
    assert_bad_input,
    assert_ppo_compiled_update_matches_eager,
    assert_ppo_lean_update_is_plain,
    assert_ppo_same_draws_same_run,
    assert_ppo_stack_of_one_is_the_one_agent,
    changed_mlp,
    main_in_process,
    pair,
    ppo_lean_update,
    run_script,
    same_seed_runs,
)

import leanrl_utils

FAMILY = "ppo"
PLAIN_PATH, LEAN_PATH = BOTH = pair(FAMILY)
N_OBS, N_ACT, BATCH, MINIBATCH = 4, 3, 256, 64


def random_batch(generator):
    """A rollout: observations, actions, old log-probabilities near log(1/3) (so that some ratios
    leave the clip range), advantages, returns and values."""
    g = generator
    logprobs = torch.randn(BATCH, generator=g) * 0.3 - np.log(N_ACT)
    obs, actions = torch.randn(BATCH, N_OBS, generator=g), torch.randint(0, N_ACT, (BATCH,), generator=g)
    return (
        obs,
        actions,
        logprobs,
        torch.randn(BATCH, generator=g),
        torch.randn(BATCH, generator=g),
        torch.randn(BATCH, generator=g),
    )


def test_lean_update_is_the_plain_update(plain, lean):
    """The lean step (log_softmax and gather for Categorical) is the plain one (Categorical)."""
    torch.manual_seed(0)
    plain_agent = plain.Agent(N_OBS, N_ACT)
    g = torch.Generator().manual_seed(2)
    args = lean.Args(max_grad_norm=0.05)  # a small max_grad_norm makes the clipping bite
    clipped = assert_ppo_lean_update_is_plain(plain_agent, lean, lean.Agent(N_OBS, N_ACT), args, random_batch(g), MINIBATCH, g)
    assert clipped > 0  # some ratios left the clip range


def test_compiled_update_matches_eager(lean):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    assert_ppo_compiled_update_matches_eager(lean, lean.Agent(N_OBS, N_ACT), random_batch(g), MINIBATCH, g)


def changed_agent(lean, activation=nn.ReLU):
    """A researcher's edit of Agent, its forward kept: both networks changed (`changed_mlp`)."""

    class ChangedAgent(lean.Agent):
        def __init__(self, n_obs, n_act, device=None):
            nn.Module.__init__(self)
            self.critic, self.actor = (changed_mlp(n_obs, n_out, activation, device) for n_out in (1, n_act))

    return ChangedAgent


def edited_forward(lean, op=torch.tanh):
    """A researcher's edit of Agent.forward: another activation (`op`) on the logits, scaled."""

    class EditedAgent(lean.Agent):
        def forward(self, obs):
            logits, value = super().forward(obs)
            return op(logits) * 3.0, value

    return EditedAgent


@pytest.mark.parametrize("changed", [False, True], ids=["agent", "changed-agent"])
def test_stack_of_one_update_is_the_one_agent_update(lean, changed):
    torch.manual_seed(0)
    single = (changed_agent(lean) if changed else lean.Agent)(N_OBS, N_ACT)
    g = torch.Generator().manual_seed(3)
    assert_ppo_stack_of_one_is_the_one_agent(lean, single, lean.Args(max_grad_norm=0.05), random_batch(g), MINIBATCH, g)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stacked_update_is_n_single_updates(lean, compiled):
    """3 stacked agents (vmap over the gradient and its clipping, one Adam step) against 3 single
    updates from the same parameters on the same minibatches each. Tolerance rtol 1e-5, atol 1e-6
    (float32 summed in another order)."""
    args = lean.Args(max_grad_norm=0.05)
    torch.manual_seed(0)
    agents = [lean.Agent(N_OBS, N_ACT) for _ in range(3)]
    g = torch.Generator().manual_seed(4)
    rollouts = [random_batch(g) for _ in agents]
    seed_agents = copy.deepcopy(agents)
    params = leanrl_utils.seeds.stack(seed_agents)
    optimizer = leanrl_utils.optimizers.Adam(params.items(), torch.tensor(args.learning_rate), eps=1e-5, fused=not compiled)
    stacked = lean.make_update(seed_agents[0], optimizer, args, 3)
    if compiled:
        stacked = torch.compile(stacked, fullgraph=True, options={"guard_filter_fn": leanrl_utils.speed.value_guards})
    singles = [ppo_lean_update(lean, agent, args, compiled)[0] for agent in agents]
    batch = tuple(torch.stack(fields) for fields in zip(*rollouts))
    for _ in range(2):
        idx = torch.stack([torch.randperm(BATCH, generator=g)[:MINIBATCH] for _ in agents])
        metrics = stacked(*batch, idx)
        for k, (agent, single) in enumerate(zip(agents, singles)):
            torch.testing.assert_close(metrics[k], single(*rollouts[k], idx[k]), rtol=1e-5, atol=1e-6)
    for k, agent in enumerate(agents):
        for name, value in agent.state_dict().items():
            torch.testing.assert_close(seed_agents[k].state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=f"{k} {name}")


def inverse_cdf(logits, uniforms):
    """The action the lean policy draws from `logits` [rows, n] for uniforms [rows, 1] in [0, 1)."""
    cdf = (logits - logits.max(-1, keepdim=True).values).exp().cumsum(-1)
    return (cdf <= uniforms * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_policy_samples_the_softmax_and_sees_every_update(lean, host):
    """Both acting paths give the critic's values, actions whose frequencies are the actor's softmax
    (20,000 draws over fixed logits: each frequency's standard error is under 0.004) and their
    log-probabilities, from the agent's current weights (an in-place change is seen at once)."""
    torch.manual_seed(0)
    agent = lean.Agent(N_OBS, N_ACT)
    with torch.no_grad():
        agent.actor[4].bias.copy_(torch.tensor([0.5, -1.0, 0.0]))
    params = dict(leanrl_utils.seeds.stack([agent]).items())
    policy = lean.make_policy(agent, params, 1, host, seed=1)
    for _ in range(2):
        obs = torch.randn(64, N_OBS)
        action, logprob, value = (torch.as_tensor(x) for x in policy(obs.numpy() if host else obs))
        with torch.no_grad():
            logits, expected_value = agent(obs)
        torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-5)
        expected_logprob = torch.distributions.Categorical(logits=logits).log_prob(action)
        torch.testing.assert_close(logprob, expected_logprob, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            for p in agent.parameters():
                p.mul_(1.5).add_(0.01)
    obs = torch.zeros(1, N_OBS).expand(20_000, N_OBS).contiguous()
    action = torch.as_tensor(policy(obs.numpy() if host else obs)[0])
    with torch.no_grad():
        probs = agent(obs[:1])[0].softmax(1)[0]
    counts = torch.bincount(action, minlength=N_ACT).float() / len(action)
    torch.testing.assert_close(counts, probs, rtol=0, atol=0.02)


@pytest.mark.parametrize("edit", ["layers", "forward"])
@pytest.mark.parametrize("num_seeds", [1, 3], ids=["1seed", "3seeds"])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_changed_network_is_followed_by_every_derived_form(lean, host, num_seeds, edit):
    """The networks written once: with Agent's actor and critic changed (widths, ReLU, an extra
    layer) or its forward edited (tanh on the logits), the numpy policy (a CPU) and the torch one
    (seeds.forward), for one seed and stacked
    seeds, give each seed's values of the changed critic, the inverse-CDF actions of the changed
    actor's softmax on the policy's own uniforms (replayed) and their log-probabilities, also after
    an in-place step of the stacked parameters. One seed in torch runs the module's own ops: bit
    for bit; numpy and vmapped seeds within float32 rounding (rtol and atol 1e-5)."""
    torch.manual_seed(0)
    agents = [(changed_agent if edit == "layers" else edited_forward)(lean)(6, 4) for _ in range(num_seeds)]
    params = leanrl_utils.seeds.stack(agents)
    policy = lean.make_policy(agents[0], dict(params.items()), num_seeds, host, seed=5)
    rng, obs = np.random.default_rng(5), torch.randn(num_seeds * 64, 6)
    exact = dict(rtol=0, atol=0) if num_seeds == 1 and not host else dict(rtol=1e-5, atol=1e-5)
    for _ in range(2):
        torch.manual_seed(7)
        action, logprob, value = (torch.as_tensor(x) for x in policy(obs.numpy() if host else obs))
        torch.manual_seed(7)
        uniforms = rng.random((num_seeds, 64, 1), dtype=np.float32).reshape(-1, 1) if host else torch.rand(len(obs), 1)
        with torch.no_grad():
            logits, expected_value = (torch.cat(x) for x in zip(*(a(b) for a, b in zip(agents, obs.view(num_seeds, 64, 6)))))
        torch.testing.assert_close(value, expected_value, **exact)
        assert torch.equal(action, inverse_cdf(logits, torch.as_tensor(uniforms)))
        torch.testing.assert_close(logprob, logits.log_softmax(1).gather(1, action[:, None])[:, 0], **exact)
        with torch.no_grad():
            for p in params.values():
                p.mul_(1.1).add_(0.01)


def test_forward_op_without_a_numpy_form_is_one_line(lean, capsys):
    """An edited forward calling what numpy acting has no form for (gelu) is refused in one line
    naming it, never acted on around it."""
    agent = edited_forward(lean, torch.nn.functional.gelu)(4, 2)
    with pytest.raises(SystemExit) as exit_info:
        lean.make_policy(agent, dict(leanrl_utils.seeds.stack([agent]).items()), 1, host=True)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert "gelu" in err and "EditedAgent.forward" in err, err


def test_layer_without_a_numpy_form_is_one_line(lean, monkeypatch, tmp_path, capsys):
    """A layer numpy acting has no form for (GELU) ends the run with exit 2 and one `error:` line
    naming it, before any step, also from main; the torch form follows the module as ever."""
    gelu_agent = changed_agent(lean, activation=nn.GELU)
    torch.manual_seed(0)
    agents = [gelu_agent(4, 2) for _ in range(2)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        lean.make_policy(agents[0], dict(leanrl_utils.seeds.stack(agents).items()), 2, host=True)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "actor.1" in err and "GELU" in err, err

    agent = gelu_agent(4, 2)
    policy = lean.make_policy(agent, dict(leanrl_utils.seeds.stack([agent]).items()), 1, host=False)
    obs = torch.randn(64, 4)
    torch.manual_seed(7)
    action, _, value = policy(obs)
    torch.manual_seed(7)
    with torch.no_grad():
        logits, expected_value = agent(obs)
    torch.testing.assert_close(value, expected_value, rtol=0, atol=0)
    assert torch.equal(action, inverse_cdf(logits, torch.rand(64, 1)))

    monkeypatch.setattr(lean, "Agent", gelu_agent)
    capsys.readouterr()
    assert main_in_process(lean, tmp_path=tmp_path, monkeypatch=monkeypatch) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "actor.1 (GELU)" in errors[0] and "Traceback" not in err and out.strip() == "", err


def categorical_drawing_from(rng):
    """torch's Categorical, with the draw the lean CPU policy makes: the inverse CDF of its
    probabilities at a float32 uniform from the numpy generator `rng`, one per row."""

    class Categorical(torch.distributions.Categorical):
        def sample(self, sample_shape=torch.Size()):
            uniforms = torch.from_numpy(rng.random((len(self.logits), 1), dtype=np.float32))
            return inverse_cdf(self.logits, uniforms)

    return Categorical


def test_same_random_draws_make_the_same_run(plain, lean, monkeypatch, tmp_path):
    """Given the same random numbers, the two scripts make the same run: the same envs and seeds
    (terminations and time-limit truncations on 2 envs), initial weights, actions, GAE,
    learning-rate annealing, minibatch order, losses and Adam steps, for 4 iterations of 4
    minibatch updates. So the scripts differ only in how they draw (inverse CDF on numpy's uniforms
    against torch.multinomial, torch.randperm against np.random.shuffle: the same distributions)
    and in float rounding (metrics rel 1e-5, weights rtol 1e-4, atol 1e-6)."""
    rng = np.random.default_rng(1)  # what the lean policy seeds with --seed 1
    monkeypatch.setattr(plain, "Categorical", categorical_drawing_from(rng))
    uniforms = lambda agent, obs: rng.random((len(obs), 1), dtype=np.float32)
    assert_ppo_same_draws_same_run(plain, lean, "CartPole-v1", uniforms, monkeypatch, tmp_path)


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_same_seed_same_run(path, workdir):
    (first, second), _ = same_seed_runs(path, workdir)
    assert first == second and first["updates"] == 16 and first["episodic_return"] is not None


# Budget: 100,000 env steps (CleanRL's defaults otherwise). The threshold (mean of the last 10
# episodes, out of a maximum of 500) held for both scripts on seeds 1, 2 and 3; the test runs seed 1.
LEARNING_STEPS, LEARNING_THRESHOLD = 100_000, 150.0


@pytest.mark.learning
@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
def test_learns_cartpole(path, workdir):
    extra = ["--compile"] if path == LEAN_PATH else []
    summary, _ = run_script(path, "--total-timesteps", LEARNING_STEPS, "--seed", "1", *extra, cwd=workdir, timeout=900)
    assert summary["episodic_return"] >= LEARNING_THRESHOLD, summary


@pytest.mark.parametrize("path", BOTH, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "bad_args, words",
    [
        (["--env-id", "Pendulum-v1"], ["Box", "discrete"]),
        (["--num-minibatches", "7"], ["--num-minibatches", "divide"]),
        (["--total-timesteps", "127"], ["--total-timesteps", "one batch", "128"]),
        (["--num-minibatches", "128"], ["--num-minibatches", "minibatches of 1", "--no-norm-adv"]),
    ],
    ids=["box-env", "minibatches", "below-one-batch", "minibatch-of-one"],
)
def test_bad_input_is_one_clear_line(path, bad_args, words, workdir):
    assert_bad_input(path, *TINY["ppo"], *bad_args, words=words, cwd=workdir)

"""PPO (continuous actions): compiled update against eager, GAE against the reference loop,
determinism, learning, and bad input."""

import copy

import pytest
import torch

from conftest import TINY, assert_one_line_error, load_script, run_script, scripts

PAIR = scripts("ppo_continuous_action*.py")
LEAN = scripts("ppo_continuous_action_torchcompile.py")[0]
N_OBS, N_ACT, BATCH, MINIBATCH = 11, 3, 256, 64


def random_batch(generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return (
        randn(BATCH, N_OBS),
        randn(BATCH, N_ACT),
        randn(BATCH) - 3.0,
        randn(BATCH),
        randn(BATCH),
        randn(BATCH),
    )


def make_updates(lean, args, compiled):
    """Two agents with equal parameters, each with its own update (eager, or compiled)."""
    torch.manual_seed(0)
    agents = [lean.Agent(N_OBS, N_ACT)]
    agents.append(copy.deepcopy(agents[0]))
    updates = []
    for agent, compile_it in zip(agents, compiled):
        update = lean.make_update(agent, torch.tensor(args.learning_rate), args)
        updates.append(torch.compile(update, fullgraph=True) if compile_it else update)
    return agents, updates


def assert_same_parameters(agent_a, agent_b, **tolerance):
    for (name, a), (_, b) in zip(agent_a.named_parameters(), agent_b.named_parameters()):
        torch.testing.assert_close(b, a, msg=name, **tolerance)


def test_compiled_update_matches_eager():
    """From the same parameters and the same minibatches, three compiled steps (gather, forward,
    backward, clipping, Adam) agree with three eager steps within float32 round-off.

    Tolerance: rtol 1e-4, atol 1e-5. Inductor reorders float32 reductions, which moves the
    results by ~1e-6; a wrong coefficient or a dropped term moves them by far more."""
    lean = load_script(LEAN)
    args = lean.Args()
    agents, updates = make_updates(lean, args, compiled=(False, True))
    initial = copy.deepcopy(agents[0])
    g = torch.Generator().manual_seed(1)
    batch = random_batch(g)
    for _ in range(3):
        idx = torch.randperm(BATCH, generator=g)[:MINIBATCH]
        eager_stats, compiled_stats = (update(*batch, idx) for update in updates)
        torch.testing.assert_close(compiled_stats, eager_stats, rtol=1e-4, atol=1e-5)
    assert_same_parameters(agents[0], agents[1], rtol=1e-4, atol=1e-5)
    assert not torch.equal(agents[0].actor_mean[0].weight, initial.actor_mean[0].weight)


def test_update_is_clip_grad_norm_then_adam():
    """The lean step's hand-fused optimizer is torch's: the same loss, `loss.backward()`,
    `nn.utils.clip_grad_norm_` and `optim.Adam(eps=1e-5)` give the same parameters.
    A small max_grad_norm makes the clipping bite."""
    lean = load_script(LEAN)
    args = lean.Args(max_grad_norm=0.05)
    agents, (update, _) = make_updates(lean, args, compiled=(False, False))
    reference = agents[1]
    optimizer = torch.optim.Adam(reference.parameters(), lr=args.learning_rate, eps=1e-5)
    g = torch.Generator().manual_seed(2)
    batch = random_batch(g)
    for _ in range(3):
        idx = torch.randperm(BATCH, generator=g)[:MINIBATCH]
        stats = update(*batch, idx)
        loss = reference_loss(lean, reference, args, [t[idx] for t in batch])
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
        optimizer.step()
        torch.testing.assert_close(stats[-1], norm)
        torch.testing.assert_close(stats[-2], loss.detach())
    assert norm > args.max_grad_norm
    assert_same_parameters(reference, agents[0], rtol=1e-5, atol=1e-7)


def reference_loss(lean, agent, args, minibatch):
    """PPO's loss as the plain script writes it, with torch.distributions.Normal."""
    obs, actions, logprobs, advantages, returns, values = minibatch
    action_mean = agent.actor_mean(obs)
    dist = torch.distributions.Normal(action_mean, agent.actor_logstd.expand_as(action_mean).exp())
    ratio = (dist.log_prob(actions).sum(1) - logprobs).exp()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    newvalue = agent.critic(obs).view(-1)
    v_clipped = values + (newvalue - values).clamp(-args.clip_coef, args.clip_coef)
    v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
    return pg_loss - args.ent_coef * dist.entropy().sum(1).mean() + args.vf_coef * v_loss


def reference_gae(rewards, values, dones, next_value, gamma, gae_lambda):
    """CleanRL's loop, element by element."""
    num_steps, num_envs = rewards.shape
    advantages = torch.zeros_like(rewards)
    for env in range(num_envs):
        lastgaelam = 0.0
        for t in reversed(range(num_steps)):
            nextvalue = next_value[env] if t == num_steps - 1 else values[t + 1, env]
            nonterminal = 1.0 - dones[t, env]
            delta = rewards[t, env] + gamma * nextvalue * nonterminal - values[t, env]
            lastgaelam = delta + gamma * gae_lambda * nonterminal * lastgaelam
            advantages[t, env] = lastgaelam
    return advantages


def test_gae_matches_reference_loop():
    lean = load_script(LEAN)
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(50, 3, generator=g), torch.randn(50, 3, generator=g)
    dones = (torch.rand(50, 3, generator=g) < 0.1).float()
    dones[-1, 0] = 1.0
    next_value = torch.randn(3, generator=g)
    advantages, returns = lean.make_gae(0.99, 0.95)(rewards, values, dones, next_value)
    expected = reference_gae(rewards, values, dones, next_value, 0.99, 0.95)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)
    # At a done step the advantage is the last reward minus the value: nothing flows back.
    torch.testing.assert_close(advantages[-1, 0], rewards[-1, 0] - values[-1, 0])


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_same_seed_same_summary(script, workdir):
    timing = {"wall_s", "sps", "warmup_s", "peak_rss_mb", "curve"}
    runs = [run_script(script, *TINY["ppo_continuous_action"], cwd=workdir)[0] for _ in range(2)]
    first, second = ({k: v for k, v in run.items() if k not in timing} for run in runs)
    assert first == second
    # The learning curve too, but for its wall-clock column.
    assert [(step, ret) for step, _, ret in runs[0]["curve"]] == [(step, ret) for step, _, ret in runs[1]["curve"]]
    assert runs[0]["curve"]


# Budget: 40 iterations of 1024 steps (40,960 env steps), about a minute per script on this
# 2-core CPU when it is otherwise idle. The threshold (mean of the last 10 episodes, out of a
# maximum of 1000) held for both scripts on every seed tried: 1, 2, 3. The test runs seed 1.
LEARNING_THRESHOLD = 500.0


@pytest.mark.learning
@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_learns_inverted_pendulum(script, workdir):
    extra = ["--compile"] if script == LEAN else []
    summary, _ = run_script(
        script, "--env-id", "InvertedPendulum-v5", "--total-timesteps", "40960", "--num-steps", "1024",
        "--seed", "1", *extra, cwd=workdir, timeout=900,
    )
    assert summary["episodic_return"] >= LEARNING_THRESHOLD, summary


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
@pytest.mark.parametrize(
    "bad_args, words",
    [
        (["--env-id", "NoSuchEnv-v9"], ["NoSuchEnv-v9", "--env-id"]),
        (["--env-id", "CartPole-v1"], ["Discrete", "continuous"]),
        (["--num-minibatches", "7"], ["--num-minibatches", "divide"]),
    ],
    ids=["unknown-env", "discrete-env", "minibatches"],
)
def test_bad_input_is_one_clear_line(script, bad_args, words, workdir):
    args = TINY["ppo_continuous_action"] + bad_args
    _, proc = run_script(script, *args, cwd=workdir, check=False)
    assert_one_line_error(proc, *words)


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_non_finite_loss_stops_with_one_line_and_keeps_last_good_weights(script, workdir):
    """A learning rate of 1e30 blows the first update up: the run stops with one line naming the
    step, after printing its summary and saving the weights from before that update."""
    summary, proc = run_script(script, *TINY["ppo_continuous_action"], "--learning-rate", "1e30", "--save-model", cwd=workdir, check=False)
    assert_one_line_error(proc, "non-finite", "at step")
    checkpoint = torch.load(workdir / summary["checkpoint"], map_location="cpu", weights_only=False)
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())

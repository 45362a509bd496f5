"""PPO on Atari (envpool): the compiled update against the eager one and against the plain
script's loss with torch's clipping and Adam, the masking of envpool's reset steps, GAE
against CleanRL's loop, the sampling of the lean policy, the whole-game returns over lives,
and the bad-input lines. No learning test: Breakout needs hours here (the
curve seen is in the README)."""

import copy
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from conftest import TINY, assert_one_line_error, load_script, run_script, run_without, scripts

PAIR = scripts("ppo_atari_envpool*.py")
LEAN = scripts("ppo_atari_envpool_torchcompile.py")[0]


@pytest.fixture(scope="module")
def lean():
    return load_script(LEAN)


def make_batch(n, n_act=4, seed=0):
    """A flat rollout batch as the lean script feeds its update; about 1 step in 8 is a reset
    step (valid 0)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        torch.randint(0, n_act, (n,), generator=g),
        -torch.rand(n, generator=g) - 1.0,
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        (torch.rand(n, generator=g) > 0.125).float(),
    )


def agent_and_update(module, args, source=None):
    """An agent (a copy of `source`'s parameters if given) and its own eager update."""
    agent = module.Agent(4)
    if source is not None:
        agent.load_state_dict(source.state_dict())
    return agent, module.make_update(agent, torch.tensor(args.learning_rate), args)


def assert_same_parameters(agent_a, agent_b, **tolerance):
    for (name, a), (_, b) in zip(agent_a.named_parameters(), agent_b.named_parameters()):
        torch.testing.assert_close(b, a, msg=name, **tolerance)


def test_compiled_update_matches_eager(lean):
    """Same parameters, same batch, same minibatches: the compiled step (fullgraph, on the
    channels-last frames the script stores on a CPU) agrees with the eager step on NCHW frames
    to float32 round-off. Tolerance: metrics rtol 1e-4 / atol 1e-5; parameters after two Adam
    steps atol 1e-6 (an Adam step moves each weight by up to lr = 2.5e-4, so a wrong update
    shows far above this)."""
    torch.manual_seed(0)
    args = lean.Args()
    batch = make_batch(64)
    eager_agent, eager = agent_and_update(lean, args)
    compiled_agent, compiled = agent_and_update(lean, args, eager_agent)
    compiled = torch.compile(compiled, fullgraph=True)
    initial = copy.deepcopy(eager_agent.state_dict())
    batch_cl = (batch[0].contiguous(memory_format=torch.channels_last),) + batch[1:]
    for idx in torch.randperm(64).split(32):
        torch.testing.assert_close(compiled(*batch_cl, idx), eager(*batch, idx), rtol=1e-4, atol=1e-5)
    assert_same_parameters(eager_agent, compiled_agent, rtol=1e-4, atol=1e-6)
    for name, p in eager_agent.named_parameters():
        assert not torch.equal(p, initial[name]), name


def reference_loss(agent, args, minibatch):
    """The plain script's loss: torch.distributions.Categorical, and every mean over the steps
    that are not reset steps (valid 1)."""
    obs, actions, logprobs, advantages, returns, values, valid = minibatch
    n = valid.sum()
    _, newlogprob, entropy, newvalue = agent_plain_forward(agent, obs, actions)
    ratio = (newlogprob - logprobs).exp()
    mean = (advantages * valid).sum() / n
    std = (((advantages - mean) ** 2 * valid).sum() / (n - 1)).sqrt()
    advantages = (advantages - mean) / (std + 1e-8)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
    v_clipped = values + (newvalue - values).clamp(-args.clip_coef, args.clip_coef)
    v = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2)
    loss = pg - args.ent_coef * entropy + args.vf_coef * v
    return (loss * valid).sum() / n


def agent_plain_forward(agent, obs, actions):
    hidden = agent.network(obs / 255.0)
    probs = torch.distributions.Categorical(logits=agent.actor(hidden))
    return actions, probs.log_prob(actions), probs.entropy(), agent.critic(hidden).view(-1)


def test_update_is_the_plain_loss_then_clip_grad_norm_then_adam(lean):
    """The lean step is the plain script's: its masked loss with Categorical, `loss.backward()`,
    `nn.utils.clip_grad_norm_` and `optim.Adam(eps=1e-5)` give the same parameters. A small
    max_grad_norm makes the clipping bite. Tolerance rtol 1e-4 (the two compute log-softmax and
    entropy with different float32 ops: the gradient norms differ by ~7e-6 relative), atol 1e-6
    on parameters that each Adam step moves by up to 2.5e-4."""
    torch.manual_seed(0)
    args = lean.Args(max_grad_norm=0.05)
    agent, update = agent_and_update(lean, args)
    reference = copy.deepcopy(agent)
    optimizer = torch.optim.Adam(reference.parameters(), lr=args.learning_rate, eps=1e-5)
    batch = make_batch(64, seed=2)
    for idx in torch.randperm(64).split(32):
        stats = update(*batch, idx)
        loss = reference_loss(reference, args, [t[idx] for t in batch])
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
        optimizer.step()
        torch.testing.assert_close(stats[lean.METRICS.index("grad_norm")], norm, rtol=1e-4, atol=0)
        torch.testing.assert_close(stats[lean.METRICS.index("loss")], loss.detach(), rtol=1e-4, atol=1e-6)
    assert norm > args.max_grad_norm
    assert_same_parameters(reference, agent, rtol=1e-4, atol=1e-6)


def test_reset_steps_are_left_out_of_the_update(lean):
    """A minibatch with reset steps (valid 0) makes the same step, with the same metrics, as
    the same minibatch with those steps dropped; and what a reset step holds changes nothing."""
    torch.manual_seed(0)
    args = lean.Args()
    init = lean.Agent(4)
    batch = make_batch(32, seed=1)
    valid = batch[-1].bool()
    assert 0 < valid.sum() < 32
    idx = torch.arange(32)

    def step(batch, idx):
        agent, update = agent_and_update(lean, args, init)
        return update(*batch, idx), agent

    masked, masked_agent = step(batch, idx)
    dropped, dropped_agent = step(batch[:-1] + (torch.ones(32),), idx[valid])
    garbage = [t.clone() for t in batch]
    for i in (2, 3, 4, 5):  # logprobs, advantages, returns, values
        garbage[i][~valid] = 1e3
    changed, changed_agent = step(tuple(garbage), idx)
    for metrics, agent in ((dropped, dropped_agent), (changed, changed_agent)):
        torch.testing.assert_close(metrics, masked, rtol=1e-4, atol=1e-6)
        assert_same_parameters(masked_agent, agent, rtol=1e-4, atol=1e-6)


def cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's loop verbatim: `dones[t]` is the done seen before acting at step t."""
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def test_gae_matches_cleanrl_loop_with_dones_mid_rollout(lean):
    g = torch.Generator().manual_seed(3)
    steps, envs = 32, 3
    rewards = torch.randn(steps, envs, generator=g)
    values = torch.randn(steps, envs, generator=g)
    dones = torch.zeros(steps, envs)
    dones[[5, 6, 17, 30], [0, 0, 1, 2]] = 1.0  # two in a row: a reset step right after a done
    next_value, next_done = torch.randn(envs, generator=g), torch.tensor([0.0, 1.0, 0.0])
    expected = cleanrl_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    # The lean script's convention: dones[t] says that the episode ended AT step t.
    shifted = torch.cat([dones[1:], next_done.unsqueeze(0)])
    got = lean.make_gae(0.99, 0.95)(rewards, values, shifted, next_value)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    # No bootstrap across a done: the step that ended an episode sees only its own reward.
    assert got[0][4, 0] == pytest.approx(rewards[4, 0] - values[4, 0])


def test_policy_samples_the_categorical_it_reports(lean):
    """The Gumbel-max sample follows softmax(logits), and its log-probability is Categorical's."""
    torch.manual_seed(0)
    agent = lean.Agent(4)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    with torch.no_grad():
        agent.actor.weight.zero_()
        agent.actor.bias.copy_(logits)
        policy = lean.make_policy(agent)
        obs = torch.zeros(500, 4, 84, 84, dtype=torch.uint8)
        actions, logprobs = zip(*[policy(obs)[:2] for _ in range(20)])
    actions, logprobs = torch.cat(actions), torch.cat(logprobs)
    expected = torch.distributions.Categorical(logits=logits)
    freq = torch.bincount(actions, minlength=4).float() / actions.numel()
    # 10,000 draws: the standard error of each frequency is below 0.005.
    torch.testing.assert_close(freq, expected.probs, atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log_prob(actions))


class ScriptedAtari(gym.vector.VectorEnv):
    """Replays a script of envpool-shaped steps: (reward, terminated, truncated, lives,
    info terminated) per env. Raw rewards are 10x the clipped ones, to tell them apart."""

    def __init__(self, script):
        self.script = script
        self.num_envs = len(script[0])
        self.single_observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.single_action_space = gym.spaces.Discrete(4)
        self.t = 0

    def reset(self, **kwargs):
        self.t = 0
        return np.zeros((self.num_envs, 4, 84, 84), np.uint8), {}

    def step(self, actions):
        rows = self.script[self.t]
        self.t += 1
        raw = np.array([r[0] for r in rows], dtype=np.float32)
        infos = {
            "reward": raw * 10,
            "lives": np.array([r[3] for r in rows], dtype=np.int32),
            "terminated": np.array([r[4] for r in rows], dtype=np.int32),
        }
        return (
            np.zeros((self.num_envs, 4, 84, 84), np.uint8),
            np.sign(raw),
            np.array([r[1] for r in rows]),
            np.array([r[2] for r in rows]),
            infos,
        )


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_returns_count_whole_games_over_lives(script):
    """Env 0 plays a 3-life game: lost lives end episodes (terminated) but not the game; the
    game's raw return over all lives is reported once, at the step where envpool says the game
    is over. Env 1 is cut by the step limit (truncated), which also ends its game."""
    module = load_script(script)
    #        (reward, terminated, truncated, lives, game over)
    steps = [
        [(1, False, False, 3, 0), (1, False, False, 5, 0)],
        [(0, True, False, 2, 0), (0, False, False, 5, 0)],  # env 0 loses a life
        [(0, False, False, 2, 0), (1, False, True, 5, 0)],  # env 0 reset step; env 1 truncated
        [(1, False, False, 2, 0), (0, False, False, 5, 0)],  # env 1 reset step (new game)
        [(0, True, False, 1, 0), (1, False, False, 5, 0)],
        [(0, False, False, 1, 0), (0, False, False, 5, 0)],
        [(1, True, False, 0, 1), (0, False, False, 5, 0)],  # env 0: last life lost, game over
        [(0, False, False, 3, 0), (0, False, False, 5, 0)],  # env 0 reset step (new game)
    ]
    envs = module.RecordEpisodeStatistics(ScriptedAtari(steps))
    envs.reset()
    reported = []
    for t in range(len(steps)):
        *_, infos = envs.step(np.zeros(2, dtype=np.int64))
        for i in np.flatnonzero(infos["_episode"]):
            reported.append((t, i, float(infos["episode"]["r"][i]), int(infos["episode"]["l"][i])))
    assert reported == [(2, 1, 20.0, 3), (6, 0, 30.0, 7)]


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_missing_envpool_is_one_line_naming_the_extra(script, workdir):
    proc = run_without("envpool", script, *TINY["ppo_atari_envpool"], cwd=workdir)
    assert_one_line_error(proc, "envpool", "pip install 'leanrl[atari]'")


@pytest.mark.parametrize("env_id", ["Breakoutt-v5", "ALE/Breakout-v5", "CartPole-v1"])
@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_unknown_atari_id_is_one_line(script, env_id, workdir):
    """A typo, gymnasium's ALE spelling, and an envpool id that is no Atari game."""
    _, proc = run_script(script, *TINY["ppo_atari_envpool"], "--env-id", env_id, cwd=workdir, check=False)
    assert_one_line_error(proc, env_id, "Breakout-v5")


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_minibatches_that_do_not_divide_are_one_line(script, workdir):
    _, proc = run_script(script, *TINY["ppo_atari_envpool"], "--num-minibatches", "3", cwd=workdir, check=False)
    assert_one_line_error(proc, "--num-minibatches 3", "32")


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_capture_video_records_env_0(script, workdir):
    """envpool has no gymnasium RecordVideo: the scripts render env 0 themselves. The tiny run
    ends mid-game, so the first game's video is written when the envs close."""
    pytest.importorskip("moviepy")
    summary, _ = run_script(script, *TINY["ppo_atari_envpool"], "--capture-video", cwd=workdir)
    videos = list(Path(workdir, "videos").rglob("*.mp4"))
    assert [v.name for v in videos] == ["rl-video-game-0.mp4"], videos
    assert videos[0].stat().st_size > 1000


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_non_finite_loss_stops_with_one_line_and_keeps_last_good_weights(script, workdir):
    """A learning rate of 1e30 blows the first update up: one line naming the step, after the
    summary and a checkpoint of the weights from before that update."""
    summary, proc = run_script(script, *TINY["ppo_atari_envpool"], "--learning-rate", "1e30", "--save-model", cwd=workdir, check=False)
    assert_one_line_error(proc, "non-finite", "at step")
    checkpoint = torch.load(workdir / summary["checkpoint"], map_location="cpu", weights_only=False)
    weights = [t for t in checkpoint["model"].values() if t.is_floating_point()]
    assert weights and all(torch.isfinite(t).all() for t in weights)

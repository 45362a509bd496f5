"""PPO on Atari (envpool): the update, GAE, sampling, whole games, --target-kl, a changed network, the envpool extra."""

import copy
import functools
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import (
    TINY,
    assert_one_line_error,
    atari_batch,
    load_script,
    pair,
    run_script,
    run_without,
    spy,
    stack_of_one,
    trained_checkpoints,
    unstacked,
)

import leanrl_utils

FAMILY = "ppo_atari_envpool"
PLAIN_PATH, LEAN_PATH = PAIR = pair(FAMILY)
TINY_ARGS = dict(env_id="Breakout-v5", num_envs=2, num_steps=16, total_timesteps=64, num_minibatches=2, update_epochs=2)


def make_batch(n, seed=0):
    """A rollout batch (`atari_batch`): old log-probabilities, advantages, returns and values."""
    logprobs, normal = (lambda n, g: -torch.rand(n, generator=g) - 1.0), (lambda n, g: torch.randn(n, generator=g))
    return atari_batch(n, seed, logprobs, normal, normal, normal)


def agent_and_update(lean, args, source=None, compiled=False):
    """An agent (`source`'s parameters if given), its lr tensor and update, Adam fused eager, unfused compiled."""
    agent = lean.Agent(4)
    if source is not None:
        agent.load_state_dict(source.state_dict())
    lr = torch.tensor(args.learning_rate)
    optimizer = leanrl_utils.optimizers.Adam(stack_of_one(agent), lr, eps=1e-5, fused=not compiled)
    return agent, lr, unstacked(lean.make_update(agent, optimizer, args))


def assert_same_parameters(agent_a, agent_b, **tolerance):
    torch.testing.assert_close(dict(agent_b.named_parameters()), dict(agent_a.named_parameters()), **tolerance)


def test_compiled_update_matches_eager(lean):
    """The compiled step (fullgraph, unfused Adam, channels-last frames) agrees with eager (fused, NCHW), lr annealed."""
    torch.manual_seed(0)
    args, batch = lean.Args(), make_batch(64)
    eager_agent, eager_lr, eager = agent_and_update(lean, args)
    compiled_agent, compiled_lr, compiled = agent_and_update(lean, args, eager_agent, compiled=True)
    compiled = torch.compile(compiled, fullgraph=True, options={"guard_filter_fn": leanrl_utils.speed.value_guards})
    initial = copy.deepcopy(eager_agent.state_dict())
    batch_cl = (batch[0].contiguous(memory_format=torch.channels_last),) + batch[1:]
    for k, idx in enumerate(torch.randperm(64).split(16)):
        eager_lr.fill_(args.learning_rate * (1 - k / 4)), compiled_lr.fill_(args.learning_rate * (1 - k / 4))
        torch.testing.assert_close(compiled(*batch_cl, idx), eager(*batch, idx), rtol=1e-4, atol=1e-5)
    assert_same_parameters(eager_agent, compiled_agent, rtol=1e-4, atol=1e-6)
    assert all(not torch.equal(p, initial[name]) for name, p in eager_agent.named_parameters())


def test_lean_update_is_the_plain_update(plain, lean):
    """The lean step against ppo_atari_envpool.py's masked step written out, lr annealed, clipping biting (rtol 1e-4)."""
    torch.manual_seed(0)
    args = lean.Args(max_grad_norm=0.05)
    agent, lr, update = agent_and_update(lean, args)
    reference = plain.Agent(4)
    reference.load_state_dict(agent.state_dict())
    optimizer, batch = torch.optim.Adam(reference.parameters(), lr=args.learning_rate, eps=1e-5), make_batch(64, seed=2)
    b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values, b_valid = batch
    for k, mb_inds in enumerate(torch.randperm(64).split(16)):
        lr.fill_(args.learning_rate * (1 - k / 4))
        optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - k / 4)
        metrics, mb_valid = update(*batch, mb_inds), b_valid[mb_inds]
        n_valid = mb_valid.sum().clamp(min=1)
        _, newlogprob, entropy, newvalue = reference.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
        logratio = newlogprob - b_logprobs[mb_inds]
        ratio = logratio.exp()
        with torch.no_grad():
            old_approx_kl = (-logratio * mb_valid).sum() / n_valid
            approx_kl = (((ratio - 1) - logratio) * mb_valid).sum() / n_valid
            clipfrac = (((ratio - 1.0).abs() > args.clip_coef).float() * mb_valid).sum() / n_valid
        mb_advantages = b_advantages[mb_inds]
        adv_mean = (mb_advantages * mb_valid).sum() / n_valid
        adv_std = (((mb_advantages - adv_mean) ** 2 * mb_valid).sum() / (n_valid - 1).clamp(min=1)).sqrt()
        mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)
        clipped = -mb_advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss, newvalue = (torch.max(-mb_advantages * ratio, clipped) * mb_valid).sum() / n_valid, newvalue.view(-1)
        v_clipped = b_values[mb_inds] + (newvalue - b_values[mb_inds]).clamp(-args.clip_coef, args.clip_coef)
        v_loss_max = torch.max((newvalue - b_returns[mb_inds]) ** 2, (v_clipped - b_returns[mb_inds]) ** 2)
        v_loss, entropy_loss = 0.5 * (v_loss_max * mb_valid).sum() / n_valid, (entropy * mb_valid).sum() / n_valid
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
        optimizer.step()
        expected = torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()
        torch.testing.assert_close(metrics, expected, rtol=1e-4, atol=1e-6)
        assert norm > args.max_grad_norm
    assert_same_parameters(reference, agent, rtol=1e-4, atol=1e-6)


def test_reset_steps_are_left_out_of_the_update(lean):
    """A minibatch with reset steps (valid 0) steps as it does without them, whatever they hold."""
    torch.manual_seed(0)
    args, init = lean.Args(), lean.Agent(4)
    batch = make_batch(32, seed=1)
    valid = batch[-1].bool()
    assert 0 < valid.sum() < 32
    idx = torch.arange(32)

    def step(batch, idx):
        agent, _, update = agent_and_update(lean, args, init)
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


def test_explained_variance_is_the_plain_scripts(lean):
    """The masked explained variance is the plain script's numpy lines on the valid steps; NaN for constant returns."""
    g = torch.Generator().manual_seed(4)
    values, returns = torch.randn(256, generator=g), torch.randn(256, generator=g)
    valid = (torch.rand(256, generator=g) > 0.2).float()
    keep = valid.bool()
    y_pred, y_true = values[keep].numpy(), returns[keep].numpy()
    expected = 1 - np.var(y_true - y_pred) / np.var(y_true)
    assert lean.explained_variance(values, returns, valid).item() == pytest.approx(expected, rel=1e-5)
    assert lean.explained_variance(values, torch.ones(256), valid).isnan()


def cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's loop verbatim: `dones[t]` is the done seen before acting at step t."""
    num_steps = rewards.shape[0]
    advantages, lastgaelam = torch.zeros_like(rewards), 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def test_gae_matches_cleanrl_loop_with_dones_mid_rollout(lean):
    g, steps, envs = torch.Generator().manual_seed(3), 32, 3
    rewards, values = torch.randn(steps, envs, generator=g), torch.randn(steps, envs, generator=g)
    dones = torch.zeros(steps, envs)
    dones[[5, 6, 17, 30], [0, 0, 1, 2]] = 1.0  # two in a row: a reset step right after a done
    next_value, next_done = torch.randn(envs, generator=g), torch.tensor([0.0, 1.0, 0.0])
    expected = cleanrl_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    # The lean script's convention: dones[t] says that the episode ended AT step t.
    shifted = torch.cat([dones[1:], next_done.unsqueeze(0)])
    got = lean.make_gae(0.99, 0.95)(rewards, values, shifted, next_value)
    torch.testing.assert_close(got, expected)
    # No bootstrap across a done: the step that ended an episode sees only its own reward.
    assert got[0][4, 0] == pytest.approx(rewards[4, 0] - values[4, 0])


def test_policy_samples_the_categorical_it_reports(lean):
    """The Gumbel-max sample follows softmax(logits), and its log-probability is Categorical's."""
    torch.manual_seed(0)
    agent, logits = lean.Agent(4), torch.tensor([1.0, 0.0, -1.0, 2.0])
    with torch.no_grad():
        agent.actor.weight.zero_()
        agent.actor.bias.copy_(logits)
        policy = lean.make_policy(agent, dict(leanrl_utils.seeds.stack([agent]).items()), 1)
        obs = torch.zeros(500, 4, 84, 84, dtype=torch.uint8)
        actions, logprobs = zip(*[policy(obs)[:2] for _ in range(20)])
    actions, logprobs = torch.cat(actions), torch.cat(logprobs)
    expected = torch.distributions.Categorical(logits=logits)
    freq = torch.bincount(actions, minlength=4).float() / actions.numel()
    # 10,000 draws: the standard error of each frequency is below 0.005.
    torch.testing.assert_close(freq, expected.probs, atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log_prob(actions))


def other_agent(lean):
    """Agent changed: other convolution widths, Tanh, an extra Linear layer, heads of another width."""

    class OtherAgent(lean.Agent):
        def __init__(self, n_act, device=None):
            super().__init__(n_act, device)
            self.network = nn.Sequential(
                nn.Conv2d(4, 16, 8, stride=4, device=device), nn.Tanh(), nn.Conv2d(16, 32, 4, stride=2, device=device),
                nn.Tanh(), nn.Flatten(), nn.Linear(32 * 9 * 9, 256, device=device), nn.Tanh(),
                nn.Linear(256, 128, device=device), nn.ReLU(),
            )  # fmt: skip
            self.actor = nn.Linear(128, n_act, device=device)
            self.critic = nn.Linear(128, 1, device=device)

    return OtherAgent


@pytest.mark.parametrize("num_seeds", [1, 3])
def test_a_changed_network_acts_as_the_module_does(lean, monkeypatch, num_seeds):
    """A changed Agent's policy gives each seed's value, action and log-probability (one seed: exact)."""
    monkeypatch.setattr(lean, "Agent", other_agent(lean))
    torch.manual_seed(0)
    agents = [lean.Agent(4) for _ in range(num_seeds)]
    policy = lean.make_policy(lean.Agent(4, device="meta"), dict(leanrl_utils.seeds.stack(agents).items()), num_seeds)
    obs = torch.randint(0, 256, (num_seeds * 5, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        torch.manual_seed(1)
        action, logprob, value = policy(obs)
        blocks = obs.view(num_seeds, 5, 4, 84, 84)
        logits, expected_value = (torch.cat(x) for x in zip(*(agent(block) for agent, block in zip(agents, blocks))))
        torch.manual_seed(1)
        expected_action = (logits - (-torch.rand_like(logits).log()).log()).argmax(1)
    expected_logprob = logits.log_softmax(1).gather(1, expected_action[:, None]).squeeze(1)
    assert torch.equal(action, expected_action)
    if num_seeds == 1:
        assert torch.equal(value, expected_value) and torch.equal(logprob, expected_logprob)
    torch.testing.assert_close((value, logprob), (expected_value, expected_logprob))


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_a_changed_network_trains_each_seed_on_its_own(lean, monkeypatch, tmp_path, capsys, num_seeds):
    """A changed Agent's update takes each seed's own step; a --num-seeds run saves each agent."""
    monkeypatch.setattr(lean, "Agent", other_agent(lean))
    torch.manual_seed(0)
    args, agents = lean.Args(max_grad_norm=0.05), [lean.Agent(4) for _ in range(num_seeds)]
    singles, stacked_agents = [agent_and_update(lean, args, agent) for agent in agents], copy.deepcopy(agents)
    params = leanrl_utils.seeds.stack(stacked_agents)
    optimizer = leanrl_utils.optimizers.Adam(params.items(), torch.tensor(args.learning_rate), eps=1e-5, fused=True)
    stacked = lean.make_update(stacked_agents[0], optimizer, args, 1, num_seeds)
    batches = [make_batch(32, seed=k) for k in range(num_seeds)]
    idx = torch.stack([torch.randperm(32)[:16] for _ in range(num_seeds)])
    metrics = stacked(*(torch.stack(x) for x in zip(*batches)), idx)
    assert metrics.shape == (num_seeds, len(lean.METRICS))
    exact = {"rtol": 0, "atol": 0} if num_seeds == 1 else {"rtol": 1e-5, "atol": 1e-6}
    for k, (agent, _, update) in enumerate(singles):
        torch.testing.assert_close(metrics[k], update(*batches[k], idx[k]), **exact)
        assert_same_parameters(agent, stacked_agents[k], **exact)
        assert not torch.equal(agent.network[0].weight, agents[k].network[0].weight)  # the step moved it
    options = dict(tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    _, saved = trained_checkpoints(lean, "--num-seeds", num_seeds, **options)
    assert len(saved) == num_seeds and all(s["agent"]["network.7.weight"].shape == (128, 256) for s in saved)


class ScriptedAtari(gym.vector.VectorEnv):
    """Replays envpool-shaped steps: (reward, terminated, truncated, lives, game over) per env; raw rewards 10x."""

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
        column = lambda i, dtype=None: np.array([r[i] for r in rows], dtype=dtype)
        infos = {"reward": raw * 10, "lives": column(3, np.int32), "terminated": column(4, np.int32)}
        return np.zeros((self.num_envs, 4, 84, 84), np.uint8), np.sign(raw), column(1), column(2), infos


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_returns_count_whole_games_over_lives(script):
    """Lost lives end episodes, not the game: a game's raw return is charted once, at its end."""
    assert load_script(script).vector.envpool_envs is leanrl_utils.vector.envpool_envs
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
    envs, charted = leanrl_utils.vector.RecordEpisodeStatistics(ScriptedAtari(steps)), []
    run = types.SimpleNamespace(returns=[], points=charted)
    run.record = functools.partial(leanrl_utils.Run.record, run)
    envs.reset()
    for t in range(len(steps)):
        *_, infos = envs.step(np.zeros(2, dtype=np.int64))
        leanrl_utils.Run.episodes(run, t, infos)
    point = lambda step, ret, length: (step, {"charts/episodic_return": ret, "charts/episodic_length": length})
    assert charted == [point(2, 20.0, 3), point(6, 30.0, 7)]


# Log-ratios per minibatch: the last minibatch's approx_kl stops after 4 then 2 updates (the mean: 2 + 2).
LOGRATIOS, TARGET_KL = [0.3, 0.045, 0.045, 0.2, 0.045, 0.17], 0.01


def approx_kl(c):
    c = torch.tensor(c)
    return ((c.exp() - 1) - c).item()


def test_target_kl_stops_both_scripts_at_the_same_epoch(plain, lean, monkeypatch, tmp_path, capsys):
    """Fed the same approx_kl, both scripts stop after the epoch whose last minibatch's exceeds it."""
    monkeypatch.chdir(tmp_path)
    args = dict(TINY_ARGS, update_epochs=4, target_kl=TARGET_KL)
    expected = [(4, approx_kl(0.2)), (6, approx_kl(0.17))]  # (updates, logged approx_kl) per iteration
    # plain: the rollout's log-probabilities are 0, each minibatch's new ones the scripted ratio; lean: the same approx_kl
    feed, lean_feed = iter(LOGRATIOS + [0.0] * 16), iter(LOGRATIOS + [0.0] * 16)
    get_action_and_value = plain.Agent.get_action_and_value

    def scripted(self, x, action=None):
        out_action, logprob, entropy, value = get_action_and_value(self, x, action)
        logprob = torch.zeros_like(logprob) if action is None else logprob * 0 + next(feed)
        return out_action, logprob, entropy, value

    monkeypatch.setattr(plain.Agent, "get_action_and_value", scripted)

    def scripted_make_update(agent, optimizer, args, *rest):
        def update(*batch):
            metrics = torch.zeros(1, len(lean.METRICS))  # one seed's
            metrics[0, lean.METRICS.index("losses/approx_kl")] = approx_kl(next(lean_feed))
            return metrics

        return update

    monkeypatch.setattr(lean, "make_update", scripted_make_update)
    for module in (plain, lean):  # Run.log, shared by both scripts, patched anew for each
        with monkeypatch.context() as patch:
            logged = spy(patch, leanrl_utils.Run, "log", lambda out, self, step, updates, metrics, nets: (
                updates, metrics["losses/approx_kl"]))  # fmt: skip
            module.main(module.Args(**args))
        assert [u for u, _ in logged] == [u for u, _ in expected], module.__name__
        assert [kl for _, kl in logged] == pytest.approx([kl for _, kl in expected], rel=1e-5), module.__name__
    summaries = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(summaries) == 2 and all('"updates": 6' in s for s in summaries), summaries


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_missing_envpool_is_one_line_naming_the_extra(script, workdir):
    proc = run_without("envpool", script, *TINY["ppo_atari_envpool"], cwd=workdir)
    assert_one_line_error(proc, "envpool", "pip install 'leanrl[atari]'", code=2)


@pytest.mark.parametrize("script", PAIR, ids=lambda s: s.stem)
def test_capture_video_records_env_0(script, workdir):
    """envpool has no RecordVideo: the scripts render env 0; the tiny run ends mid-game, written as the envs close."""
    pytest.importorskip("moviepy")
    summary, _ = run_script(script, *TINY["ppo_atari_envpool"], "--capture-video", cwd=workdir)
    videos = list(Path(workdir, "videos").rglob("*.mp4"))
    assert [v.name for v in videos] == ["rl-video-game-0.mp4"], videos
    assert videos[0].stat().st_size > 1000

"""PPO pair (continuous actions): normalization, the Gaussian policy, derived forms, checkpoints with statistics."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import TINY, pair, run_script, trained_checkpoints
from test_ppo_family import changed_agent, stacked_policy
from torch.func import functional_call

import leanrl_utils

FAMILY = "ppo_continuous_action"
BOTH = pair(FAMILY)


class ScriptedEnv(gym.Env):
    """Obs and rewards (some beyond the clips) and both kinds of episode end from the reset seed alone; keeps actions."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (5,), np.float64)
    action_space = gym.spaces.Box(-1.0, np.array([1.0, 0.5], dtype=np.float32), (2,), np.float32)
    SCALE, OFFSET = np.array([1.0, 0.01, 100.0, 3.0, 1e-3]), np.array([0.0, 5.0, -300.0, 1.0, 0.0])

    def __init__(self):
        self.actions = []

    def draw(self):
        return self.OFFSET + self.SCALE * self.np_random.standard_normal(5)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.draw(), {}

    def step(self, action):
        self.actions.append(np.array(action))
        end = self.np_random.random()
        reward = float(self.np_random.standard_normal() * 20.0 + 1.0)
        return self.draw(), reward, end < 0.07, 0.07 <= end < 0.12, {}


gym.register("LeanRLScripted-v0", entry_point=ScriptedEnv)


@pytest.mark.parametrize("num_envs", [1, 3])
def test_normalization_is_the_plain_wrappers(plain, lean, num_envs):
    """The lean `Normalization` gives the plain wrappers' obs, rewards, actions and statistics."""
    args = lean.Args(env_id="LeanRLScripted-v0", num_envs=num_envs)
    plain_envs, lean_envs = plain.make_envs(args, "plain", num_envs), lean.make_envs(args, "lean", num_envs)
    norm = lean.Normalization(num_envs, 5, lean_envs.single_action_space, args.gamma, torch.device("cpu"))
    expected, _ = plain_envs.reset(seed=3)
    raw, _ = lean_envs.reset(seed=3)
    torch.testing.assert_close(norm.obs(torch.as_tensor(raw)), torch.as_tensor(expected), rtol=1e-6, atol=1e-6)
    g, ends, clipped = torch.Generator().manual_seed(0), 0, 0
    for step in range(400):
        action = 2.0 * torch.randn(num_envs, 2, generator=g)
        expected, expected_reward, terminations, truncations, _ = plain_envs.step(action.numpy())
        raw, reward, lean_terminations, lean_truncations, infos = lean_envs.step(norm.action(action.numpy()))
        assert (terminations == lean_terminations).all() and (truncations == lean_truncations).all()
        done = np.logical_or(terminations, truncations)
        if done.any():
            rows = np.flatnonzero(done)
            norm.final_obs(infos["final_obs"], rows)
            ends += len(rows)
        got_reward = torch.as_tensor(norm.reward(reward, terminations))
        torch.testing.assert_close(norm.obs(torch.as_tensor(raw)), torch.as_tensor(expected), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_reward, torch.as_tensor(expected_reward), rtol=1e-6, atol=1e-6)
        clipped += int((np.abs(expected) == 10.0).sum() + (np.abs(expected_reward) == 10.0).sum())
    assert ends > 10 * num_envs and clipped > 0  # the data reached the resets and the clips
    for plain_env, lean_env in zip(plain_envs.envs, lean_envs.envs):
        np.testing.assert_array_equal(np.stack(lean_env.unwrapped.actions), np.stack(plain_env.unwrapped.actions))
    state = norm.state_dict()
    for i, env in enumerate(plain_envs.envs):
        while not isinstance(env, gym.wrappers.NormalizeObservation):
            if isinstance(env, gym.wrappers.NormalizeReward):
                expected = torch.tensor(env.return_rms.var, dtype=torch.float64).reshape(())
                torch.testing.assert_close(torch.as_tensor(norm.ret_var[i]), expected, rtol=1e-12, atol=0)
            env = env.env
        torch.testing.assert_close(state["mean"][i], torch.as_tensor(env.obs_rms.mean), rtol=1e-12, atol=0)
        torch.testing.assert_close(state["var"][i], torch.as_tensor(env.obs_rms.var), rtol=1e-8, atol=0)
        assert state["count"][i].item() == pytest.approx(env.obs_rms.count, rel=1e-12)
    plain_envs.close(), lean_envs.close()


def test_normalization_loads_fewer_envs_and_freezes(lean):
    """A checkpoint of 2 envs gives its last env's statistics to envs 3 and 4; evaluation freezes them."""
    space, g = ScriptedEnv.action_space, torch.Generator().manual_seed(0)
    source = lean.Normalization(2, 5, space, 0.99, torch.device("cpu"))
    for _ in range(5):
        source.obs(torch.randn(2, 5, generator=g, dtype=torch.float64) * 3 + 1)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    target = lean.Normalization(4, 5, space, 0.99, torch.device("cpu"))
    target.load_state_dict(state)
    target.training = False
    torch.testing.assert_close(target.state_dict(), {k: v[[0, 1, 1, 1]] for k, v in state.items()}, rtol=0, atol=0)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    expected = ((x - state["mean"][[0, 1, 1, 1]]) / (state["var"][[0, 1, 1, 1]] + 1e-8).sqrt()).clamp(-10, 10).float()
    torch.testing.assert_close(target.obs(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(target.state_dict()["count"], state["count"][[0, 1, 1, 1]], rtol=0, atol=0)


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_policy_acts_from_the_agent_and_sees_every_update(lean, host):
    """Both policies give the critic's values and Gaussian actions with their log-probabilities."""
    torch.manual_seed(0)
    agent = lean.Agent(5, 3)
    agent.actor_logstd.data.fill_(-0.5)
    params = dict(leanrl_utils.seeds.stack([agent]).items())  # one seed: a stack of one, as in main
    policy, obs = lean.make_policy(agent, params, 1, host, seed=1), torch.randn(4096, 5)
    for _ in range(2):
        action, logprob, value = policy(obs)
        with torch.no_grad():
            mean, logstd, expected_value = agent(obs)
            expected_logprob = torch.distributions.Normal(mean, logstd.exp()).log_prob(action).sum(1)
        torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logprob, expected_logprob, rtol=1e-4, atol=1e-4)
        noise = (action - mean) / logstd.exp()  # 12,288 draws: the sample mean's sd is 0.009
        assert abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05
        with torch.no_grad():
            for p in agent.parameters():
                p.mul_(1.5).add_(0.1)
    assert action.shape == (4096, 3) and logprob.shape == value.shape == (4096,)


def module_acting(agents, obs):
    """Each seed's module on its block of `obs`: means, log-stds and values, stacked [seeds, rows, ...]."""
    blocks = obs.view(len(agents), -1, obs.shape[-1])
    with torch.no_grad():
        return [torch.stack(x) for x in zip(*(agent(block) for agent, block in zip(agents, blocks)))]


@pytest.mark.parametrize("num_seeds", [1, 3], ids=["1seed", "3seeds"])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_changed_network_is_followed_by_every_derived_form(lean, host, num_seeds):
    """With Agent changed, both policies act as each seed's module (its noise replayed)."""
    torch.manual_seed(0)
    agents = [changed_agent(lean)(6, 2) for _ in range(num_seeds)]
    for k, agent in enumerate(agents):
        agent.actor_logstd.data.fill_(-0.5 * k)
    params, policy, rng, obs, exact = stacked_policy(lean, agents, host)
    for _ in range(2):
        torch.manual_seed(7)
        action, logprob, value = policy(obs)
        mean, logstd, expected_value = module_acting(agents, obs)
        torch.manual_seed(7)
        noise = torch.from_numpy(rng.standard_normal(mean.shape, dtype=np.float32)) if host else torch.randn(mean.shape)
        torch.testing.assert_close(value, expected_value.flatten(), **exact)
        torch.testing.assert_close(action, (mean + logstd.exp() * noise).flatten(0, 1), **exact)
        density = torch.distributions.Normal(mean, logstd.exp()).log_prob(action.view_as(mean)).sum(2)
        torch.testing.assert_close(logprob, density.flatten(), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            for p in params.values():
                p.mul_(1.1).add_(0.01)


def test_changed_network_acts_as_the_module_in_a_whole_run(lean, monkeypatch, tmp_path, capsys):
    """A 2-seed run with a changed Agent acts as each seed's module at its weights, and saves it."""
    make_policy, weights = lean.make_policy, []

    def checked_make_policy(agent, params, num_seeds, host, seed=0):
        policy = make_policy(agent, params, num_seeds, host, seed=seed)

        def checked(obs):
            action, logprob, value = policy(obs)
            blocks, actions = obs.view(num_seeds, -1, obs.shape[-1]), action.view(num_seeds, -1, action.shape[-1])
            rows = blocks.shape[1]
            with torch.no_grad():
                for k in range(num_seeds):
                    mean, logstd, expected_value = functional_call(agent, {n: p[k] for n, p in params.items()}, (blocks[k],))
                    seed_rows = slice(k * rows, (k + 1) * rows)
                    torch.testing.assert_close(value[seed_rows], expected_value, rtol=1e-5, atol=1e-5)
                    density = torch.distributions.Normal(mean, logstd.exp()).log_prob(actions[k]).sum(1)
                    torch.testing.assert_close(logprob[seed_rows], density, rtol=1e-4, atol=1e-4)
            weights.append(float(params["critic.0.weight"].sum()))  # changes with every iteration's updates
            return action, logprob, value

        return checked

    monkeypatch.setattr(lean, "Agent", changed_agent(lean))
    monkeypatch.setattr(lean, "make_policy", checked_make_policy)
    _, saved = trained_checkpoints(lean, "--num-seeds", 2, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    # TINY: 4 iterations of 64 steps and a bootstrap call, the weights new in each.
    assert len(weights) == 4 * 65 and len(set(weights)) == 4, (len(weights), len(set(weights)))
    assert len(saved) == 2 and all(m["agent"]["actor_mean.6.weight"].shape == (1, 16) for m in saved)
    assert all(m["agent"]["critic.2.weight"].shape == (48, 32) for m in saved)


def test_checkpoints_carry_observation_statistics_across_the_pair(workdir):
    """Checkpoints hold agent and statistics; either script evaluates either alike."""
    saved, evaluate = {}, [*TINY[FAMILY], "--total-timesteps", "0", "--eval-episodes", "2"]
    for path in BOTH:
        summary, _ = run_script(path, *TINY[FAMILY], "--save-model", cwd=workdir)
        checkpoint = torch.load(workdir / summary["checkpoint"], map_location="cpu", weights_only=True)
        assert set(checkpoint["model"]) == {"agent", "obs_rms"}
        rms = checkpoint["model"]["obs_rms"]
        assert rms["mean"].shape == rms["var"].shape == (1, 4) and rms["count"].item() > 256 and rms["mean"].abs().sum() > 0
        saved[path] = summary["checkpoint"]
    for checkpoint in saved.values():
        returns = [run_script(path, *evaluate, "--load-model", checkpoint, cwd=workdir)[0]["eval_return"] for path in BOTH]
        assert returns[0] == returns[1] is not None

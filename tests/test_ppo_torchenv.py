"""PPO pair on torch-native envs: scan GAE, the rollout, compiled against eager, same draws same run, seeds."""

import pytest
import torch
from conftest import TINY, assert_same_run, final_weights, pair, recorded_runs, run_script, scalars, spy
from test_ppo_family import inverse_cdf, reference_gae

import leanrl_envs
import leanrl_utils

FAMILY = "ppo_torchenv"  # conftest's `plain` and `lean` fixtures
PLAIN_PATH, LEAN_PATH = BOTH = pair(FAMILY)


@pytest.mark.parametrize("num_steps", [1, 2, 5, 64, 100])
def test_scan_gae_is_the_loop(lean, num_steps):
    """Steps that are and are not powers of two, [steps, seeds, envs] (rtol 1e-5: another summation order)."""
    g = torch.Generator().manual_seed(num_steps)
    rewards, values = torch.randn(num_steps, 2, 3, generator=g), torch.randn(num_steps, 2, 3, generator=g)
    dones = (torch.rand(num_steps, 2, 3, generator=g) < 0.1).float()
    dones[-1, 0, 0] = 1.0
    next_value = torch.randn(2, 3, generator=g)
    advantages, returns = lean.make_gae(0.99, 0.95)(rewards, values, dones, next_value)
    flat = [x.flatten(1) for x in (rewards, values, dones)]
    expected = reference_gae(*flat, next_value.flatten(), 0.99, 0.95).view_as(rewards)
    torch.testing.assert_close((advantages, returns), (expected, expected + values), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(advantages[-1, 0, 0], rewards[-1, 0, 0] - values[-1, 0, 0])


def rollout_case(lean, num_seeds, steps, env_id="CartPole-v1", num_envs=64):
    """Agents, their rollout of `steps` steps, the first obs and state."""
    torch.manual_seed(0)
    env = leanrl_envs.make(env_id, num_envs)
    agents = [lean.Agent(env.obs_dim, env.num_actions) for _ in range(num_seeds)]
    for agent in agents:  # a policy far from uniform, so that draws show its softmax
        agent.actor[4].weight.data.normal_(0, 1.0)
    resets = [env.reset(seed=5 + k) for k in range(num_seeds)]
    state = leanrl_envs.State(*(torch.stack(field) for field in zip(*(s for s, _ in resets))))
    obs, params = torch.stack([o for _, o in resets]), dict(leanrl_utils.seeds.stack(agents).items())
    return agents, env, lean.make_rollout(agents[0], params, env, num_seeds, steps), obs, state


@pytest.mark.parametrize("num_seeds", [1, 3], ids=["1seed", "3seeds"])
def test_rollout_acts_by_each_seeds_softmax_and_steps_its_envs(lean, num_seeds, monkeypatch):
    """Each step: each seed's values, softmax draws at its counter uniforms, env steps."""
    monkeypatch.setattr(leanrl_envs.CartPole, "max_episode_steps", 30)
    agents, env, rollout, obs, state = rollout_case(lean, num_seeds, steps=8)
    exact = dict(rtol=0, atol=0) if num_seeds == 1 else dict(rtol=1e-5, atol=1e-5)
    ones, probability = torch.zeros(num_seeds), torch.zeros(num_seeds)
    with torch.no_grad():
        for _ in range(4):
            next_obs, next_state, rows = rollout(obs, state)
            for k, agent in enumerate(agents):
                seed_state = leanrl_envs.State(*(x[k] for x in state))
                for t in range(8):
                    b_obs, action, logprob, value, reward, done, ep_return, ep_length = (x[t, k] for x in rows)
                    logits, expected_value = agent(b_obs)
                    uniform = leanrl_envs.uniform(seed_state.key + lean.ACTIONS, seed_state.counter, len(b_obs), 1)
                    assert torch.equal(action, inverse_cdf(logits, uniform))
                    torch.testing.assert_close(logprob, logits.log_softmax(1).gather(1, action[:, None])[:, 0], **exact)
                    torch.testing.assert_close(value, expected_value, **exact)
                    ones[k] += action.sum()
                    probability[k] += logits.softmax(1)[:, 1].sum()
                    seed_state, out = env.step(seed_state, action)
                    assert torch.equal(reward, out.reward) and torch.equal(done, out.terminated | out.truncated)
                    assert torch.equal(ep_return, out.episode_return) and torch.equal(ep_length, out.episode_length)
                    torch.testing.assert_close(rows[0][t + 1, k] if t < 7 else next_obs[k], out.obs, rtol=0, atol=0)
            obs, state = next_obs, next_state
    assert rows[5].any()  # some episodes ended in the last rollout
    torch.testing.assert_close(ones / (32 * 64), probability / (32 * 64), rtol=0, atol=0.04)


def test_compiled_rollout_is_the_eager_one(lean):
    """fullgraph with --compile's options: actions and ends bit for bit, obs, state and values within rounding."""
    _, _, rollout, obs, state = rollout_case(lean, num_seeds=2, steps=2, env_id="Acrobot-v1", num_envs=8)
    options = {"guard_filter_fn": leanrl_utils.speed.value_guards, "cpp_wrapper": True, "cpp.use_decompose_tanh": True}
    compiled = torch.compile(rollout, fullgraph=True, options={**options, "realize_opcount_threshold": 4})
    eager_obs, eager_state, compiled_obs, compiled_state = obs, state, obs, state
    with torch.no_grad():
        for _ in range(3):
            eager_obs, eager_state, eager_rows = rollout(eager_obs, eager_state)
            compiled_obs, compiled_state, compiled_rows = compiled(compiled_obs, compiled_state)
            for i, (a, b) in enumerate(zip(eager_rows, compiled_rows)):
                exact = a.dtype in (torch.bool, torch.int64)
                torch.testing.assert_close(b, a, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, msg=f"row {i}")
            torch.testing.assert_close(compiled_state, eager_state, rtol=1e-12, atol=1e-12)


def counter_draws_for_the_plain_script(plain, lean, seed, update_epochs, batch_size, monkeypatch):
    """The plain script's actions and shuffles drawn the lean way, from counter-based uniforms."""
    actions_drawn, shuffles = [0], [0]

    class Categorical(torch.distributions.Categorical):
        def sample(self, sample_shape=torch.Size()):
            actions_drawn[0] += 1  # the env's counter at a step: 1 at the first
            uniform = leanrl_envs.uniform(torch.tensor(seed + lean.ACTIONS), actions_drawn[0], len(self.logits), 1)
            return inverse_cdf(self.logits, uniform)

    def shuffle(x):
        iteration, epoch = shuffles[0] // update_epochs + 1, shuffles[0] % update_epochs
        shuffles[0] += 1
        uniform = leanrl_envs.uniform(torch.tensor(seed + lean.ORDERS), iteration, update_epochs, batch_size)
        x[:] = uniform[epoch].argsort(stable=True).numpy()

    monkeypatch.setattr(plain, "Categorical", Categorical)
    monkeypatch.setattr(plain.np.random, "shuffle", shuffle)


def test_same_random_draws_make_the_same_run(plain, lean, monkeypatch, tmp_path):
    """On the same random numbers the two scripts make the same run, episodes and all."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(leanrl_envs.CartPole, "max_episode_steps", 20)
    args = dict(num_envs=2, num_steps=64, total_timesteps=512, num_minibatches=2, update_epochs=2)
    counter_draws_for_the_plain_script(plain, lean, 1, 2, 128, monkeypatch)
    episodes = spy(monkeypatch, leanrl_utils.Run, "record", lambda out, self, *point: point)
    plain_run, lean_run = recorded_runs([plain, lean], args, monkeypatch)
    assert len(lean_run[0]) == 4
    assert_same_run(plain_run, lean_run, [*lean.METRICS, "charts/learning_rate", "losses/explained_variance"])
    half = len(episodes) // 2
    assert episodes[:half] == episodes[half:] and any(n == 20 for _, _, n in episodes) and any(n < 20 for _, _, n in episodes)


def test_a_seed_of_a_stack_is_its_single_run(workdir):
    """--num-seeds 2 --seed 5: seed 6's logged values, curve and weights are a single run of seed 6's (rel 1e-4)."""
    (stacked := workdir / "stacked").mkdir()
    (single := workdir / "single").mkdir()
    tiny = [*TINY["ppo_torchenv"], "--save-model"]
    two, _ = run_script(LEAN_PATH, *tiny, "--num-seeds", 2, "--seed", 5, cwd=stacked)
    one, _ = run_script(LEAN_PATH, *tiny, "--seed", 6, cwd=single)
    seed_dir = next((stacked / "runs").glob("*__6__*"))
    expected, got = scalars(single / one["run_dir"]), scalars(seed_dir)
    assert [(tag, step) for tag, step, _ in got] == [(tag, step) for tag, step, _ in expected]
    assert [v for _, _, v in got] == pytest.approx([v for _, _, v in expected], rel=1e-4, abs=1e-5)
    assert two["episodic_returns"][1] == pytest.approx(one["episodic_return"])
    weights = torch.load(next(seed_dir.glob("*.pt")), weights_only=True)["model"]
    torch.testing.assert_close(weights["agent"], final_weights(single, one)["agent"], rtol=1e-4, atol=1e-5)

"""PQN pair on torch-native envs: returns, the update, stacked rollouts, whole runs, learning."""

import functools
import types

import pytest
import test_pqn
import torch
from conftest import TorchDrawingAsLean, assert_same_run, pair, recorded_runs, short_env, shuffle_as_lean, spy

import leanrl_envs
import leanrl_utils

FAMILY = "pqn_torchenv"  # conftest's `plain` and `lean` fixtures
PLAIN_PATH, LEAN_PATH = pair(FAMILY)
# gymnasium's CartPole with a 20-step limit (random play terminates and truncates), its torch-native twin the same id.
SHORT_ID = short_env("CartPole-v1", 20)
SHORT = type("ShortCartPole", (leanrl_envs.CartPole,), {"id": SHORT_ID, "max_episode_steps": 20})


@pytest.fixture
def short_env_too(monkeypatch):
    monkeypatch.setitem(leanrl_envs.ENVS, SHORT_ID, SHORT)


def test_returns_match_the_reference_loop(lean):
    """The returns of [steps, seeds, envs] rollouts, each env as test_pqn's reference loop (1e-5)."""
    rewards, values, next_value, dones = test_pqn.rollout_case(num_envs=6)
    views = rewards.view(16, 2, 3), values.view(16, 2, 3), next_value.view(2, 3), dones.view(16, 2, 3)
    got = lean.make_returns(0.99, 0.65)(*views)
    expected = test_pqn.reference_returns(*[x.double().numpy() for x in (rewards, values, next_value, dones)], 0.99, 0.65)
    torch.testing.assert_close(got.view(16, 6).double(), torch.from_numpy(expected), rtol=0, atol=1e-5)


def test_lean_update_is_the_plain_update(plain, lean):
    test_pqn.test_lean_update_is_the_plain_update(plain, lean)


def test_compiled_update_matches_eager(lean):
    test_pqn.test_compiled_update_matches_eager(lean)


@pytest.mark.parametrize("num_seeds", [1, 3])
def test_a_stack_of_seeds_rolls_out_as_each_seed_alone(lean, num_seeds):
    """Stacked seeds roll out as each seed's QNetwork and env alone."""
    env = leanrl_envs.make("CartPole-v1", 5)
    torch.manual_seed(0)
    nets = [lean.QNetwork(4, 2) for _ in range(num_seeds)]
    policy = lean.make_policy(nets[0], dict(leanrl_utils.seeds.stack(nets).items()))
    rollout = lean.make_rollout(policy, lean.make_env_step(env, num_seeds), 4)
    starts = [env.reset(seed=7 + k) for k in range(num_seeds)]
    state = leanrl_envs.State(*(torch.stack(x) for x in zip(*(s for s, _ in starts))))
    obs, alone = torch.stack([o for _, o in starts]), [list(s) for s in starts]
    exact = dict(rtol=0, atol=0)
    with torch.no_grad():
        for _ in range(3):
            explore, random_actions = torch.rand(4, num_seeds, 5) < 0.3, torch.randint(2, (4, num_seeds, 5))
            state, obs, rows = rollout(state, obs, explore, random_actions)
            for k, net in enumerate(nets):
                for t in range(4):
                    q_values = net(alone[k][1])
                    action = torch.where(explore[t, k], random_actions[t, k], q_values.argmax(dim=1))
                    alone[k][0], out = env.step(alone[k][0], action)
                    expected = [alone[k][1], action, q_values.max(dim=1).values, out.reward]
                    expected += [(out.terminated | out.truncated).float(), out.episode_return, out.episode_length.float()]
                    for name, got, want in zip(["obs", *lean.ROWS], rows, expected):
                        tolerance = {} if name == "values" and num_seeds > 1 else exact
                        torch.testing.assert_close(got[t, k], want, **tolerance, msg=name)
                    alone[k][1] = out.obs
                assert all(torch.equal(got[k], want) for got, want in zip(state, alone[k][0]))
                assert torch.equal(obs[k], alone[k][1])
    assert rows[4].any()  # episodes ended in the rollout


RUN = dict(env_id=SHORT_ID, num_envs=4, num_steps=32, total_timesteps=512, num_minibatches=4, update_epochs=2)
NAMES = ["losses/td_loss", "losses/q_values", "charts/learning_rate", "charts/epsilon"]


def test_same_random_draws_make_the_same_run(plain, lean, short_env_too, monkeypatch, tmp_path):
    """On the same random numbers the two scripts make the same run and record the same episodes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plain, "torch", TorchDrawingAsLean(RUN["num_steps"]))
    monkeypatch.setattr(plain.np.random, "shuffle", shuffle_as_lean)
    points = spy(monkeypatch, leanrl_utils.Run, "record", lambda out, self, *point: (self.script, point))
    plain_run, lean_run = recorded_runs([plain, lean], RUN, monkeypatch)
    assert_same_run(plain_run, lean_run, NAMES)
    ended, lean_ended = ([point for script, point in points if script == path.name] for path in (PLAIN_PATH, LEAN_PATH))
    assert lean_ended == ended and len(ended) > 20
    assert any(n == 20 for _, _, n in ended) and any(n < 20 for _, _, n in ended)  # truncations and terminations


def test_compiled_run_is_the_eager_run(lean, short_env_too, monkeypatch, tmp_path):
    """--compile --unroll 8 against eager --unroll 4: metrics within 1e-3, weights 1e-5."""
    monkeypatch.chdir(tmp_path)
    compiled = types.ModuleType("compiled")  # the script with --compile, as recorded_runs takes a module
    compiled.Args, compiled.main = functools.partial(lean.Args, compile=True, unroll=8), lean.main
    eager_run, compiled_run = recorded_runs([lean, compiled], RUN, monkeypatch)
    assert_same_run(eager_run, compiled_run, NAMES, metrics_abs=1e-3, weights_rtol=1e-4, weights_atol=1e-5)

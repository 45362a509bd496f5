"""What every pair has: the same run on the same draws, the epsilon schedules' end points, bad input in one line."""

import numpy as np
import pytest
import torch
from conftest import (
    NumpyDrawingAsLean,
    TorchDrawingAsLean,
    assert_same_run,
    build_plain_targets_too,
    is_lean,
    load_script,
    pair,
    recorded_runs,
    refused_in_process,
    short_env,
    shuffle_as_lean,
)
from test_ppo_family import continuous_draws, discrete_draws
from test_td3_continuous_action import ChangedActor, ChangedQNetwork


def numpy_as_lean(draw_steps=None, targets=None):
    """The plain script draws numpy numbers from torch's stream as the lean one (SAC, TD3: `targets` built too)."""

    def patch(plain, lean, monkeypatch):
        monkeypatch.setattr(plain, "np", NumpyDrawingAsLean(draw_steps))
        if targets:
            build_plain_targets_too(lean, monkeypatch, targets)

    return patch


def td3_changed(plain, lean, monkeypatch):
    """TD3 with both scripts' Actor and QNetwork changed: the lean script follows the modules."""
    for module in (plain, lean):
        monkeypatch.setattr(module, "Actor", ChangedActor)
        monkeypatch.setattr(module, "QNetwork", ChangedQNetwork)
    numpy_as_lean(targets=["QNetwork", "QNetwork", "Actor"])(plain, lean, monkeypatch)


def pqn_draws(num_steps):
    """Each rollout's epsilon-greedy draws (TorchDrawingAsLean) and the minibatch orders."""

    def patch(plain, lean, monkeypatch):
        monkeypatch.setattr(plain, "torch", TorchDrawingAsLean(num_steps))
        monkeypatch.setattr(plain.np.random, "shuffle", shuffle_as_lean)

    return patch


def ppo_draws(draws):
    """The gym PPO pairs: action draws (numpy generator of --seed 1), the unused bootstrap draw, minibatch orders."""

    def patch(plain, lean, monkeypatch):
        unused_draw = draws(plain, np.random.default_rng(1), monkeypatch)
        monkeypatch.setattr(plain.np.random, "shuffle", shuffle_as_lean)
        get_value = plain.Agent.get_value
        monkeypatch.setattr(plain.Agent, "get_value", lambda self, x: (unused_draw(self, x), get_value(self, x))[1])

    return patch


class GumbelCategorical(torch.distributions.Categorical):
    """Categorical whose sample is the lean Atari policy's Gumbel-max draw (one torch.rand_like over the logits)."""

    def sample(self, sample_shape=torch.Size()):
        return (self.logits - (-torch.rand_like(self.logits).log()).log()).argmax(-1)


def ppo_atari_draws(plain, lean, monkeypatch):
    """Atari PPO: Gumbel-max actions, the unused bootstrap noise, minibatch orders, channels-last frames in the update."""
    monkeypatch.setattr(plain, "Categorical", GumbelCategorical)
    monkeypatch.setattr(plain.np.random, "shuffle", shuffle_as_lean)
    get_value, get_action_and_value = plain.Agent.get_value, plain.Agent.get_action_and_value

    def get_value_drawing(self, x):
        torch.rand(len(x), self.actor.out_features)
        return get_value(self, x)

    def channels_last_update(self, x, action=None):
        if action is not None:  # the update's minibatch
            x = x.contiguous(memory_format=torch.channels_last)
        return get_action_and_value(self, x, action)

    monkeypatch.setattr(plain.Agent, "get_value", get_value_drawing)
    monkeypatch.setattr(plain.Agent, "get_action_and_value", channels_last_update)


ROLLOUTS = dict(num_envs=4, num_steps=64, total_timesteps=1024, num_minibatches=4, update_epochs=2)
GYM_PPO = dict(num_envs=2, num_steps=64, total_timesteps=512, num_minibatches=2, update_epochs=2)
OFF_POLICY = dict(learning_starts=64, batch_size=32, buffer_size=1000)
# Per case: family, Args, how plain draws as lean, log points, logged names besides METRICS, the weights' atol.
SAME_RUN = {
    # 2,000 steps, 300 updates: epsilon-greedy actions, stored transitions, minibatches, Adam, target copies
    "dqn": ("dqn", dict(total_timesteps=2000, learning_starts=500, train_frequency=5, target_network_frequency=100,
                        batch_size=32), numpy_as_lean(draw_steps=256), 20, ["charts/epsilon"], 1e-6),
    # 600 steps of 2 envs, a ring that wraps: stored frames, sampled stacks
    "dqn-atari": ("dqn_atari_envpool", dict(num_envs=2, total_timesteps=600, learning_starts=200, buffer_size=300,
                  batch_size=16, target_network_frequency=100), numpy_as_lean(draw_steps=256), 6, ["charts/epsilon"], 1e-5),
    # 4 iterations of 8 minibatch updates: Q(lambda) returns through truncations, RAdam
    "pqn": ("pqn", dict(ROLLOUTS, env_id=short_env("CartPole-v1", 20), num_steps=32, total_timesteps=512), pqn_draws(32), 4,
            ["charts/learning_rate", "charts/epsilon"], 1e-6),
    "pqn-atari": ("pqn_atari_envpool", dict(ROLLOUTS, env_id="Breakout-v5"), pqn_draws(64), 4,
                  ["charts/learning_rate", "charts/epsilon"], 1e-5),
    # 150 steps, 86 updates: 3 truncations, alpha tuning, delayed actor and Polyak updates
    "sac": ("sac_continuous_action", dict(OFF_POLICY, env_id=short_env("Pendulum-v1", 40), total_timesteps=150),
            numpy_as_lean(targets=["SoftQNetwork", "SoftQNetwork"]), 2, [], 1e-6),
    # 120 steps, 56 updates: exploration and smoothing noise, delayed actor and Polyak updates
    "td3": ("td3_continuous_action", dict(OFF_POLICY, env_id=short_env("Pendulum-v1", 40), total_timesteps=120),
            numpy_as_lean(targets=["QNetwork", "QNetwork", "Actor"]), 2, [], 1e-6),
    "td3-changed": ("td3_continuous_action", dict(OFF_POLICY, env_id=short_env("Pendulum-v1", 40), total_timesteps=120),
                    td3_changed, 2, [], 1e-6),
    # 4 iterations of 4 minibatch updates on 2 envs cut at 20 steps: (normalization,) GAE, lr annealing, Adam
    "ppo": ("ppo", dict(GYM_PPO, env_id=short_env("CartPole-v1", 20)), ppo_draws(discrete_draws), 4,
            ["charts/learning_rate", "losses/explained_variance"], 1e-6),
    "ppo-continuous": ("ppo_continuous_action", dict(GYM_PPO, env_id=short_env("InvertedPendulum-v5", 20)),
                       ppo_draws(continuous_draws), 4, ["charts/learning_rate", "losses/explained_variance"], 1e-6),
    # 4 iterations of 8 minibatch updates: envpool's reset steps, GAE, lr annealing, Adam
    "ppo-atari": ("ppo_atari_envpool", dict(ROLLOUTS, env_id="Breakout-v5"), ppo_atari_draws, 4,
                  ["charts/learning_rate", "losses/explained_variance"], 1e-6),
}  # fmt: skip


@pytest.mark.parametrize("case", SAME_RUN)
def test_same_random_draws_make_the_same_run(case, monkeypatch, tmp_path):
    """The plain script drawing as the lean one (eager) does: the same metrics at every log point and final weights."""
    family, args, draw_as_lean, log_points, names, weights_atol = SAME_RUN[case]
    plain, lean = (load_script(path) for path in pair(family))
    monkeypatch.chdir(tmp_path)
    draw_as_lean(plain, lean, monkeypatch)
    plain_run, lean_run = recorded_runs([plain, lean], args, monkeypatch)
    assert len(lean_run[0]) == log_points
    assert_same_run(plain_run, lean_run, [*lean.METRICS, *names], weights_atol=weights_atol)


# CleanRL's defaults, per family: epsilon from 1.0 to end_e over exploration_fraction of the budget, then flat.
SCHEDULES = {
    "dqn": {0: 1.0, 62_500: 0.7625, 125_000: 0.525, 250_000: 0.05, 400_000: 0.05, 500_000: 0.05},
    "pqn": {0: 1.0, 125_000: 0.525, 250_000: 0.05, 500_000: 0.05},
    "pqn_torchenv": {0: 1.0, 125_000: 0.525, 250_000: 0.05, 500_000: 0.05},
    "dqn_atari_envpool": {0: 1.0, 500_000: 0.505, 1_000_000: 0.01, 10_000_000: 0.01},
    "pqn_atari_envpool": {0: 1.0, 500_000: 0.505, 1_000_000: 0.01, 10_000_000: 0.01},
}


@pytest.mark.parametrize("family", SCHEDULES)
def test_epsilon_schedule_end_points_in_both_scripts(family):
    plain, lean = (load_script(path) for path in pair(family))
    fields = ("start_e", "end_e", "exploration_fraction", "total_timesteps")
    assert [getattr(plain.Args(), f) for f in fields] == [getattr(lean.Args(), f) for f in fields]
    args = plain.Args()
    duration = args.exploration_fraction * args.total_timesteps
    for t, value in SCHEDULES[family].items():
        a, b = (m.linear_schedule(args.start_e, args.end_e, duration, t) for m in (plain, lean))
        assert a == b == pytest.approx(value, abs=1e-12), (t, a, b)
    # No division by zero when there is no exploration phase.
    assert plain.linear_schedule(1.0, args.end_e, 0, 0) == lean.linear_schedule(1.0, args.end_e, 0, 0) == args.end_e


# Per "family/case": its argv and the words of its one line, at TINY's settings ("lean-": the lean script's only).
BAD_INPUT = {
    "dqn/continuous": (["--env-id", "Pendulum-v1"], ["Pendulum-v1", "discrete"]),
    "dqn/no-memory": (["--buffer-size", 10**13], ["--buffer-size 10000000000000", "GiB"]),
    "dqn_atari_envpool/no-memory": (["--buffer-size", 10**12], ["--buffer-size 1000000000000", "GiB"]),
    "dqn_atari_envpool/small-buffer": (["--buffer-size", "10", "--batch-size", "4"], ["--buffer-size 10", "16"]),
    "dqn_atari_envpool/learning-starts": (["--learning-starts", "1"], ["--learning-starts 1", "2"]),
    "dqn_atari_envpool/batch": (["--batch-size", "300"], ["--batch-size 300", "--buffer-size 200"]),
    "pqn/continuous": (["--env-id", "Pendulum-v1"], ["Pendulum-v1", "Box action space", "discrete"]),
    "pqn/minibatches": (["--num-minibatches", "3"], ["--num-minibatches 3", "128"]),
    "pqn/budget": (["--total-timesteps", "100"], ["--total-timesteps 100", "128"]),
    "pqn/lambda": (["--q-lambda", "1.5"], ["--q-lambda 1.5"]),
    "pqn_atari_envpool/minibatches": (["--num-minibatches", "3"], ["--num-minibatches 3", "32"]),
    "pqn_atari_envpool/budget": (["--total-timesteps", "20"], ["--total-timesteps 20", "32"]),
    "pqn_atari_envpool/lambda": (["--q-lambda", "-0.1"], ["--q-lambda -0.1"]),
    "sac_continuous_action/discrete-actions": (["--env-id", "CartPole-v1"], ["CartPole-v1", "Discrete", "continuous"]),
    "sac_continuous_action/batch-over-buffer": (["--batch-size", "512", "--buffer-size", "256"],
                                                ["--batch-size", "--buffer-size"]),
    "sac_continuous_action/envs-over-buffer": (["--num-envs", "4", "--buffer-size", "2", "--batch-size", "2"],
                                               ["--num-envs", "--buffer-size"]),
    "td3_continuous_action/discrete-actions": (["--env-id", "CartPole-v1"], ["CartPole-v1", "Discrete", "continuous"]),
    "td3_continuous_action/batch-over-buffer": (["--batch-size", "300", "--buffer-size", "200"],
                                                ["--batch-size 300", "--buffer-size 200"]),
    "td3_continuous_action/envs-over-buffer": (["--num-envs", "4", "--buffer-size", "2", "--batch-size", "2"],
                                               ["--num-envs 4", "--buffer-size 2"]),
    "ppo/box-env": (["--env-id", "Pendulum-v1"], ["Box", "discrete"]),
    "ppo/minibatches": (["--num-minibatches", "7"], ["--num-minibatches", "divide"]),
    "ppo/below-one-batch": (["--total-timesteps", "127"], ["--total-timesteps", "one batch", "128"]),
    "ppo/minibatch-of-one": (["--num-minibatches", "128"], ["--num-minibatches", "minibatches of 1", "--no-norm-adv"]),
    "ppo_continuous_action/discrete-env": (["--env-id", "CartPole-v1"], ["Discrete", "continuous"]),
    "ppo_continuous_action/minibatches": (["--num-minibatches", "7"], ["--num-minibatches", "divide"]),
    "ppo_continuous_action/below-one-batch": (["--total-timesteps", "63"], ["--total-timesteps", "one batch", "64"]),
    "ppo_continuous_action/minibatch-of-one": (["--num-minibatches", "64"],
                                               ["--num-minibatches", "minibatches of 1", "--no-norm-adv"]),
    "ppo_atari_envpool/minibatches": (["--num-minibatches", "3"], ["--num-minibatches 3", "32"]),
    "ppo_atari_envpool/below-one-batch": (["--total-timesteps", "16"], ["--total-timesteps 16", "32"]),
    "ppo_atari_envpool/minibatch-of-one": (["--num-minibatches", "32"], ["--num-minibatches 32", "--no-norm-adv"]),
    "ppo_atari_envpool/typo": (["--env-id", "Breakoutt-v5"], ["Breakoutt-v5", "Breakout-v5"]),
    "ppo_atari_envpool/ale-id": (["--env-id", "ALE/Breakout-v5"], ["ALE/Breakout-v5", "Breakout-v5"]),
    "pqn_torchenv/video": (["--capture-video"], ["--capture-video", "pqn.py"]),
    "pqn_torchenv/minibatches": (["--num-minibatches", "3"], ["--num-minibatches 3", "128"]),
    "pqn_torchenv/lean-unroll": (["--unroll", "24"], ["--unroll 24", "--num-steps 64", "e.g. 16"]),
    "ppo_torchenv/minibatches": (["--num-minibatches", "7"], ["--num-minibatches", "divide"]),
    "ppo_torchenv/lean-unroll": (["--unroll", "7"], ["--unroll 7", "--num-steps 64", "e.g. 4"]),
}  # fmt: skip


BAD_CASES = [(p, c) for c in BAD_INPUT for p in pair(c.split("/")[0]) if is_lean(p) or "/lean-" not in c]


@pytest.mark.parametrize("path, case", BAD_CASES, ids=lambda v: getattr(v, "stem", v))
def test_bad_input_is_one_line_before_any_work(path, case, monkeypatch, tmp_path, capsys):
    """Exit 2, one `error:` line naming the words, no traceback, nothing on stdout, no run folder."""
    module = load_script(path)
    argv, words = BAD_INPUT[case]
    line = refused_in_process(module, *argv, words=words, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert not (tmp_path / "runs").exists() and "--num-seeds" not in line  # a single run's line: no seeds' word

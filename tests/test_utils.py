"""leanrl_utils, tested once: SameStepEnvs, a module's derived forms and refusals, platforms without POSIX modules."""

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TINY, family, refused_call, run_script, scripts

import leanrl_utils

ALL = scripts("*.py")


@pytest.mark.parametrize("env_id", ["CartPole-v1", "InvertedPendulum-v5"])
def test_same_step_envs_step_as_gymnasium_does(env_id):
    """Through ends of both kinds, the arrays and statistics of gymnasium's SAME_STEP vector env."""
    thunk = lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(env_id, max_episode_steps=12))
    ours = leanrl_utils.vector.SameStepEnvs([thunk] * 3)
    theirs = gym.vector.SyncVectorEnv([thunk] * 3, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    assert all(np.array_equal(a, b) for a, b in zip(ours.reset(seed=5)[0], theirs.reset(seed=5)[0]))
    theirs.action_space.seed(5)
    ends = truncations = 0
    for t in range(600):
        actions = theirs.action_space.sample()
        mine, gyms = ours.step(actions), theirs.step(actions)
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(mine[:4], gyms[:4])), t
        assert ("final_obs" in mine[4]) == ("final_obs" in gyms[4]), t
        if "final_obs" in gyms[4]:
            done = gyms[4]["_final_obs"]
            assert np.array_equal(mine[4]["_final_obs"], done)
            assert all(np.array_equal(mine[4]["final_obs"][i], gyms[4]["final_obs"][i]) for i in np.flatnonzero(done))
            stats, expected = mine[4]["final_info"], gyms[4]["final_info"]
            assert np.array_equal(stats["_episode"], expected["_episode"])
            assert all(np.array_equal(stats["episode"][k][done], expected["episode"][k][done]) for k in ("r", "l"))
            ends += done.sum()
            truncations += gyms[3].sum()
    assert ends - truncations >= 10 and truncations >= 10, (ends, truncations)
    ours.close(), theirs.close()


NETWORKS = {
    "relu": lambda: nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)),
    "tanh, extra layer": lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3)),
    "layernorm": lambda: nn.Sequential(nn.Linear(5, 12), nn.LayerNorm(12), nn.ReLU(), nn.Linear(12, 3)),
    "every activation": lambda: nn.Sequential(nn.Linear(5, 8), nn.SiLU(), nn.Linear(8, 8), nn.ELU(), nn.Linear(8, 8),
                                              nn.LeakyReLU(0.1), nn.Linear(8, 8), nn.Sigmoid(), nn.Identity(),
                                              nn.Linear(8, 3)),
    "activation first": lambda: nn.Sequential(nn.ReLU(), nn.Linear(5, 3)),
    # Arithmetic, a function, a method and a sliced input in the forward: followed op by op.
    "edited forward": lambda: Edited(lambda y, x: torch.tanh(y).exp() * 2.0 - x[:, :3].flatten(1)),
}  # fmt: skip


def stacked(make, num_seeds):
    """num_seeds networks of one architecture, each its own weights (LayerNorm scales too), stacked."""
    nets = []
    for k in range(num_seeds):
        torch.manual_seed(k)
        net = make()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        nets.append(net)
    return nets, leanrl_utils.seeds.stack(nets)


@pytest.mark.parametrize("num_seeds", [1, 3])
@pytest.mark.parametrize("name", NETWORKS)
def test_derived_forms_act_as_the_module_does(name, num_seeds):
    """The stacked torch form and the numpy form give each seed's rows what its module gives, and see weight changes."""
    nets, params = stacked(NETWORKS[name], num_seeds)
    x, torch_form = torch.randn(num_seeds, 6, 5), leanrl_utils.seeds.forward(nets[0])
    numpy_form = leanrl_utils.acting.numpy_forward(nets[0], dict(params.items()))
    for _ in range(2):
        with torch.no_grad():
            expected = torch.stack([net(x[k]) for k, net in enumerate(nets)])
            torch.testing.assert_close(torch_form(dict(params.items()), x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(numpy_form(x.numpy().copy())), expected, rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # an optimizer step, in place on the stacked storage
            for p in params.values():
                p.mul_(1.5)


def test_numpy_form_leaves_the_callers_array_alone():
    nets, params = stacked(NETWORKS["activation first"], 1)
    x = np.random.default_rng(0).standard_normal((1, 4, 5)).astype(np.float32)
    before = x.copy()
    leanrl_utils.acting.numpy_forward(nets[0], dict(params.items()))(x)
    assert np.array_equal(x, before)


class Edited(nn.Module):
    """A forward that is more than its layers in order, as `op` (its output, input) has it."""

    def __init__(self, op):
        super().__init__()
        self.network, self.op = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)), op

    def forward(self, x):
        return self.op(self.network(x / 255.0), x)


UNFOLLOWED = {
    "gelu": (lambda: nn.Sequential(nn.Linear(5, 4), nn.GELU(), nn.Linear(4, 3)), ["layer 1", "GELU"]),
    "softplus": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Softplus(), nn.Linear(4, 3)), ["layer 1", "Softplus"]),
    "forward-op": (lambda: Edited(lambda y, x: y.softmax(-1)), ["softmax", "Edited.forward"]),
    "forward-branch": (lambda: Edited(lambda y, x: y if x.sum() > 0 else -y), ["trace", "Edited.forward"]),
}


@pytest.mark.parametrize("make, words", UNFOLLOWED.values(), ids=UNFOLLOWED)
def test_what_numpy_cannot_follow_is_refused_in_one_line(make, words, capsys):
    nets, params = stacked(make, 2)
    refused_call(capsys, leanrl_utils.acting.numpy_forward, nets[0], dict(params.items()), words=words)


def test_stack_of_one_runs_the_modules_own_ops():
    """One seed through the stacked torch form is bit for bit the module's forward."""
    nets, params = stacked(NETWORKS["layernorm"], 1)
    x = torch.randn(1, 32, 5)
    with torch.no_grad():
        assert torch.equal(leanrl_utils.seeds.forward(nets[0])(dict(params.items()), x)[0], nets[0](x[0]))


# psutil is imported first: on Linux it reads `resource` itself, which its Windows build does not.
NO_POSIX = "import psutil, sys, signal; sys.modules['resource'] = None; del signal.pthread_sigmask"


def test_every_script_imports_without_posix_only_modules(tmp_path):
    """Without `resource` and `signal.pthread_sigmask` (Windows) the package and every script still import."""
    imports = "; ".join(
        f"spec = importlib.util.spec_from_file_location({s.stem!r}, {str(s)!r}); "
        f"spec.loader.exec_module(importlib.util.module_from_spec(spec))"
        for s in ALL
    )
    code = f"{NO_POSIX}; import importlib.util, leanrl_utils; {imports}; print('imported', {len(ALL)})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"imported {len(ALL)}" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("script", [s for s in ALL if family(s) == "dqn"], ids=lambda s: s.stem)
def test_a_tiny_run_without_posix_only_modules(script, tmp_path):
    """A whole tiny run there: it trains, saves and prints its summary (peak memory from psutil)."""
    summary, _ = run_script(script, *TINY[family(script)], "--save-model", cwd=tmp_path, before=NO_POSIX)
    assert summary["updates"] > 0 and summary["checkpoint"] and summary["peak_rss_mb"] > 0


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(5 + 2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, a):
        return self.fc(torch.cat([x, a], 1))


def test_stacked_networks_on_shared_inputs():
    """Twin critics: each network of the stack on the same batch (`shared` inputs)."""
    nets = [Critic(), Critic()]
    params = leanrl_utils.seeds.stack(nets)
    x, a = torch.randn(6, 5), torch.randn(6, 2)
    got = leanrl_utils.seeds.forward(nets[0], shared=(0, 1))(dict(params.items()), x, a)
    with torch.no_grad():
        torch.testing.assert_close(got, torch.stack([net(x, a) for net in nets]), rtol=1e-5, atol=1e-6)

"""PPO pair (discrete actions): the policy's draws against the softmax, the networks' derived forms (also changed)."""

import numpy as np
import pytest
import torch
from conftest import refused_call
from test_ppo_family import changed_agent, inverse_cdf, stacked_policy

import leanrl_utils

FAMILY = "ppo"
N_OBS, N_ACT = 4, 3


def edited_forward(lean, op=torch.tanh):
    """A researcher's edit of Agent.forward: another activation (`op`) on the logits, scaled."""

    class EditedAgent(lean.Agent):
        def forward(self, obs):
            logits, value = super().forward(obs)
            return op(logits) * 3.0, value

    return EditedAgent


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_policy_samples_the_softmax_and_sees_every_update(lean, host):
    """Both policies give the critic's values and softmax draws with their log-probabilities."""
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
    """With Agent changed or its forward edited, both policies act as each seed's module."""
    torch.manual_seed(0)
    agents = [(changed_agent if edit == "layers" else edited_forward)(lean)(6, 4) for _ in range(num_seeds)]
    params, policy, rng, obs, exact = stacked_policy(lean, agents, host)
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
    """An edited forward calling what numpy acting has no form for (gelu) is refused in one line naming it."""
    agent = edited_forward(lean, torch.nn.functional.gelu)(4, 2)
    params, words = dict(leanrl_utils.seeds.stack([agent]).items()), ["gelu", "EditedAgent.forward"]
    refused_call(capsys, lean.make_policy, agent, params, 1, host=True, words=words)

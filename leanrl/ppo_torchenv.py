"""PPO for discrete actions on torch-native envs, plain PyTorch in the CleanRL style: the baseline.

CleanRL's `ppo.py` (Schulman et al., 2017, https://arxiv.org/abs/1707.06347, with the details of
Huang et al., "The 37 Implementation Details of PPO", 2022), line for line, with gymnasium's vector
env replaced by its torch-native twin from `leanrl_envs` (CartPole-v1, Acrobot-v1, MountainCar-v0:
gymnasium's physics as tensor ops, on the agent's device). The lean script
`ppo_torchenv_torchcompile.py` learns the same way and compiles the whole rollout; this file is
what its speed-ups are measured against.

    python leanrl/ppo_torchenv.py
    python leanrl/ppo_torchenv.py --env-id Acrobot-v1
    python leanrl/ppo_torchenv.py --no-cuda
"""

import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

import leanrl_envs
from leanrl_utils import Run, checks, cli, fail, resume


@dataclass
class Args(resume.Flags):
    # common
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be enabled by default"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "leanRL"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """videos need gymnasium's renderer: the torch-native envs refuse this flag (use ppo.py)"""
    save_model: bool = False
    """whether to save the model into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes of the greedy policy (the most likely action) to run after training (0: none)"""

    # algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment, one of leanrl_envs.ENVS"""
    total_timesteps: int = 500_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantage normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""


def check_torch_env(args):
    """One clear line, before any other check, for an env or flag the torch-native envs cannot serve."""
    if args.env_id not in leanrl_envs.ENVS:
        fail(f"--env-id {args.env_id} has no torch-native env: use one of {', '.join(leanrl_envs.ENVS)}")
    if args.capture_video:
        fail("--capture-video: torch-native envs have no renderer; record with ppo.py (pip install 'leanrl[video]')")


def make_env(args, num_envs, device):
    """The torch-native vector env."""
    return leanrl_envs.make(args.env_id, num_envs, device)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        # Unvalidated, so that a diverged update reaches the non-finite-loss check as NaN instead
        # of raising here.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def evaluate(agent, args, device):
    """Mean return of the greedy policy (the most likely action) over `eval_episodes` episodes."""
    eval_env = make_env(args, 1, device)
    returns = []
    state, obs = eval_env.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            state, out = eval_env.step(state, agent.actor(obs).argmax(1))
            obs = out.obs
            if out.terminated | out.truncated:
                returns.append(float(out.episode_return))
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    check_torch_env(args)
    checks.flags(args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    env = make_env(args, args.num_envs, device)
    batch_size = args.num_envs * args.num_steps
    if args.total_timesteps < batch_size and not (args.total_timesteps == 0 and args.load_model):
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps = {batch_size}): "
            f"give at least {batch_size}"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps): "
            "pass a divisor of it"
        )
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(
            f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: "
            f"use at most {batch_size // 2}, or --no-norm-adv"
        )
    num_iterations = args.total_timesteps // batch_size
    checks.rollout(args, 4 * (env.obs_dim + 6), device)  # per step of an env: float32 obs and 6 numbers
    run = Run(args, num_iterations * batch_size, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    agent = Agent(env.obs_dim, env.num_actions, device=device)
    networks = {"agent": agent}
    if args.load_model:
        run.load(networks)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    obs = torch.zeros((args.num_steps, args.num_envs, env.obs_dim)).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs)).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = updates = 0
    # The env's state is tensors (physics, step counts, running returns, the key of its reset
    # draws): a loop variable that --resume saves and restores like next_obs.
    state, next_obs = env.reset(seed=args.seed)
    next_done = torch.zeros(args.num_envs).to(device)
    objects = {"agent": agent, "optimizer": optimizer}
    global_step, updates, next_obs, next_done, state = run.resume(
        objects, lambda: (global_step, updates, next_obs, next_done, tuple(state)), device
    )
    state = leanrl_envs.State(*state)
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        for step in range(0, args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done

            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            # Same-step autoreset: next_obs already starts the next episode where next_done is
            # set, and GAE below does not bootstrap across it.
            state, out = env.step(state, action)
            next_obs, next_done = out.obs, (out.terminated | out.truncated).float()
            rewards[step] = out.reward
            for i in next_done.nonzero().flatten().tolist():
                run.record(global_step, float(out.episode_return[i]), int(out.episode_length[i]))

        # bootstrap value if not done
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards).to(device)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1, env.obs_dim))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                end = start + minibatch_size
                mb_inds = b_inds[start:end]

                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()

                with torch.no_grad():
                    # calculate approx_kl http://joschu.net/blog/kl-approx.html
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                # Policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                # Value loss
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds],
                        -args.clip_coef,
                        args.clip_coef,
                    )
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                    v_loss = 0.5 * v_loss_max.mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                updates += 1

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        losses = {
            "losses/value_loss": v_loss.item(),
            "losses/policy_loss": pg_loss.item(),
            "losses/entropy": entropy_loss.item(),
            "losses/old_approx_kl": old_approx_kl.item(),
            "losses/approx_kl": approx_kl.item(),
            "losses/clipfrac": np.mean(clipfracs),
        }
        bad = next((k for k, v in losses.items() if not math.isfinite(v)), None)
        if bad:
            run.stop_reason = f"non-finite {bad.removeprefix('losses/')} {losses[bad]} at step {global_step}"
            break
        metrics = {
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            **losses,
            "losses/explained_variance": float(explained_var),
        }
        run.log(global_step, updates, metrics, networks)
    evaluate_agent = lambda: evaluate(agent, args, device)
    run.finish(global_step, updates, networks, evaluate_agent, device=device.type)


if __name__ == "__main__":
    main(cli(Args))

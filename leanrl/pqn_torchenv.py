"""PQN on torch-native envs, plain PyTorch in the CleanRL style: the baseline.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of `pqn.py`, on the torch-native
twins of gymnasium's classic-control envs (`leanrl_envs`): the envs are tensors on the script's
device, stepped by a pure function, so no observation or action crosses to a host env. The loop
is `pqn.py`'s otherwise, one op at a time. The lean script `pqn_torchenv_torchcompile.py` learns
the same way with the rollout compiled; this file is what its speed-ups are measured against.

    python leanrl/pqn_torchenv.py
    python leanrl/pqn_torchenv.py --env-id Acrobot-v1
"""

import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

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
    """not available here: the torch-native envs draw no frames (pqn.py records videos)"""
    save_model: bool = False
    """whether to save the model into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes of the greedy policy to run after training (0: none)"""

    # algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment: one of leanrl_envs.ENVS"""
    total_timesteps: int = 500_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""


def check_torch_env(args):
    """One line for an env or a flag the torch-native envs cannot serve, before any work."""
    if args.env_id not in leanrl_envs.ENVS:
        fail(f"--env-id {args.env_id} has no torch-native env: pass one of {', '.join(leanrl_envs.ENVS)} (or use pqn.py)")
    if args.capture_video:
        fail("--capture-video: the torch-native envs draw no frames; record videos with pqn.py (pip install 'leanrl[video]')")


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """CleanRL's PQN MLP: LayerNorm after each hidden layer, which is what lets PQN learn without
    a target network (Gallici et al., 2024, section 4)."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Linear(n_obs, 120, device=device)),
            nn.LayerNorm(120, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(120, 84, device=device)),
            nn.LayerNorm(84, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(84, n_act, device=device)),
        )

    def forward(self, x):
        return self.network(x)


def evaluate(q_network, args, device):
    """Mean return of the greedy policy over `eval_episodes` episodes on a fresh env."""
    env = leanrl_envs.make(args.env_id, 1, device)
    state, obs = env.reset(seed=args.seed + 10_000)
    returns = []
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            state, out = env.step(state, q_network(obs).argmax(dim=1))
            obs = out.obs
            if (out.terminated | out.truncated).item():
                returns.append(out.episode_return.item())
    return float(np.mean(returns))


def main(args: Args):
    resumed = resume.read(args, __file__)
    check_torch_env(args)
    checks.flags(args)
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
    num_iterations = args.total_timesteps // batch_size
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    # per step of an env: float32 obs and 4 numbers, an int64 action; 256 bytes per env for its state
    checks.rollout(args, 4 * leanrl_envs.ENVS[args.env_id].obs_dim + 24, device, per_env=256)
    run = Run(args, num_iterations * batch_size, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = leanrl_envs.make(args.env_id, args.num_envs, device)
    n_obs, n_act = envs.obs_dim, envs.num_actions

    q_network = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        run.load({"q_network": q_network})
    optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate)

    obs = torch.zeros((args.num_steps, args.num_envs, n_obs)).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = updates = 0
    epsilon, lr_now = args.start_e, args.learning_rate
    state, next_obs = envs.reset(seed=args.seed)
    # The env's whole state is tensors (its reset draws included), saved with the loop's variables.
    loop = lambda: (global_step, updates, tuple(state), next_obs)
    global_step, updates, state, next_obs = run.resume({"q_network": q_network, "optimizer": optimizer}, loop, device)
    state = leanrl_envs.State(*state)
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        if args.anneal_lr:
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            optimizer.param_groups[0]["lr"] = lr_now

        for step in range(0, args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs

            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
            random_actions = torch.randint(0, n_act, (args.num_envs,)).to(device)
            with torch.no_grad():
                q_values = q_network(next_obs)
                max_actions = torch.argmax(q_values, dim=1)
                values[step] = q_values[torch.arange(args.num_envs), max_actions]
            explore = torch.rand((args.num_envs,)).to(device) < epsilon
            action = torch.where(explore, random_actions, max_actions)
            actions[step] = action

            state, out = envs.step(state, action)
            rewards[step] = out.reward
            # As CleanRL's PQN and our PPO: a time limit ends the return as a termination does.
            done = out.terminated | out.truncated
            dones[step] = done.float()
            next_obs = out.obs
            for i in done.nonzero().flatten().tolist():  # note: a host sync per step, as a host env's step
                run.record(global_step, out.episode_return[i].item(), out.episode_length[i].item())

        # Q(lambda) returns. One correction to CleanRL's loop: at an episode's end the
        # lambda-weighted return of the next step (another episode's) is cut off as well as
        # the bootstrap.
        with torch.no_grad():
            next_value = q_network(next_obs).max(dim=1).values
            returns = torch.zeros_like(rewards).to(device)
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    next_q, next_return = next_value, next_value
                else:
                    next_q, next_return = values[t + 1], returns[t + 1]
                returns[t] = rewards[t] + args.gamma * (1.0 - dones[t]) * (
                    args.q_lambda * next_return + (1 - args.q_lambda) * next_q
                )

        b_obs = obs.reshape(-1, n_obs)
        b_actions = actions.reshape(-1)
        b_returns = returns.reshape(-1)

        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                end = start + minibatch_size
                mb_inds = b_inds[start:end]

                old_val = q_network(b_obs[mb_inds]).gather(1, b_actions[mb_inds].unsqueeze(1)).squeeze(1)
                loss = F.mse_loss(b_returns[mb_inds], old_val)

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
                optimizer.step()
                updates += 1

        # As CleanRL: the last minibatch's loss and Q-values.
        stats = {"losses/td_loss": loss.item(), "losses/q_values": old_val.mean().item()}
        if not math.isfinite(stats["losses/td_loss"]):
            run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
            break
        metrics = {"charts/learning_rate": lr_now, **stats, "charts/epsilon": epsilon}
        run.log(global_step, updates, metrics, {"q_network": q_network})
    run.finish(global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, device), device=device.type)


if __name__ == "__main__":
    main(cli(Args))

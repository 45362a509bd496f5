"""PQN on Atari through envpool, plain PyTorch in the CleanRL style: the baseline.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of CleanRL's
`pqn_atari_envpool.py`: Q-learning with the Nature CNN (Mnih et al., 2015) and LayerNorm after
every layer, vectorized envs, epsilon-greedy rollouts, Q(lambda) returns and a few epochs of
minibatch updates per rollout, with no replay buffer and no target network. The games run in
envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey frames stacked by 4, frame
skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped rewards for learning; the
reported returns are whole games, unclipped. The lean script `pqn_atari_envpool_torchcompile.py`
learns the same way, faster; this file is what its speed-ups are measured against.

    python leanrl/pqn_atari_envpool.py
    python leanrl/pqn_atari_envpool.py --env-id Pong-v5
"""

import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from leanrl_utils import Run, checks, cli, fail, resume, vector


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
    """whether to capture videos of the agent performances (check out `videos` folder)"""
    save_model: bool = False
    """whether to save the model into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes (whole games) of the greedy policy to run after training (0: none)"""

    # algorithm
    env_id: str = "Breakout-v5"
    """the id of the environment (an envpool Atari id)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


class QNetwork(nn.Module):
    """The Nature CNN with LayerNorm after every hidden layer, as in CleanRL's PQN: the
    normalization is what lets PQN learn without a target network (Gallici et al., 2024)."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.LayerNorm([32, 20, 20], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.LayerNorm([64, 9, 9], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.LayerNorm([64, 7, 7], device=device),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.LayerNorm(512, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(512, n_act, device=device)),
        )

    def forward(self, x):
        return self.network(x / 255.0)


def evaluate(q_network, args, run_name, device):
    """Mean whole-game return of the greedy policy over `eval_episodes` games. Episodic life stays
    on, so that envpool presses FIRE after each lost life (a greedy policy may never do it); a
    game that never ends is cut by envpool's own limit of 27,000 steps (108,000 frames, 30
    minutes of play)."""
    eval_envs = vector.envpool_envs(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            q_values = q_network(torch.as_tensor(obs, device=device))
            obs, _, _, _, infos = eval_envs.step(q_values.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args, atari=True)
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
    checks.rollout(args, 4 * 84 * 84 + 8 + 6 * 4)  # per step of a game: uint8 frames, int64 action, 6 float32 numbers
    run = Run(args, num_iterations * batch_size, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = vector.envpool_envs(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run.name}")
    obs_shape = envs.single_observation_space.shape
    n_act = envs.single_action_space.n

    q_network = QNetwork(n_act, device=device)
    if args.load_model:
        run.load({"q_network": q_network})
    optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate)

    # Frames stay uint8 (a quarter of the memory); the network divides them by 255.
    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    terminations = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    valid = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = updates = 0
    epsilon, lr_now = args.start_e, args.learning_rate
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)
    # envpool's games cannot be saved: a resumed run starts fresh episodes.
    global_step, updates = run.resume({"q_network": q_network, "optimizer": optimizer}, lambda: (global_step, updates))
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        if args.anneal_lr:
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            optimizer.param_groups[0]["lr"] = lr_now

        for step in range(0, args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            # envpool autoresets on the NEXT step: the step that ends an episode returns its
            # last frame, and the following step ignores its action, resets that env and
            # returns reward 0 with the first frame of the next episode. Such a reset step is
            # no transition of the game: the loss leaves it out (valid 0).
            valid[step] = 1.0 - next_done

            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
            random_actions = torch.randint(0, n_act, (args.num_envs,)).to(device)
            with torch.no_grad():
                q_values = q_network(next_obs)
                max_actions = torch.argmax(q_values, dim=1)
                values[step] = q_values[torch.arange(args.num_envs), max_actions]
            explore = torch.rand((args.num_envs,)).to(device) < epsilon
            action = torch.where(explore, random_actions, max_actions)
            actions[step] = action

            next_obs, reward, termination, truncation, infos = envs.step(action.cpu().numpy())
            next_done = torch.Tensor(np.logical_or(termination, truncation)).to(device)
            rewards[step] = torch.tensor(reward).to(device).view(-1)
            terminations[step] = torch.Tensor(termination).to(device)
            dones[step] = next_done
            next_obs = torch.as_tensor(next_obs).to(device)
            run.episodes(global_step, infos)

        # Q(lambda) returns. Two corrections to CleanRL's loop: at an episode's end (a lost
        # life) the lambda-weighted return of the next step (another episode's) is cut off as
        # well as the bootstrap, and a time-limit truncation bootstraps from max Q of the last
        # frame (values[t + 1]: envpool returns it at the step that ends the episode) where
        # CleanRL treats it as a termination.
        with torch.no_grad():
            next_value = q_network(next_obs).max(dim=1).values
            returns = torch.zeros_like(rewards).to(device)
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    next_q, next_return = next_value, next_value
                else:
                    next_q, next_return = values[t + 1], returns[t + 1]
                next_return = torch.where(dones[t].bool(), next_q, next_return)
                returns[t] = rewards[t] + args.gamma * (1.0 - terminations[t]) * (
                    args.q_lambda * next_return + (1 - args.q_lambda) * next_q
                )

        b_obs = obs.reshape((-1,) + obs_shape)
        b_actions = actions.reshape(-1)
        b_returns = returns.reshape(-1)
        b_valid = valid.reshape(-1)

        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                end = start + minibatch_size
                mb_inds = b_inds[start:end]
                mb_valid = b_valid[mb_inds]
                n_valid = mb_valid.sum().clamp(min=1)

                old_val = q_network(b_obs[mb_inds]).gather(1, b_actions[mb_inds].unsqueeze(1)).squeeze(1)
                # F.mse_loss over the valid steps only
                loss = ((b_returns[mb_inds] - old_val) ** 2 * mb_valid).sum() / n_valid

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
                optimizer.step()
                updates += 1

        # As CleanRL: the last minibatch's loss and Q-values (over its valid steps).
        stats = {"losses/td_loss": loss.item(), "losses/q_values": ((old_val * mb_valid).sum() / n_valid).item()}
        if not math.isfinite(stats["losses/td_loss"]):
            run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
            break
        metrics = {"charts/learning_rate": lr_now, **stats, "charts/epsilon": epsilon}
        run.log(global_step, updates, metrics, {"q_network": q_network})
    envs.close()
    run.finish(
        global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, run.name, device), device=device.type
    )


if __name__ == "__main__":
    main(cli(Args))

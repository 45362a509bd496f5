"""PPO on Atari through envpool, plain PyTorch in the CleanRL style: the baseline.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the Nature CNN (Mnih et al., 2015) and the implementation details of CleanRL's
`ppo_atari_envpool.py` (Huang et al., "The 37 Implementation Details of PPO", ICLR blog track
2022). The games run in envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey
frames stacked by 4, frame skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped
rewards for learning; the reported returns are whole games, unclipped. The lean script
`ppo_atari_envpool_torchcompile.py` learns the same way, faster; this file is what its
speed-ups are measured against.

    python leanrl/ppo_atari_envpool.py
    python leanrl/ppo_atari_envpool.py --env-id Pong-v5
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
    """episodes (whole games) of the deterministic policy to run after training (0: none)"""

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
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN trunk shared by a policy head and a value head."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        # Unvalidated, so that a diverged update reaches the non-finite-loss check as NaN instead
        # of raising here.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def evaluate(agent, args, run_name, device):
    """Mean whole-game return of the deterministic policy (the most likely action) over
    `eval_episodes` games. Episodic life stays on, so that envpool presses FIRE after each lost
    life (a greedy policy may never do it); a game that never ends is cut by envpool's own limit
    of 27,000 steps (108,000 frames, 30 minutes of play)."""
    eval_envs = vector.envpool_envs(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            logits = agent.actor(agent.network(torch.as_tensor(obs, device=device) / 255.0))
            obs, _, _, _, infos = eval_envs.step(logits.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args, atari=True)
    batch_size = args.num_envs * args.num_steps
    if args.total_timesteps < batch_size and not (args.total_timesteps == 0 and args.load_model):
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one batch "
            f"(num_envs * num_steps = {batch_size}): give at least {batch_size}"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} "
            "(num_envs * num_steps): pass a divisor of it"
        )
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(
            f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: "
            f"use at most {batch_size // 2}, or --no-norm-adv"
        )
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

    agent = Agent(envs.single_action_space.n, device=device)
    if args.load_model:
        run.load({"agent": agent})
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # Frames stay uint8 (a quarter of the memory); the network divides them by 255.
    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = updates = 0
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)
    # envpool's games cannot be saved: a resumed run starts fresh episodes.
    global_step, updates = run.resume({"agent": agent, "optimizer": optimizer}, lambda: (global_step, updates))
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

            # envpool autoresets on the NEXT step: the step that ends an episode returns its
            # last frame, and the following step ignores its action, resets that env and
            # returns reward 0 with the first frame of the next episode. So dones[t] = 1
            # marks a reset step t, which the losses below leave out (see `valid`).
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs, next_done = torch.as_tensor(next_obs).to(device), torch.Tensor(next_done).to(device)
            run.episodes(global_step, infos)

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

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)
        # A reset step is no transition of the game (its action did nothing, its frame is the
        # previous episode's last): every mean in the losses runs over the other steps only.
        # GAE already stops at the done before it, so its garbage flows nowhere else.
        b_valid = 1.0 - dones.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                end = start + minibatch_size
                mb_inds = b_inds[start:end]
                mb_valid = b_valid[mb_inds]
                n_valid = mb_valid.sum().clamp(min=1)

                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()

                with torch.no_grad():
                    # calculate approx_kl http://joschu.net/blog/kl-approx.html
                    old_approx_kl = (-logratio * mb_valid).sum() / n_valid
                    approx_kl = (((ratio - 1) - logratio) * mb_valid).sum() / n_valid
                    clipfracs += [((((ratio - 1.0).abs() > args.clip_coef).float() * mb_valid).sum() / n_valid).item()]

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    adv_mean = (mb_advantages * mb_valid).sum() / n_valid
                    adv_std = (((mb_advantages - adv_mean) ** 2 * mb_valid).sum() / (n_valid - 1).clamp(min=1)).sqrt()
                    mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)

                # Policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = (torch.max(pg_loss1, pg_loss2) * mb_valid).sum() / n_valid

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
                    v_loss = 0.5 * (v_loss_max * mb_valid).sum() / n_valid
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2 * mb_valid).sum() / n_valid

                entropy_loss = (entropy * mb_valid).sum() / n_valid
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                updates += 1

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        # As CleanRL: the last minibatch's losses, clipfrac over all minibatches.
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
            run.stop_reason = f"non-finite {bad[len('losses/') :]} {losses[bad]} at step {global_step}"
            break
        valid = b_valid.bool()
        y_pred, y_true = b_values[valid].cpu().numpy(), b_returns[valid].cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        metrics = {
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            **losses,
            "losses/explained_variance": explained_var,
        }
        run.log(global_step, updates, metrics, {"agent": agent})
    envs.close()
    run.finish(global_step, updates, {"agent": agent}, lambda: evaluate(agent, args, run.name, device), device=device.type)


if __name__ == "__main__":
    main(cli(Args))

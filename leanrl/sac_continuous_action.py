"""SAC for continuous actions, plain PyTorch in the CleanRL style: the baseline.

Soft Actor-Critic (Haarnoja et al., 2018, https://arxiv.org/abs/1801.01290, with the automatic
entropy tuning of https://arxiv.org/abs/1812.05905) with the details and defaults of CleanRL's
`sac_continuous_action.py`: twin Q-networks with Polyak-averaged targets, a tanh-squashed
Gaussian policy updated every `policy_frequency` steps (that many times, to make up for the
delay), and a numpy replay buffer on the host. The lean script
`sac_continuous_action_torchcompile.py` learns the same way, faster; this file is what its
speed-ups are measured against.

    python leanrl/sac_continuous_action.py
    python leanrl/sac_continuous_action.py --env-id Pendulum-v1 --total-timesteps 20000
    python leanrl/sac_continuous_action.py --no-autotune --alpha 0.1
"""

import importlib.util
import math
import os
import random
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
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
    """episodes of the deterministic policy to run after training (0: none)"""

    # algorithm
    env_id: str = "HalfCheetah-v5"
    """the environment id of the task"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments"""
    num_envs: int = 1
    """the number of parallel game environments (one gradient update per step of all of them)"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of sample from the replay memory"""
    learning_starts: int = 5_000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """Entropy regularization coefficient."""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100


def make_env(env_id, idx, capture_video, run_name):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    return thunk


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
    if capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        if capture_video:  # a missing renderer fails here, not at the first recorded frame
            probe = gym.make(args.env_id, render_mode="rgb_array")
            probe.reset(seed=args.seed)
            probe.render()
            probe.close()
        # SAME_STEP autoreset: the step that ends an episode returns the first observation of the
        # next one and the true last one in infos["final_obs"], so every step is one real
        # transition and none spans an autoreset.
        thunks = [make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(
            f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; "
            "SAC handles continuous (Box) actions only (e.g. Pendulum-v1)"
        )
    return envs


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays on the host, sampled uniformly."""

    def __init__(self, buffer_size, n_obs, n_act):
        checks.memory(buffer_size * (2 * n_obs + n_act + 2) * 4, torch.device("cpu"), f"--buffer-size {buffer_size}")
        self.obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.next_obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.actions = np.zeros((buffer_size, n_act), dtype=np.float32)
        self.rewards = np.zeros((buffer_size, 1), dtype=np.float32)
        self.dones = np.zeros((buffer_size, 1), dtype=np.float32)
        self.buffer_size, self.pos, self.size = buffer_size, 0, 0

    def add(self, obs, next_obs, actions, rewards, dones):
        idx = (self.pos + np.arange(len(obs))) % self.buffer_size
        self.obs[idx] = obs
        self.next_obs[idx] = next_obs
        self.actions[idx] = actions
        self.rewards[idx, 0] = rewards
        self.dones[idx, 0] = dones
        self.pos = (self.pos + len(obs)) % self.buffer_size
        self.size = min(self.size + len(obs), self.buffer_size)

    def sample(self, batch_size, device):
        idx = np.random.randint(0, self.size, size=batch_size)
        return tuple(
            torch.as_tensor(x[idx], device=device) for x in (self.obs, self.actions, self.next_obs, self.dones, self.rewards)
        )


class SoftQNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, action_low, action_high, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mean = nn.Linear(256, n_act, device=device)
        self.fc_logstd = nn.Linear(256, n_act, device=device)
        # action rescaling
        self.register_buffer(
            "action_scale", torch.tensor((action_high - action_low) / 2.0, dtype=torch.float32, device=device)
        )
        self.register_buffer("action_bias", torch.tensor((action_high + action_low) / 2.0, dtype=torch.float32, device=device))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = self.fc_logstd(x)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # From SpinUp / Denis Yarats
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        # No argument validation: it would raise on a NaN mean before the log point can stop
        # the run cleanly on a non-finite loss (and it costs a check per call).
        normal = torch.distributions.Normal(mean, std, validate_args=False)
        x_t = normal.rsample()  # for reparameterization trick (mean + std * N(0,1))
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing Action Bound
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


def evaluate(actor, args, run_name, device):
    """Mean return of the deterministic policy (the squashed mean action) over `eval_episodes`
    episodes on a fresh env."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            _, _, action = actor.get_action(torch.Tensor(obs).to(device))
            obs, _, _, _, infos = eval_envs.step(action.cpu().numpy())
            if "final_info" in infos:
                final = infos["final_info"]
                returns.extend(final["episode"]["r"][final["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args)
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    if args.num_envs > args.buffer_size:
        fail(
            f"--num-envs {args.num_envs} is larger than --buffer-size {args.buffer_size}: "
            "make the buffer hold a step of every env"
        )
    num_iterations = args.total_timesteps // args.num_envs
    run = Run(args, num_iterations * args.num_envs, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args, run.name, args.num_envs, args.capture_video)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high

    actor = Actor(n_obs, n_act, action_low, action_high, device=device)
    qf1 = SoftQNetwork(n_obs, n_act, device=device)
    qf2 = SoftQNetwork(n_obs, n_act, device=device)
    # log_alpha in a module of its own, so that checkpoints carry it as they carry the networks.
    entropy = nn.ParameterDict({"log_alpha": nn.Parameter(torch.zeros(1, device=device), requires_grad=args.autotune)})
    networks = {"actor": actor, "qf1": qf1, "qf2": qf2, "entropy": entropy}
    if args.load_model:
        run.load(networks)
    qf1_target = SoftQNetwork(n_obs, n_act, device=device)
    qf2_target = SoftQNetwork(n_obs, n_act, device=device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)

    # Automatic entropy tuning
    log_alpha = entropy["log_alpha"]
    if args.autotune:
        target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
        alpha = log_alpha.exp().item()
        a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    else:
        alpha = args.alpha
        log_alpha.fill_(math.log(alpha))

    rb = ReplayBuffer(args.buffer_size, n_obs, n_act)

    global_step = updates = 0
    qf1_a_values = qf2_a_values = qf1_loss = qf2_loss = qf_loss = actor_loss = alpha_loss = None
    obs, _ = envs.reset(seed=args.seed)
    # What --resume restores: the objects, and the loop's variables (the losses logged at the next log point).
    optimizers = {"q_optimizer": q_optimizer, "actor_optimizer": actor_optimizer, "a_optimizer": args.autotune and a_optimizer}
    objects = {**networks, "qf1_target": qf1_target, "qf2_target": qf2_target, "rb": rb, "envs": envs, **optimizers}
    last = lambda: (qf1_a_values, qf2_a_values, qf1_loss, qf2_loss, qf_loss, actor_loss, alpha_loss)
    global_step, updates, obs, alpha, saved = run.resume(objects, lambda: (global_step, updates, obs, alpha, last()), device)
    qf1_a_values, qf2_a_values, qf1_loss, qf2_loss, qf_loss, actor_loss, alpha_loss = saved
    for iteration in range(global_step // args.num_envs, num_iterations):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        if global_step < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            actions, _, _ = actor.get_action(torch.Tensor(obs).to(device))
            actions = actions.detach().cpu().numpy()

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        global_step += args.num_envs
        run.episodes(global_step, infos)

        # The done flag is the termination only: a time-limit truncation still bootstraps
        # from the true last observation (see make_envs for the autoreset).
        rb.add(obs, vector.real_next_obs(next_obs, infos), actions, rewards, terminations)
        obs = next_obs

        if global_step > args.learning_starts:
            data_obs, data_actions, data_next_obs, data_dones, data_rewards = rb.sample(args.batch_size, device)
            with torch.no_grad():
                next_state_actions, next_state_log_pi, _ = actor.get_action(data_next_obs)
                qf1_next_target = qf1_target(data_next_obs, next_state_actions)
                qf2_next_target = qf2_target(data_next_obs, next_state_actions)
                min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                next_q_value = data_rewards.flatten() + (1 - data_dones.flatten()) * args.gamma * min_qf_next_target.view(-1)

            qf1_a_values = qf1(data_obs, data_actions).view(-1)
            qf2_a_values = qf2(data_obs, data_actions).view(-1)
            qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
            qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
            qf_loss = qf1_loss + qf2_loss

            # optimize the model
            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()
            updates += 1

            if updates % args.policy_frequency == 0:  # TD 3 Delayed update support
                # compensate for the delay by doing 'actor_update_interval' instead of 1
                for _ in range(args.policy_frequency):
                    pi, log_pi, _ = actor.get_action(data_obs)
                    qf1_pi = qf1(data_obs, pi)
                    qf2_pi = qf2(data_obs, pi)
                    min_qf_pi = torch.min(qf1_pi, qf2_pi)
                    actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

                    actor_optimizer.zero_grad()
                    actor_loss.backward()
                    actor_optimizer.step()

                    if args.autotune:
                        with torch.no_grad():
                            _, log_pi, _ = actor.get_action(data_obs)
                        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                        a_optimizer.zero_grad()
                        alpha_loss.backward()
                        a_optimizer.step()
                        alpha = log_alpha.exp().item()

            # update the target networks
            if updates % args.target_network_frequency == 0:
                for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
                for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

        if global_step // LOG_EVERY > (global_step - args.num_envs) // LOG_EVERY or iteration == num_iterations - 1:
            stats = {}
            if updates > 0:
                stats = {
                    "losses/qf1_values": qf1_a_values.mean().item(),
                    "losses/qf2_values": qf2_a_values.mean().item(),
                    "losses/qf1_loss": qf1_loss.item(),
                    "losses/qf2_loss": qf2_loss.item(),
                    "losses/qf_loss": qf_loss.item() / 2.0,
                }
            if updates >= args.policy_frequency:
                stats.update({"losses/actor_loss": actor_loss.item(), "losses/alpha": alpha})
                if args.autotune:
                    stats["losses/alpha_loss"] = alpha_loss.item()
            losses = ("losses/qf_loss", "losses/actor_loss", "losses/alpha_loss")
            bad = [k for k in losses if not math.isfinite(stats.get(k, 0.0))]
            if bad:
                run.stop_reason = f"non-finite {bad[0][len('losses/') :]} {stats[bad[0]]} at step {global_step}"
                break
            run.log(global_step, updates, stats, networks)
    envs.close()
    run.finish(global_step, updates, networks, lambda: evaluate(actor, args, run.name, device), device=device.type)


if __name__ == "__main__":
    main(cli(Args))

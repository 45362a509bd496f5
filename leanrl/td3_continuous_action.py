"""TD3 for continuous actions, plain PyTorch in the CleanRL style: the baseline.

Twin Delayed Deep Deterministic policy gradient (Fujimoto et al., 2018,
https://arxiv.org/abs/1802.09477) with the details and defaults of CleanRL's
`td3_continuous_action.py`: clipped double-Q learning with twin critics, delayed policy and
target updates, and target policy smoothing. The lean script
`td3_continuous_action_torchcompile.py` learns the same way, faster; this file is what its
speed-ups are measured against.

    python leanrl/td3_continuous_action.py
    python leanrl/td3_continuous_action.py --env-id Hopper-v5
    python leanrl/td3_continuous_action.py --num-envs 4
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
    """the id of the environment"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments (each step stores num_envs transitions and makes one update)"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient (default: 0.005)"""
    batch_size: int = 256
    """the batch size of sample from the replay memory"""
    policy_noise: float = 0.2
    """the scale of policy noise"""
    exploration_noise: float = 0.1
    """the scale of exploration noise"""
    learning_starts: int = 25_000
    """timestep to start learning"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    noise_clip: float = 0.5
    """noise clip parameter of the Target Policy Smoothing Regularization"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100


def make_env(env_id, idx, capture_video, run_name):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    return thunk


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
    if capture_video and importlib.util.find_spec("moviepy") is None:
        fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
    try:
        if capture_video:  # a missing renderer fails here, not at the first recorded frame
            # MuJoCo renders off-screen through EGL, which needs no display; a MUJOCO_GL set by the user wins.
            os.environ.setdefault("MUJOCO_GL", "egl")
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
    action_space, observation_space = envs.single_action_space, envs.single_observation_space
    if not isinstance(action_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(action_space).__name__} action space; TD3 handles continuous (Box) actions only")
    if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
        fail(
            f"{args.env_id} has observations of type {type(observation_space).__name__}; "
            "this script handles flat Box observations only"
        )
    return envs


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed going from step - n to step: with
    several envs the counter moves by num_envs at a time."""
    return step // every - (step - n) // every


class QNetwork(nn.Module):
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


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, action_low, action_high, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mu = nn.Linear(256, n_act, device=device)
        # action rescaling
        low = torch.as_tensor(action_low, dtype=torch.float32, device=device)
        high = torch.as_tensor(action_high, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = torch.tanh(self.fc_mu(x))
        return x * self.action_scale + self.action_bias


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays on the host, sampled uniformly."""

    def __init__(self, buffer_size, n_obs, n_act):
        checks.memory(buffer_size * (2 * n_obs + n_act + 2) * 4, torch.device("cpu"), f"--buffer-size {buffer_size}")
        self.obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.actions = np.zeros((buffer_size, n_act), dtype=np.float32)
        self.rewards = np.zeros(buffer_size, dtype=np.float32)
        self.next_obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.dones = np.zeros(buffer_size, dtype=np.float32)
        self.buffer_size, self.pos, self.size = buffer_size, 0, 0

    def add(self, obs, actions, rewards, next_obs, dones):
        idx = (self.pos + np.arange(len(obs))) % self.buffer_size
        self.obs[idx] = obs
        self.actions[idx] = actions
        self.rewards[idx] = rewards
        self.next_obs[idx] = next_obs
        self.dones[idx] = dones
        self.pos = (self.pos + len(obs)) % self.buffer_size
        self.size = min(self.size + len(obs), self.buffer_size)

    def sample(self, batch_size, device):
        idx = np.random.randint(0, self.size, size=batch_size)
        return tuple(
            torch.as_tensor(x[idx], device=device) for x in (self.obs, self.actions, self.rewards, self.next_obs, self.dones)
        )


def evaluate(actor, args, run_name, device):
    """Mean return of the deterministic policy (no exploration noise) over `eval_episodes` episodes."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            action = actor(torch.Tensor(obs).to(device))
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
            "make the buffer hold one step of every env"
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
    low, high = envs.single_action_space.low, envs.single_action_space.high
    action_low, action_high = torch.as_tensor(low, device=device), torch.as_tensor(high, device=device)

    actor = Actor(n_obs, n_act, low, high, device=device)
    qf1 = QNetwork(n_obs, n_act, device=device)
    qf2 = QNetwork(n_obs, n_act, device=device)
    networks = {"actor": actor, "qf1": qf1, "qf2": qf2}
    if args.load_model:
        run.load(networks)
    qf1_target = QNetwork(n_obs, n_act, device=device)
    qf2_target = QNetwork(n_obs, n_act, device=device)
    target_actor = Actor(n_obs, n_act, low, high, device=device)
    target_actor.load_state_dict(actor.state_dict())
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.learning_rate)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.learning_rate)

    rb = ReplayBuffer(args.buffer_size, n_obs, n_act)

    global_step = updates = 0
    qf_loss = qf1_a_values = qf2_a_values = qf1_loss = qf2_loss = None
    actor_loss = torch.zeros(())
    obs, _ = envs.reset(seed=args.seed)
    # What --resume restores: the objects, and the loop's variables (the losses logged at the next log point).
    objects = {**networks, "qf1_target": qf1_target, "qf2_target": qf2_target, "target_actor": target_actor, "rb": rb}
    objects |= {"q_optimizer": q_optimizer, "actor_optimizer": actor_optimizer, "envs": envs}
    last = lambda: (qf1_a_values, qf2_a_values, qf1_loss, qf2_loss, qf_loss, actor_loss)
    global_step, updates, obs, saved = run.resume(objects, lambda: (global_step, updates, obs, last()), device)
    qf1_a_values, qf2_a_values, qf1_loss, qf2_loss, qf_loss, actor_loss = saved
    for iteration in range(global_step // args.num_envs, num_iterations):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        if global_step < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions = actor(torch.Tensor(obs).to(device))
                # One draw per env (CleanRL's torch.normal(0, scale) draws one for all envs).
                actions += torch.randn_like(actions) * actor.action_scale * args.exploration_noise
                actions = actions.cpu().numpy().clip(low, high)

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        global_step += args.num_envs
        run.episodes(global_step, infos)

        # The done flag is the termination only: a time-limit truncation still bootstraps
        # from the true last observation (see make_envs for the autoreset).
        rb.add(obs, actions, rewards, vector.real_next_obs(next_obs, infos), terminations)
        obs = next_obs

        if global_step > args.learning_starts:
            data_obs, data_actions, data_rewards, data_next_obs, data_dones = rb.sample(args.batch_size, device)
            with torch.no_grad():
                noise = (torch.randn_like(data_actions) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
                clipped_noise = noise * target_actor.action_scale
                next_state_actions = (target_actor(data_next_obs) + clipped_noise).clamp(action_low, action_high)
                qf1_next_target = qf1_target(data_next_obs, next_state_actions)
                qf2_next_target = qf2_target(data_next_obs, next_state_actions)
                min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
                next_q_value = data_rewards + (1 - data_dones) * args.gamma * min_qf_next_target.view(-1)

            qf1_a_values = qf1(data_obs, data_actions).view(-1)
            qf2_a_values = qf2(data_obs, data_actions).view(-1)
            qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
            qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
            qf_loss = qf1_loss + qf2_loss

            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()
            updates += 1

            # Counted in updates, not env steps, so that --num-envs keeps the delay.
            if updates % args.policy_frequency == 0:
                actor_loss = -qf1(data_obs, actor(data_obs)).mean()
                actor_optimizer.zero_grad()
                actor_loss.backward()
                actor_optimizer.step()

                # update the target network
                for param, target_param in zip(actor.parameters(), target_actor.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
                for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
                for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

        if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
            stats = {}
            if qf_loss is not None:
                stats = {
                    "losses/qf1_values": qf1_a_values.mean().item(),
                    "losses/qf2_values": qf2_a_values.mean().item(),
                    "losses/qf1_loss": qf1_loss.item(),
                    "losses/qf2_loss": qf2_loss.item(),
                    "losses/qf_loss": qf_loss.item() / 2.0,
                    "losses/actor_loss": actor_loss.item(),
                }
            bad = [k for k in ("losses/qf_loss", "losses/actor_loss") if k in stats and not math.isfinite(stats[k])]
            if bad:
                run.stop_reason = f"non-finite {bad[0][len('losses/') :]} {stats[bad[0]]} at step {global_step}"
                break
            run.log(global_step, updates, stats, networks)
    envs.close()
    run.finish(global_step, updates, networks, lambda: evaluate(actor, args, run.name, device), device=device.type)


if __name__ == "__main__":
    main(cli(Args))

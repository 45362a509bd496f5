"""DQN, plain PyTorch in the CleanRL style: the baseline.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the details
and defaults of CleanRL's `dqn.py`: an MLP Q-network, a replay buffer, a target network and
linearly decaying epsilon-greedy exploration. The lean script `dqn_torchcompile.py` learns the
same way, faster; this file is what its speed-ups are measured against.

    python leanrl/dqn.py
    python leanrl/dqn.py --env-id Acrobot-v1
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
    """episodes of the greedy policy to run after training (0: none)"""

    # algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: int = 500_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 10_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 500
    """the timesteps it takes to update the target network"""
    batch_size: int = 128
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 10_000
    """timestep to start learning"""
    train_frequency: int = 10
    """the frequency of training"""


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
        fail(f"{args.env_id} needs a missing dependency ({e})")
    space = envs.single_action_space
    if not isinstance(space, gym.spaces.Discrete):
        fail(f"{args.env_id} has a {type(space).__name__} action space; DQN handles discrete actions only (e.g. CartPole-v1)")
    space = envs.single_observation_space
    if not isinstance(space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(space).__name__} observation space; this script handles Box observations only")
    return envs


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed from step - n to step (n: num_envs)."""
    return step // every - (step - n) // every


class QNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(n_obs, 120, device=device),
            nn.ReLU(),
            nn.Linear(120, 84, device=device),
            nn.ReLU(),
            nn.Linear(84, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x)


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays on the host, sampled uniformly."""

    def __init__(self, buffer_size, n_obs):
        checks.memory(buffer_size * (2 * n_obs + 3) * 4, torch.device("cpu"), f"--buffer-size {buffer_size}")
        self.obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.next_obs = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.actions = np.zeros((buffer_size, 1), dtype=np.int64)
        self.rewards = np.zeros((buffer_size, 1), dtype=np.float32)
        self.dones = np.zeros((buffer_size, 1), dtype=np.float32)
        self.buffer_size, self.pos, self.size = buffer_size, 0, 0

    def add(self, obs, next_obs, actions, rewards, dones):
        idx = (self.pos + np.arange(len(obs))) % self.buffer_size
        self.obs[idx] = obs.reshape(len(obs), -1)
        self.next_obs[idx] = next_obs.reshape(len(obs), -1)
        self.actions[idx, 0] = actions
        self.rewards[idx, 0] = rewards
        self.dones[idx, 0] = dones
        self.pos = (self.pos + len(obs)) % self.buffer_size
        self.size = min(self.size + len(obs), self.buffer_size)

    def sample(self, batch_size, device):
        idx = np.random.randint(0, self.size, size=batch_size)
        return tuple(
            torch.as_tensor(x[idx], device=device) for x in (self.obs, self.actions, self.next_obs, self.dones, self.rewards)
        )


def evaluate(q_network, args, run_name, device):
    """Mean return of the greedy policy over `eval_episodes` episodes on a fresh env."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            q_values = q_network(torch.as_tensor(obs, device=device, dtype=torch.float).flatten(1))
            obs, _, _, _, infos = eval_envs.step(q_values.argmax(dim=1).cpu().numpy())
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
    num_iterations = args.total_timesteps // args.num_envs
    run = Run(args, num_iterations * args.num_envs, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args, run.name, args.num_envs, args.capture_video)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_network = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        run.load({"q_network": q_network})
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(n_obs, n_act, device=device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(args.buffer_size, n_obs)

    global_step = updates = 0
    loss = old_val = None
    obs, _ = envs.reset(seed=args.seed)
    objects = {"q_network": q_network, "target_network": target_network, "optimizer": optimizer, "rb": rb, "envs": envs}
    global_step, updates, loss, old_val, obs = run.resume(objects, lambda: (global_step, updates, loss, old_val, obs), device)
    for iteration in range(global_step // args.num_envs, num_iterations):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
        # One coin per env, so that several envs explore as one env would.
        explore = np.random.random(args.num_envs) < epsilon
        actions = np.random.randint(n_act, size=args.num_envs)
        if not explore.all():
            q_values = q_network(torch.Tensor(obs).to(device).flatten(1))
            actions = np.where(explore, actions, torch.argmax(q_values, dim=1).cpu().numpy())

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        global_step += args.num_envs
        run.episodes(global_step, infos)

        # The done flag is the termination only: a time-limit truncation still bootstraps
        # from the true last observation (see make_envs for the autoreset).
        rb.add(obs, vector.real_next_obs(next_obs, infos), actions, rewards, terminations)
        obs = next_obs

        if global_step > args.learning_starts:
            for _ in range(multiples_passed(global_step, args.num_envs, args.train_frequency)):
                data_obs, data_actions, data_next_obs, data_dones, data_rewards = rb.sample(args.batch_size, device)
                with torch.no_grad():
                    target_max, _ = target_network(data_next_obs).max(dim=1)
                    td_target = data_rewards.flatten() + args.gamma * target_max * (1 - data_dones.flatten())
                old_val = q_network(data_obs).gather(1, data_actions).squeeze(1)
                loss = F.mse_loss(td_target, old_val)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1

            if multiples_passed(global_step, args.num_envs, args.target_network_frequency):
                for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                    target_network_param.data.copy_(
                        args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data
                    )

        if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
            stats = {"losses/td_loss": loss.item(), "losses/q_values": old_val.mean().item()} if loss is not None else {}
            if stats and not math.isfinite(stats["losses/td_loss"]):
                run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
                break
            run.log(global_step, updates, {**stats, "charts/epsilon": epsilon}, {"q_network": q_network})
    envs.close()
    run.finish(
        global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, run.name, device), device=device.type
    )


if __name__ == "__main__":
    main(cli(Args))

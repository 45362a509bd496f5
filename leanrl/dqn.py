"""DQN, plain PyTorch in the CleanRL style: the baseline.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the
implementation details and defaults of CleanRL's `dqn.py`: an MLP Q-network, a replay buffer,
a target network, and epsilon-greedy exploration that decays linearly. Same defaults and the
same learning as the lean script `dqn_torchcompile.py`, which is the same algorithm made fast;
this file is what the speed-ups are measured against.

    python leanrl/dqn.py
    python leanrl/dqn.py --env-id Acrobot-v1
    python leanrl/dqn.py --cuda false
"""

import importlib.util
import json
import math
import os
import random
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tqdm
import tyro


@dataclass
class Args:
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
    """the batch size of sample from the reply memory"""
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
# Steps per second are counted from the first log point with this many updates done.
WARMUP_UPDATES = 3


def fail(message: str):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    for name in ("num_envs", "buffer_size", "batch_size", "train_frequency", "target_network_frequency"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.buffer_size < args.num_envs:
        fail(f"--buffer-size {args.buffer_size} is smaller than --num-envs {args.num_envs}: one step would not fit")
    if args.total_timesteps < 0 or args.learning_starts < 0:
        fail("--total-timesteps and --learning-starts must not be negative")
    if not 0.0 <= args.tau <= 1.0:
        fail(f"--tau must lie in [0, 1], got {args.tau}")


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


def make_envs(args, run_name, num_envs):
    """The vector env, or one clear line for an env this script cannot use."""
    if args.env_id not in gym.registry:
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. CartPole-v1")
    if args.capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        try:
            probe = gym.make(args.env_id, render_mode="rgb_array")
            probe.reset(seed=args.seed)
            probe.render()
            probe.close()
        except gym.error.DependencyNotInstalled as e:
            fail(f"--capture-video of {args.env_id} needs a rendering dependency: {e}")
    thunks = [make_env(args.env_id, i, args.capture_video, run_name) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: the step that ends an episode already returns the first
        # observation of the next one, and the true last observation is in infos["final_obs"].
        # Every step is then one real transition (stored with its true next observation), and no
        # stored transition spans an autoreset. Under the NEXT_STEP default, the step after a done
        # would be a reset step with no transition in it, which the loop would have to skip.
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e})")
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        fail(f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; DQN handles discrete actions only (e.g. CartPole-v1)")
    if not isinstance(envs.single_observation_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(envs.single_observation_space).__name__} observation space; this script handles Box observations only")
    return envs


def real_next_obs(next_obs, infos):
    """The observation each env reached: `next_obs`, except for envs whose episode just ended,
    where `next_obs` already starts the next episode and the true last one is in infos."""
    if "final_obs" not in infos:
        return next_obs
    real = next_obs.copy()
    for i in np.flatnonzero(infos["_final_obs"]):
        real[i] = infos["final_obs"][i]
    return real


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def crossings(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed going from step - n to step:
    with several envs the counter moves by num_envs at a time."""
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


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, q_state, args):
    checkpoint = {"model": {k: v.detach().cpu() for k, v in q_state.items()}, "args": vars(args)}
    return atomic_save(checkpoint, path)


def load_checkpoint(path, q_network, env_id):
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path!r}: pass --load-model with a file written by --save-model")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    try:
        q_network.load_state_dict(checkpoint["model"])
    except (KeyError, RuntimeError):
        saved_for = checkpoint.get("args", {}).get("env_id", "another env") if isinstance(checkpoint, dict) else "another env"
        fail(f"checkpoint {path!r} holds no Q-network of {env_id}'s sizes (saved for {saved_for}): pass --env-id {saved_for}")


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
    check_args(args)
    num_iterations = args.total_timesteps // args.num_envs
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args, run_name, args.num_envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_network = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, q_network, args.env_id)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(n_obs, n_act, device=device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(args.buffer_size, n_obs)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, logged_step = 0, 0, 0
    loss = old_val = None
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = {k: v.clone() for k, v in q_network.state_dict().items()} if args.save_model else None
    interrupted = False
    stop_reason = None

    obs, _ = envs.reset(seed=args.seed)
    pbar = tqdm.tqdm(total=num_iterations * args.num_envs, disable=num_iterations == 0, file=sys.stderr)
    try:
        for iteration in range(num_iterations):
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
            # One coin per env, so that several envs explore as one env would.
            explore = np.random.random(args.num_envs) < epsilon
            actions = np.random.randint(n_act, size=args.num_envs)
            if not explore.all():
                q_values = q_network(torch.Tensor(obs).to(device).flatten(1))
                actions = np.where(explore, actions, torch.argmax(q_values, dim=1).cpu().numpy())

            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs

            if "final_info" in infos:
                final = infos["final_info"]
                for episodic_return in final["episode"]["r"][final["_episode"]]:
                    recent_returns.append(float(episodic_return))
                    if wandb is not None:
                        wandb.log({"charts/episodic_return": episodic_return}, step=global_step)

            # The done flag is the termination only: a time-limit truncation still bootstraps
            # from the true last observation (see make_envs for the autoreset).
            rb.add(obs, real_next_obs(next_obs, infos), actions, rewards, terminations)
            obs = next_obs

            if global_step > args.learning_starts:
                for _ in range(crossings(global_step, args.num_envs, args.train_frequency)):
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

                if crossings(global_step, args.num_envs, args.target_network_frequency):
                    for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                        target_network_param.data.copy_(args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data)

            if crossings(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                if loss is not None and not math.isfinite(loss.item()):
                    stop_reason = f"non-finite td_loss {loss.item()} at step {global_step}"
                    break
                if args.save_model:
                    last_good = {k: v.clone() for k, v in q_network.state_dict().items()}
                if warmup_s is None and updates >= WARMUP_UPDATES:
                    warmup_s = time.perf_counter() - start_time
                    warm_step, warm_time = global_step, time.perf_counter()
                sps = (global_step - warm_step) / max(time.perf_counter() - warm_time, 1e-9) if warmup_s is not None and global_step > warm_step else float("nan")
                mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
                pbar.update(global_step - logged_step)
                logged_step = global_step
                pbar.set_description(f"sps={sps:6.0f} return={mean_return:8.2f}")
                if recent_returns:
                    curve.append((global_step, round(time.perf_counter() - start_time, 3), round(mean_return, 3)))
                if wandb is not None:
                    log = {"charts/epsilon": epsilon, "charts/SPS": sps}
                    if loss is not None:
                        log.update({"losses/td_loss": loss.item(), "losses/q_values": old_val.mean().item()})
                    wandb.log(log, step=global_step)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        pbar.close()
    if interrupted:
        print(f"notice: interrupted at step {global_step}; saving what there is", file=sys.stderr)

    end_time = time.perf_counter()
    saved = None
    if args.save_model:
        # The state at the last log point with a finite loss, if the run stopped on a non-finite one.
        saved = save_checkpoint(checkpoint_path, last_good if stop_reason else q_network.state_dict(), args)
        print(f"notice: model saved to {saved}", file=sys.stderr)
    eval_return = None
    if args.eval_episodes > 0 and stop_reason is None:
        eval_return = evaluate(q_network, args, run_name, device)
    envs.close()

    summary = {
        "script": os.path.basename(__file__),
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": False,
        "cudagraphs": False,
        "device": device.type,
        "total_steps": global_step,
        "wall_s": round(end_time - start_time, 3),
        "sps": round((global_step - warm_step) / (end_time - warm_time), 1) if warmup_s is not None and global_step > warm_step else None,
        "warmup_s": round(warmup_s, 3) if warmup_s is not None else None,
        "episodic_return": float(np.mean(recent_returns)) if recent_returns else None,
        "updates": updates,
        "eval_return": eval_return,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "interrupted": interrupted,
        "checkpoint": saved,
        "curve": curve[:: max(1, len(curve) // 200)],
    }
    if wandb is not None:
        wandb.finish()
    print(json.dumps(summary), flush=True)
    if stop_reason:
        fail(stop_reason)


def parse_args() -> Args:
    """tyro's command line, where a boolean is a flag (`--compile`, `--no-cuda`), also taking
    the spelling `--cuda false` or `--cuda=False`."""
    flags = {"--" + name.replace("_", "-") for name, kind in Args.__annotations__.items() if kind is bool}
    argv = []
    for arg in sys.argv[1:]:
        flag, eq, value = arg.partition("=")
        if not eq and argv and argv[-1] in flags and arg.lower() in ("true", "false"):
            flag, value = argv.pop(), arg
        if flag in flags and value.lower() in ("true", "false"):
            arg = flag if value.lower() == "true" else "--no-" + flag[2:]
        argv.append(arg)
    return tyro.cli(Args, args=argv)


if __name__ == "__main__":
    main(parse_args())

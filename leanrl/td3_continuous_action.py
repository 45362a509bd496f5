"""TD3 for continuous actions, plain PyTorch in the CleanRL style: the baseline.

Twin Delayed Deep Deterministic policy gradient (Fujimoto et al., 2018,
https://arxiv.org/abs/1802.09477): clipped double-Q learning with twin critics, delayed policy
and target updates, and target policy smoothing. The defaults and the learning are those of
CleanRL's `td3_continuous_action.py`. Same defaults and the same learning as the lean script
`td3_continuous_action_torchcompile.py`, which is the same algorithm made fast; this file is
what the speed-ups are measured against.

    python leanrl/td3_continuous_action.py
    python leanrl/td3_continuous_action.py --env-id Hopper-v5
    python leanrl/td3_continuous_action.py --num-envs 4
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
from typing import NamedTuple

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
    """the batch size of sample from the reply memory"""
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


def fail(message: str):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    if args.num_envs < 1:
        fail(f"--num-envs {args.num_envs} must be at least 1")
    if args.policy_frequency < 1:
        fail(f"--policy-frequency {args.policy_frequency} must be at least 1 (the actor is updated every that many updates)")
    if args.batch_size < 1:
        fail(f"--batch-size {args.batch_size} must be at least 1")
    if args.batch_size > args.learning_starts:
        fail(f"--batch-size {args.batch_size} is larger than --learning-starts {args.learning_starts}: the first update would sample more transitions than the buffer holds; lower --batch-size or raise --learning-starts")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size}) and one step of every env (--num-envs {args.num_envs})")
    if args.env_id not in gym.registry:
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. HalfCheetah-v5")


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
    if capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL=glfw or
        # osmesa set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")
    thunks = [make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: the step that ends an episode already returns the first
        # observation of the next one, and the true final observation is in infos["final_obs"].
        # Every step is then one real transition, stored with the final observation as its next
        # observation (see `real_next_obs`). Under the NEXT_STEP default the step after a done
        # would be a reset step whose (obs, next_obs) pair spans two episodes.
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; TD3 handles continuous (Box) actions only")
    if not isinstance(envs.single_observation_space, gym.spaces.Box) or len(envs.single_observation_space.shape) != 1:
        fail(f"{args.env_id} has observations of type {type(envs.single_observation_space).__name__}; this script handles flat Box observations only")
    return envs


def real_next_obs(next_obs, infos):
    """The observation each env reached: the final one where an episode ended on this step.

    Under SAME_STEP autoreset `next_obs` already starts the next episode there; storing it would
    make a transition that spans two episodes. Termination and truncation both qualify: a
    truncated transition bootstraps from its true final observation."""
    if "_final_obs" in infos:
        next_obs = next_obs.copy()
        done = infos["_final_obs"]
        next_obs[done] = np.stack(infos["final_obs"][done])
    return next_obs


class ReplayBufferSamples(NamedTuple):
    observations: torch.Tensor
    actions: torch.Tensor
    next_observations: torch.Tensor
    dones: torch.Tensor
    rewards: torch.Tensor


class ReplayBuffer:
    """A ring buffer of transitions in host memory, sampled uniformly, as CleanRL's (SB3's)."""

    def __init__(self, buffer_size, n_obs, n_act, device):
        self.buffer_size, self.device = buffer_size, device
        self.observations = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.next_observations = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.actions = np.zeros((buffer_size, n_act), dtype=np.float32)
        self.rewards = np.zeros(buffer_size, dtype=np.float32)
        # Terminations only: a truncated episode is not done, its next state has a value.
        self.dones = np.zeros(buffer_size, dtype=np.float32)
        self.pos, self.size = 0, 0

    def add(self, obs, next_obs, actions, rewards, terminations):
        rows = (self.pos + np.arange(len(obs))) % self.buffer_size
        self.observations[rows] = obs
        self.next_observations[rows] = next_obs
        self.actions[rows] = actions
        self.rewards[rows] = rewards
        self.dones[rows] = terminations
        self.pos = (self.pos + len(obs)) % self.buffer_size
        self.size = min(self.size + len(obs), self.buffer_size)

    def sample(self, batch_size):
        idx = np.random.randint(0, self.size, size=batch_size)
        return ReplayBufferSamples(
            *(torch.as_tensor(a[idx]).to(self.device) for a in (self.observations, self.actions, self.next_observations, self.dones, self.rewards))
        )


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


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, networks, args):
    """`networks` maps "actor", "qf1", "qf2" to state dicts: the format the lean script writes too."""
    checkpoint = {name: {k: v.detach().cpu() for k, v in state.items()} for name, state in networks.items()}
    checkpoint["args"] = vars(args)
    return atomic_save(checkpoint, path)


def load_checkpoint(path, modules):
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path!r}: pass --load-model with a file written by --save-model")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    missing = [name for name in modules if name not in checkpoint]
    if missing:
        fail(f"{path!r} is not a TD3 checkpoint (it lacks {', '.join(missing)})")
    try:
        for name, module in modules.items():
            module.load_state_dict(checkpoint[name])
    except RuntimeError:
        saved_for = checkpoint.get("args", {}).get("env_id")
        fail(f"{path!r} holds networks of other sizes (saved for {saved_for}); pass the --env-id it was trained on")


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
    check_args(args)
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args, run_name, args.num_envs, args.capture_video)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    low, high = envs.single_action_space.low, envs.single_action_space.high

    actor = Actor(n_obs, n_act, low, high, device=device)
    qf1 = QNetwork(n_obs, n_act, device=device)
    qf2 = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, {"actor": actor, "qf1": qf1, "qf2": qf2})
    qf1_target = QNetwork(n_obs, n_act, device=device)
    qf2_target = QNetwork(n_obs, n_act, device=device)
    target_actor = Actor(n_obs, n_act, low, high, device=device)
    target_actor.load_state_dict(actor.state_dict())
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.learning_rate)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.learning_rate)
    action_low = torch.as_tensor(low, dtype=torch.float32, device=device)
    action_high = torch.as_tensor(high, dtype=torch.float32, device=device)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)

    def networks():
        return {"actor": actor.state_dict(), "qf1": qf1.state_dict(), "qf2": qf2.state_dict()}

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, next_log = 0, 0, 0
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = None
    interrupted = False
    stop_reason = None
    actor_loss = torch.zeros((), device=device)

    try:
        obs, _ = envs.reset(seed=args.seed)
    except gym.error.DependencyNotInstalled as e:
        # RecordVideo renders the first frame here: an env that cannot render fails now.
        fail(f"{args.env_id} cannot render for --capture-video: {e}")
    pbar = tqdm.tqdm(total=args.total_timesteps, disable=args.total_timesteps == 0, file=sys.stderr)
    try:
        while global_step < args.total_timesteps:
            if global_step < args.learning_starts:
                actions = envs.action_space.sample()
            else:
                with torch.no_grad():
                    actions = actor(torch.Tensor(obs).to(device))
                    # One draw per env (CleanRL's torch.normal(0, scale) draws one for all envs).
                    actions += torch.randn_like(actions) * actor.action_scale * args.exploration_noise
                    actions = actions.cpu().numpy().clip(low, high)

            next_obs, rewards, terminations, truncations, infos = envs.step(actions)

            if "final_info" in infos:
                final = infos["final_info"]
                for episodic_return, episodic_length in zip(final["episode"]["r"][final["_episode"]], final["episode"]["l"][final["_episode"]]):
                    recent_returns.append(float(episodic_return))
                    if wandb is not None:
                        wandb.log({"charts/episodic_return": episodic_return, "charts/episodic_length": episodic_length}, step=global_step)

            # Stored `dones` are the terminations only: a truncated episode bootstraps from the
            # value of its final observation.
            rb.add(obs, real_next_obs(next_obs, infos), actions, rewards, terminations)
            obs = next_obs
            global_step += args.num_envs
            pbar.update(args.num_envs)

            if global_step > args.learning_starts:
                data = rb.sample(args.batch_size)
                with torch.no_grad():
                    clipped_noise = (torch.randn_like(data.actions, device=device) * args.policy_noise).clamp(
                        -args.noise_clip, args.noise_clip
                    ) * target_actor.action_scale

                    next_state_actions = (target_actor(data.next_observations) + clipped_noise).clamp(action_low, action_high)
                    qf1_next_target = qf1_target(data.next_observations, next_state_actions)
                    qf2_next_target = qf2_target(data.next_observations, next_state_actions)
                    min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
                    next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * args.gamma * (min_qf_next_target).view(-1)

                qf1_a_values = qf1(data.observations, data.actions).view(-1)
                qf2_a_values = qf2(data.observations, data.actions).view(-1)
                qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
                qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
                qf_loss = qf1_loss + qf2_loss

                q_optimizer.zero_grad()
                qf_loss.backward()
                q_optimizer.step()
                updates += 1

                # Counted in updates, not env steps, so that --num-envs keeps the delay.
                if updates % args.policy_frequency == 0:
                    actor_loss = -qf1(data.observations, actor(data.observations)).mean()
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

                if global_step >= next_log:
                    next_log = global_step + 100
                    losses = {
                        "losses/qf1_values": qf1_a_values.mean().item(),
                        "losses/qf2_values": qf2_a_values.mean().item(),
                        "losses/qf1_loss": qf1_loss.item(),
                        "losses/qf2_loss": qf2_loss.item(),
                        "losses/qf_loss": qf_loss.item() / 2.0,
                        "losses/actor_loss": actor_loss.item(),
                    }
                    bad = [k for k in ("losses/qf_loss", "losses/actor_loss") if not math.isfinite(losses[k])]
                    if bad:
                        stop_reason = f"non-finite {bad[0].split('/')[1]} {losses[bad[0]]} at step {global_step}"
                        break
                    if args.save_model:
                        last_good = {name: {k: v.clone() for k, v in state.items()} for name, state in networks().items()}
                    if warmup_s is None and updates >= 2 * args.policy_frequency:
                        warmup_s = time.perf_counter() - start_time
                        warm_step, warm_time = global_step, time.perf_counter()
                    sps = (global_step - warm_step) / max(time.perf_counter() - warm_time, 1e-9) if warmup_s is not None and global_step > warm_step else float("nan")
                    mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
                    pbar.set_description(f"sps={sps:6.0f} return={mean_return:8.2f}")
                    if recent_returns:
                        curve.append((global_step, round(time.perf_counter() - start_time, 3), round(mean_return, 3)))
                    if wandb is not None:
                        wandb.log({**losses, "charts/SPS": sps}, step=global_step)
    except KeyboardInterrupt:
        interrupted = True
        print(f"notice: interrupted at step {global_step}; saving what there is", file=sys.stderr)
    finally:
        pbar.close()

    end_time = time.perf_counter()
    saved = None
    if args.save_model:
        # The weights at the last log point whose losses were finite, if the run stopped on a non-finite one.
        saved = save_checkpoint(checkpoint_path, last_good if stop_reason and last_good else networks(), args)
        print(f"notice: model saved to {saved}", file=sys.stderr)
    eval_return = None
    if args.eval_episodes > 0 and stop_reason is None:
        eval_return = evaluate(actor, args, run_name, device)
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
    """tyro's command line, where a boolean is a flag (`--compile`, `--no-autotune`), also taking
    the spelling `--autotune false` or `--autotune=False`."""
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

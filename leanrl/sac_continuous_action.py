"""SAC for continuous actions, plain PyTorch in the CleanRL style: the baseline.

Soft Actor-Critic (Haarnoja et al., 2018, https://arxiv.org/abs/1801.01290, with the automatic
entropy tuning of https://arxiv.org/abs/1812.05905) with the details and defaults of CleanRL's
`sac_continuous_action.py`: twin Q-networks with Polyak-averaged targets, a tanh-squashed
Gaussian policy updated every `policy_frequency` steps (that many times, to make up for the
delay), and a numpy replay buffer on the host. Same defaults and the same learning as the lean
script `sac_continuous_action_torchcompile.py`; this file is what its speed is measured against.

    python leanrl/sac_continuous_action.py
    python leanrl/sac_continuous_action.py --env-id Pendulum-v1 --total-timesteps 20000
    python leanrl/sac_continuous_action.py --no-autotune --alpha 0.1
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
    """the batch size of sample from the reply memory"""
    learning_starts: int = 5_000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    """the frequency of updates for the target nerworks"""
    alpha: float = 0.2
    """Entropy regularization coefficient."""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""


# CleanRL logs the losses every 100 environment steps.
LOG_EVERY = 100


def fail(message: str):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    if args.num_envs < 1:
        fail(f"--num-envs {args.num_envs}: needs at least 1")
    if args.batch_size < 1:
        fail(f"--batch-size {args.batch_size}: needs at least 1")
    if args.batch_size > args.learning_starts:
        fail(f"--batch-size {args.batch_size} is larger than --learning-starts {args.learning_starts}: the first update needs a full batch of stored transitions")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must hold at least --batch-size ({args.batch_size}) and --num-envs ({args.num_envs}) transitions")
    if args.policy_frequency < 1:
        fail(f"--policy-frequency {args.policy_frequency}: needs at least 1 (the policy is updated every that many steps)")
    if args.target_network_frequency < 1:
        fail(f"--target-network-frequency {args.target_network_frequency}: needs at least 1")
    if args.env_id not in gym.registry:
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. HalfCheetah-v5")
    if args.capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL=glfw or
        # osmesa set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")


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


def make_envs(args, run_name, num_envs):
    """The vector env, or one clear line for an env this script cannot use."""
    thunks = [make_env(args.env_id, i, args.capture_video, run_name) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: the step that ends an episode returns the first observation of the
        # next one, and the true last observation in infos["final_obs"]. The loop stores the
        # latter as that transition's next observation, so every stored transition is a real
        # one. Under the NEXT_STEP default the step after a done would be a reset step whose
        # (last obs, ignored action, first obs) would have to be kept out of the buffer.
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; this script handles continuous (Box) actions only")
    return envs


def transition_next_obs(next_obs, infos):
    """The next observation of each env's transition. Under SAME_STEP autoreset (see make_envs),
    where an episode ended next_obs already starts the next one; the true last observation is
    infos["final_obs"]. Storing that one keeps every transition inside one episode."""
    if "final_obs" not in infos:
        return next_obs
    real_next_obs = next_obs.copy()
    for i in np.flatnonzero(infos["_final_obs"]):
        real_next_obs[i] = infos["final_obs"][i]
    return real_next_obs


class ReplayBuffer:
    """Transitions in numpy arrays on the host, allocated once, oldest overwritten first (what
    SB3's ReplayBuffer does for CleanRL, without the dependency). Sampled batches are copied to
    the training device."""

    def __init__(self, buffer_size, n_obs, n_act, device):
        self.buffer_size, self.device = buffer_size, device
        self.observations = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.next_observations = np.zeros((buffer_size, n_obs), dtype=np.float32)
        self.actions = np.zeros((buffer_size, n_act), dtype=np.float32)
        self.rewards = np.zeros(buffer_size, dtype=np.float32)
        self.dones = np.zeros(buffer_size, dtype=np.float32)
        self.pos, self.size = 0, 0

    def add(self, obs, next_obs, actions, rewards, dones):
        for i in range(len(obs)):
            self.observations[self.pos] = obs[i]
            self.next_observations[self.pos] = next_obs[i]
            self.actions[self.pos] = actions[i]
            self.rewards[self.pos] = rewards[i]
            self.dones[self.pos] = dones[i]
            self.pos = (self.pos + 1) % self.buffer_size
            self.size = min(self.size + 1, self.buffer_size)

    def sample(self, batch_size):
        idx = np.random.randint(0, self.size, size=batch_size)
        return (
            torch.as_tensor(self.observations[idx], device=self.device),
            torch.as_tensor(self.actions[idx], device=self.device),
            torch.as_tensor(self.next_observations[idx], device=self.device),
            torch.as_tensor(self.rewards[idx], device=self.device),
            torch.as_tensor(self.dones[idx], device=self.device),
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
        self.register_buffer("action_scale", torch.tensor((action_high - action_low) / 2.0, dtype=torch.float32, device=device))
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


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, state, args):
    """Per-network state dicts on the CPU, the same format for the plain and the lean script."""
    checkpoint = {name: {k: v.detach().cpu().clone() for k, v in sd.items()} for name, sd in state.items() if name != "log_alpha"}
    checkpoint["log_alpha"] = state["log_alpha"].detach().cpu().clone()
    checkpoint["args"] = vars(args)
    return atomic_save(checkpoint, path)


def load_checkpoint(path):
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path!r}: pass --load-model with a file written by --save-model")
    return torch.load(path, map_location="cpu", weights_only=False)


def evaluate(actor, args, run_name, device):
    """Mean return of the deterministic policy (the squashed mean action) over `eval_episodes`
    episodes on a fresh environment."""
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
    check_args(args)
    num_iterations = args.total_timesteps // args.num_envs
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args, run_name, args.num_envs)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high

    actor = Actor(n_obs, n_act, action_low, action_high, device=device)
    qf1 = SoftQNetwork(n_obs, n_act, device=device)
    qf2 = SoftQNetwork(n_obs, n_act, device=device)
    checkpoint = load_checkpoint(args.load_model) if args.load_model else None
    if checkpoint is not None:
        actor.load_state_dict(checkpoint["actor"])
        qf1.load_state_dict(checkpoint["qf1"])
        qf2.load_state_dict(checkpoint["qf2"])
    qf1_target = SoftQNetwork(n_obs, n_act, device=device)
    qf2_target = SoftQNetwork(n_obs, n_act, device=device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)

    # Automatic entropy tuning
    if args.autotune:
        target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
        log_alpha = torch.zeros(1, requires_grad=True, device=device)
        if checkpoint is not None:
            with torch.no_grad():
                log_alpha.copy_(checkpoint["log_alpha"])
        alpha = log_alpha.exp().item()
        a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    else:
        alpha = args.alpha
        log_alpha = torch.full((1,), math.log(alpha), device=device)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)

    def state():
        return {"actor": actor.state_dict(), "qf1": qf1.state_dict(), "qf2": qf2.state_dict(), "log_alpha": log_alpha}

    def snapshot():
        return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v.detach().clone()) for k, v in state().items()}

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, next_log, logged_step = 0, 0, LOG_EVERY, 0
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = snapshot() if args.save_model else None
    interrupted = False
    stop_reason = None

    obs, _ = envs.reset(seed=args.seed)
    pbar = tqdm.tqdm(total=num_iterations * args.num_envs, disable=num_iterations == 0, file=sys.stderr)
    try:
        for _ in range(num_iterations):
            if global_step < args.learning_starts:
                actions = envs.action_space.sample()
            else:
                actions, _, _ = actor.get_action(torch.Tensor(obs).to(device))
                actions = actions.detach().cpu().numpy()

            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs

            if "final_info" in infos:
                final = infos["final_info"]
                for i in np.flatnonzero(final["_episode"]):
                    recent_returns.append(float(final["episode"]["r"][i]))
                    if wandb is not None:
                        wandb.log({"charts/episodic_return": final["episode"]["r"][i], "charts/episodic_length": final["episode"]["l"][i]}, step=global_step)

            # Only a termination cuts the bootstrap: a truncated episode (time limit) is
            # bootstrapped from its true final observation.
            rb.add(obs, transition_next_obs(next_obs, infos), actions, rewards, terminations)
            obs = next_obs

            if global_step >= args.learning_starts:
                data_obs, data_actions, data_next_obs, data_rewards, data_dones = rb.sample(args.batch_size)
                with torch.no_grad():
                    next_state_actions, next_state_log_pi, _ = actor.get_action(data_next_obs)
                    qf1_next_target = qf1_target(data_next_obs, next_state_actions)
                    qf2_next_target = qf2_target(data_next_obs, next_state_actions)
                    min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                    next_q_value = data_rewards.flatten() + (1 - data_dones.flatten()) * args.gamma * (min_qf_next_target).view(-1)

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
                    for _ in range(args.policy_frequency):  # compensate for the delay by doing 'actor_update_interval' instead of 1
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

            if global_step < next_log:
                continue
            next_log = (global_step // LOG_EVERY + 1) * LOG_EVERY
            pbar.update(global_step - logged_step)
            logged_step = global_step
            losses = {}
            if updates > 0:
                losses = {"qf_loss": qf_loss.item(), "qf1_loss": qf1_loss.item(), "qf2_loss": qf2_loss.item()}
                if updates >= args.policy_frequency:
                    losses["actor_loss"] = actor_loss.item()
                    if args.autotune:
                        losses["alpha_loss"] = alpha_loss.item()
            bad = [name for name, value in losses.items() if not math.isfinite(value)]
            if bad:
                stop_reason = f"non-finite {bad[0]} {losses[bad[0]]} at step {global_step}"
                break
            if args.save_model:
                last_good = snapshot()
            if warmup_s is None and updates >= args.policy_frequency:
                warmup_s = time.perf_counter() - start_time
                warm_step, warm_time = global_step, time.perf_counter()
            sps = (global_step - warm_step) / max(time.perf_counter() - warm_time, 1e-9) if warmup_s is not None and global_step > warm_step else float("nan")
            mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
            pbar.set_description(f"sps={sps:6.0f} return={mean_return:8.2f}")
            if recent_returns:
                curve.append((global_step, round(time.perf_counter() - start_time, 3), round(mean_return, 3)))
            if wandb is not None and updates > 0:
                log = {
                    "losses/qf1_values": qf1_a_values.mean().item(),
                    "losses/qf2_values": qf2_a_values.mean().item(),
                    "losses/qf1_loss": losses["qf1_loss"],
                    "losses/qf2_loss": losses["qf2_loss"],
                    "losses/qf_loss": losses["qf_loss"] / 2.0,
                    "losses/alpha": alpha,
                    "charts/SPS": sps,
                }
                if "actor_loss" in losses:
                    log["losses/actor_loss"] = losses["actor_loss"]
                if "alpha_loss" in losses:
                    log["losses/alpha_loss"] = losses["alpha_loss"]
                wandb.log(log, step=global_step)
    except KeyboardInterrupt:
        interrupted = True
        print(f"notice: interrupted at step {global_step}; saving what there is", file=sys.stderr)
    finally:
        pbar.close()

    end_time = time.perf_counter()
    saved = None
    if args.save_model:
        # The state at the last log point, if the run stopped on a non-finite loss.
        saved = save_checkpoint(checkpoint_path, last_good if stop_reason else state(), args)
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

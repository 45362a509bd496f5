"""DQN, lean: torch.compile, CUDA graphs and tensordict.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the
implementation details and defaults of CleanRL's `dqn.py`: an MLP Q-network, a replay buffer,
a target network, and epsilon-greedy exploration that decays linearly. Same defaults and the
same learning as the plain script `dqn.py`; only the speed differs.

    python leanrl/dqn_torchcompile.py
    python leanrl/dqn_torchcompile.py --compile
    python leanrl/dqn_torchcompile.py --compile --cudagraphs
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
import tqdm
import tyro
from tensordict import TensorDict, from_module
from tensordict.nn import CudaGraphModule
from torch.optim.adam import adam


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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100
# Steps per second are counted from the first log point with this many updates done: by then
# every compiled callable has run, and CudaGraphModule (2 warm-up calls) has captured its graph.
WARMUP_UPDATES = 3
# torch.optim.Adam's defaults, which the plain script uses.
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


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
    """A ring buffer of transitions in tensors preallocated on the device, written in place.

    Steps are staged in host arrays and copied to the device in blocks (when the stage is full,
    and before each update): one copy per field per block instead of one per step. On a CPU a
    torch call costs microseconds, more than the copy; on CUDA each copy is a transfer."""

    def __init__(self, buffer_size, n_obs, stage_rows, device):
        self.storage = TensorDict(
            obs=torch.zeros(buffer_size, n_obs, device=device),
            next_obs=torch.zeros(buffer_size, n_obs, device=device),
            actions=torch.zeros(buffer_size, dtype=torch.long, device=device),
            rewards=torch.zeros(buffer_size, device=device),
            dones=torch.zeros(buffer_size, device=device),
            batch_size=[buffer_size],
            device=device,
        )
        # Plain references to the leaves: a TensorDict lookup costs more than the copy it feeds.
        self.fields = dict(self.storage.items())
        self.stage = {
            key: np.zeros((stage_rows, *value.shape[1:]), dtype=np.int64 if key == "actions" else np.float32)
            for key, value in self.fields.items()
        }
        self.buffer_size, self.stage_rows = buffer_size, stage_rows
        self.pos, self.size, self.pending = 0, 0, 0

    def add(self, obs, next_obs, actions, rewards, dones):
        rows = slice(self.pending, self.pending + len(obs))
        self.stage["obs"][rows] = obs
        self.stage["next_obs"][rows] = next_obs
        self.stage["actions"][rows] = actions
        self.stage["rewards"][rows] = rewards
        self.stage["dones"][rows] = dones
        self.pending += len(obs)
        if self.pending + len(obs) > self.stage_rows:
            self.flush()

    def flush(self):
        """Copy the staged steps into the device storage, in at most two slices per field."""
        n, pos = self.pending, self.pos
        if n == 0:
            return
        first = min(n, self.buffer_size - pos)
        for key, staged in self.stage.items():
            dest = self.fields[key]
            dest[pos : pos + first].copy_(torch.from_numpy(staged[:first]))
            if first < n:
                dest[: n - first].copy_(torch.from_numpy(staged[first:n]))
        self.pos = (pos + n) % self.buffer_size
        self.size = min(self.size + n, self.buffer_size)
        self.pending = 0


def make_policy(q_network, epsilon, n_act):
    """Acting: one epsilon-greedy step for every env. `epsilon` is a 0-d tensor the loop updates
    in place, so a compiled or graphed policy reads the current value without recompiling.

    The layers are applied with F.linear on the Q-network's own parameters (updated in place by
    the update, so always current): for a batch of num_envs observations each nn.Module call
    costs more than the matmul it wraps (a step costs 54 us through the module, 31 us so, on a
    CPU). `test_lean_policy_is_greedy_at_epsilon_zero_and_uniform_at_one` checks that this is the
    module's forward."""
    layers = [(m.weight, m.bias) for m in q_network.network if isinstance(m, nn.Linear)]

    def policy(obs):
        x = obs
        for weight, bias in layers[:-1]:
            x = F.linear(x, weight, bias).relu_()
        q_values = F.linear(x, *layers[-1])
        explore = torch.rand(obs.shape[0], device=obs.device) < epsilon
        random_actions = torch.randint(n_act, (obs.shape[0],), device=obs.device)
        return torch.where(explore, random_actions, q_values.argmax(dim=1))

    return policy


def make_update(q_network, target_network, storage, args, capturable=False):
    """One gradient step on a minibatch gathered from the replay storage at `idx`.

    The gradient comes from torch.func and Adam is torch's own functional `adam` (the code that
    `optim.Adam(foreach=False)` runs), so gather, both forward passes, backward and the optimizer
    step form one graph: `optimizer.step()` would force a graph break. Parameters and Adam's
    state are updated in place; the module's parameters are the same storages."""
    params = {name: p.detach() for name, p in q_network.named_parameters()}
    names = list(params)
    exp_avgs = [torch.zeros_like(p) for p in params.values()]
    exp_avg_sqs = [torch.zeros_like(p) for p in params.values()]
    steps = [torch.zeros((), device=p.device) for p in params.values()]
    buf_obs, buf_next_obs, buf_actions = storage["obs"], storage["next_obs"], storage["actions"]
    buf_rewards, buf_dones = storage["rewards"], storage["dones"]
    gamma, lr = args.gamma, args.learning_rate

    def td_loss(params, obs, actions, td_target):
        q_values = torch.func.functional_call(q_network, params, (obs,))
        old_val = q_values.gather(1, actions.unsqueeze(1)).squeeze(1)
        return F.mse_loss(td_target, old_val), old_val

    def update(idx):
        obs, next_obs, actions = buf_obs[idx], buf_next_obs[idx], buf_actions[idx]
        with torch.no_grad():
            target_max = target_network(next_obs).max(dim=1).values
            td_target = buf_rewards[idx] + gamma * target_max * (1 - buf_dones[idx])
        grads, (loss, old_val) = torch.func.grad_and_value(td_loss, has_aux=True)(params, obs, actions, td_target)
        adam(
            [params[k] for k in names],
            [grads[k] for k in names],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            capturable=capturable,
            amsgrad=False,
            beta1=ADAM_BETAS[0],
            beta2=ADAM_BETAS[1],
            lr=lr,
            weight_decay=0.0,
            eps=ADAM_EPS,
            maximize=False,
        )
        return torch.stack([loss, old_val.mean()]).detach()

    return update


METRICS = ["td_loss", "q_values"]


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
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_envs(args, run_name, args.num_envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_network = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, q_network, args.env_id)
    target_network = QNetwork(n_obs, n_act, device=device)
    q_params, target_params = from_module(q_network).data, from_module(target_network).data
    target_params.copy_(q_params)

    # Whole blocks of train_frequency steps (rounded up to whole vector steps) go to the
    # device at once; never more than the buffer holds.
    stage_steps = max(1, min(-(-args.train_frequency // args.num_envs), args.buffer_size // args.num_envs))
    rb = ReplayBuffer(args.buffer_size, n_obs, stage_steps * args.num_envs, device)

    epsilon = torch.tensor(args.start_e, device=device)
    policy = make_policy(q_network, epsilon, n_act)
    # On CUDA, Adam's step counts live on the device (capturable), so the update never syncs.
    update = make_update(q_network, target_network, rb.storage, args, capturable=device.type == "cuda")
    # What --compile compiles, measured on a 2-core CPU with torch 2.13, one thread, batch 128
    # (see README, DQN):
    # - update: 1.5 ms eager, 0.38 ms compiled (gather, both forwards, backward and Adam become
    #   one graph: 11 matmuls and 9 fused C++ kernels), 0.33 ms with inductor's C++ wrapper,
    #   which drops the Python glue between kernels; compiled on every device, the C++ wrapper
    #   on CPUs only (untested on CUDA here);
    # - policy: 31 us eager, 66 us compiled for one observation on a CPU (the compiled call's
    #   wrappers cost more than fusing ten tiny ops saves), so it is compiled on CUDA only,
    #   where kernel launches dominate.
    if args.compile:
        update = torch.compile(update, options={"cpp_wrapper": True} if device.type == "cpu" else None)
        if device.type == "cuda":
            policy = torch.compile(policy)
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, logged_step = 0, 0, 0
    metrics = None
    epsilon_value = args.start_e
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = q_params.clone() if args.save_model else None
    interrupted = False
    stop_reason = None

    obs_np, _ = envs.reset(seed=args.seed)
    obs_np = obs_np.reshape(args.num_envs, n_obs).astype(np.float32, copy=False)
    pbar = tqdm.tqdm(total=num_iterations * args.num_envs, disable=num_iterations == 0, file=sys.stderr)
    try:
        # Gradients come from torch.func inside the update, which this context does not reach.
        with torch.no_grad():
            for iteration in range(num_iterations):
                epsilon_value = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
                epsilon.copy_(epsilon_value)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
                actions = policy(torch.from_numpy(obs_np).to(device)).cpu().numpy()
                next_obs, rewards, terminations, truncations, infos = envs.step(actions)
                global_step += args.num_envs
                if "final_info" in infos:
                    final = infos["final_info"]
                    recent_returns.extend(final["episode"]["r"][final["_episode"]].tolist())

                # The done flag is the termination only: a time-limit truncation still bootstraps
                # from the true last observation (see make_envs for the autoreset).
                next_obs = next_obs.reshape(args.num_envs, n_obs).astype(np.float32, copy=False)
                rb.add(obs_np, real_next_obs(next_obs, infos), actions, rewards, terminations)
                obs_np = next_obs

                if global_step > args.learning_starts:
                    todo = crossings(global_step, args.num_envs, args.train_frequency)
                    if todo:
                        rb.flush()
                    for _ in range(todo):
                        # The gather itself happens inside the (compiled) update, fused with the
                        # forward pass; drawing the indices is one call.
                        idx = torch.randint(rb.size, (args.batch_size,), device=device)
                        if cudagraphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        # The graphed output is overwritten by the next call; only the latest is read.
                        metrics = update(idx)
                        updates += 1

                    if crossings(global_step, args.num_envs, args.target_network_frequency):
                        if args.tau == 1.0:
                            target_params.copy_(q_params)
                        else:
                            target_params.lerp_(q_params, args.tau)

                if crossings(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                    # Logging: the host syncs of this loop are all here.
                    stats = dict(zip(METRICS, metrics.tolist())) if metrics is not None else {}
                    if stats and not math.isfinite(stats["td_loss"]):
                        stop_reason = f"non-finite td_loss {stats['td_loss']} at step {global_step}"
                        break
                    if args.save_model:
                        last_good = q_params.clone()
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
                        log = {f"losses/{k}": v for k, v in stats.items()}
                        log.update({"charts/epsilon": epsilon_value, "charts/SPS": sps})
                        if recent_returns:
                            log["charts/episodic_return"] = mean_return
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
        if stop_reason:
            q_params.copy_(last_good)
        saved = save_checkpoint(checkpoint_path, q_network.state_dict(), args)
        print(f"notice: model saved to {saved}", file=sys.stderr)
    eval_return = None
    if args.eval_episodes > 0 and stop_reason is None:
        eval_return = evaluate(q_network, args, run_name, device)
    envs.close()

    summary = {
        "script": os.path.basename(__file__),
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": args.compile,
        "cudagraphs": cudagraphs,
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

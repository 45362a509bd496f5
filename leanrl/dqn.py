"""DQN, plain PyTorch in the CleanRL style: the baseline.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the details
and defaults of CleanRL's `dqn.py`: an MLP Q-network, a replay buffer, a target network and
linearly decaying epsilon-greedy exploration. The lean script `dqn_torchcompile.py` learns the
same way, faster; this file is what its speed-ups are measured against.

    python leanrl/dqn.py
    python leanrl/dqn.py --env-id Acrobot-v1
"""

import importlib.util
import json
import math
import os
import random
import resource
import signal
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


ALGORITHM = "dqn"
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
    if args.env_id not in gym.registry:
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. CartPole-v1")
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
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        fail(f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; DQN handles discrete actions only (e.g. CartPole-v1)")
    if not isinstance(envs.single_observation_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(envs.single_observation_space).__name__} observation space; this script handles Box observations only")
    return envs


def real_next_obs(next_obs, infos):
    """The observation each env reached: `next_obs`, except where an episode just ended: there
    `next_obs` already starts the next episode and the true last one is in infos."""
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
    """How many multiples of `every` the step counter passed going from step - n to step: with
    several envs the counter moves by num_envs at a time."""
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
        check_memory(buffer_size * (2 * n_obs + 3) * 4, torch.device("cpu"), f"--buffer-size {buffer_size}")
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
        return tuple(torch.as_tensor(x[idx], device=device) for x in (self.obs, self.actions, self.next_obs, self.dones, self.rewards))


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


# ---------------------------------------------------------------- RUN
# The same block in every LeanRL script: argument rules, the run's folder and metrics, signals,
# checkpoints and the summary line. Nothing in it is specific to one algorithm.

# One rule per flag, the same in every script that has the flag.
COUNTS = ("num_seeds", "threads", "num_envs", "num_steps", "num_minibatches", "update_epochs", "batch_size", "buffer_size",
          "train_frequency", "target_network_frequency", "policy_frequency")
RULES = {
    "seed": (lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    **{k: (lambda v: v >= 0, "0 or more") for k in ("total_timesteps", "learning_starts", "eval_episodes")},
    **{k: (lambda v: v >= 1, "1 or more") for k in COUNTS},
    **{k: (lambda v: math.isfinite(v) and v > 0, "a finite number > 0") for k in ("learning_rate", "q_lr", "policy_lr", "max_grad_norm")},
    **{k: (lambda v: 0 < v <= 1, "a number in (0, 1]") for k in ("gamma", "tau")},
    **{k: (lambda v: 0 <= v <= 1, "a number in [0, 1]") for k in ("gae_lambda", "start_e", "end_e", "exploration_fraction")},
    **{k: (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
       for k in ("clip_coef", "ent_coef", "vf_coef", "alpha", "policy_noise", "noise_clip", "exploration_noise")},
    "target_kl": (lambda v: v is None or (math.isfinite(v) and v > 0), "a finite number > 0"),
}


def fail(message):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a stderr cannot split it
    sys.exit(2)


def check_args(args):
    for name, value in vars(args).items():
        if name in RULES and not RULES[name][0](value):
            fail(f"--{name.replace('_', '-')} {value} is out of range: use {RULES[name][1]}")
    if args.total_timesteps == 0 and not args.load_model:
        fail("--total-timesteps 0 trains nothing: give a budget, or --load-model to evaluate a checkpoint")


def check_memory(nbytes, device, what):
    """One line, before any work, for a buffer that will not fit in the device's free memory."""
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if nbytes > free:
        fail(f"{what} needs {nbytes / 2**30:.1f} GiB and {device.type} has {free / 2**30:.1f} GiB free: make it smaller")


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def load_checkpoint(path, networks, env_id):
    """Load a checkpoint of either script of the pair into `networks` (name -> module). Tensors
    and plain types only (weights_only=True): a checkpoint cannot run code."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for a file that is no checkpoint
        fail(f"cannot load {path!r} ({type(e).__name__}): pass a file written by --save-model of {ALGORITHM}")
    saved = checkpoint.get("algorithm") if isinstance(checkpoint, dict) else None
    if saved != ALGORITHM:
        fail(f"{path!r} is not a {ALGORITHM} checkpoint ({saved or 'unknown'}): pass one saved by {ALGORITHM}")
    try:
        for name, network in networks.items():
            network.load_state_dict(checkpoint["model"][name])
    except (KeyError, RuntimeError):
        hint = f"pass --env-id {checkpoint['env_id']}" if checkpoint["env_id"] != env_id else "use the sizes it was trained with"
        fail(f"{path!r} holds {ALGORITHM} networks for {checkpoint['env_id']} of other sizes: {hint}")


class Run:
    """Around the training loop: the folder runs/<run_name> (TensorBoard events when tensorboard
    is installed, curve.csv, the checkpoint), wandb with --track, the progress bar, steps/s after
    warm-up, SIGTERM handled as Ctrl-C, and the one-line JSON summary. Under torchrun only rank 0
    writes, prints, tracks, saves and evaluates.

    --num-seeds: one Run per seed, each with its own folder, checkpoint and wandb run (one group);
    the first is the `lead` of the others: it alone handles SIGTERM, shows the bar and prints the
    summary, all three for every seed, and finishes last."""

    def __init__(self, args, total_steps, warmup_updates=3, rank=0, lead=None):
        self.args, self.warmup_updates, self.main = args, warmup_updates, rank == 0
        self.lead, self.seeds, self.eval_return = lead or self, [self], None
        if lead:
            lead.seeds.append(self)
        self.time = lead.time if lead else int(time.time())
        self.name = f"{args.env_id}__{args.exp_name}__{args.seed}__{self.time}"
        self.dir = f"runs/{self.name}"
        self.wandb = self.writer = self.last_good = self.stop_reason = self.warmup_s = self.last_sps = None
        self.interrupted, self.returns, self.points = False, deque(maxlen=10), []
        self.step = self.updates = self.warm_step = 0
        self.total_steps, self.bar = total_steps, None
        self.start = self.warm_time = time.perf_counter()
        if not lead:
            signal.signal(signal.SIGTERM, self.on_sigterm)
            sys.excepthook = self.on_uncaught
        if not self.main:
            self.curve = open(os.devnull, "w")
            return
        if args.track:
            try:
                import wandb
            except ImportError:
                fail("--track needs wandb: pip install wandb (or the extra leanrl[track])")
            self.wandb = wandb
        try:
            os.makedirs(self.dir, exist_ok=True)
            self.curve = open(f"{self.dir}/curve.csv", "w")
        except OSError as e:
            fail(f"cannot write {self.dir} ({e.strerror}): run from a folder you can write to")
        self.curve.write("step,seconds,episodic_return\n")
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter

            self.writer, self.summary = SummaryWriter(self.dir), Summary
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
        except ImportError:
            if not lead:
                print("notice: tensorboard is not installed; metrics go to --track only (pip install tensorboard)", file=sys.stderr)
        if self.wandb:
            # Several runs live at once only with reinit="create_new" (wandb 0.19.10 or later).
            seeds = {"group": self.lead.name, "reinit": "create_new"} if getattr(args, "num_seeds", 1) > 1 else {}
            self.wandb = self.wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=self.name, save_code=True, **seeds)

    def on_sigterm(self, signum, frame):
        """Schedulers stop jobs with SIGTERM: end the run as Ctrl-C does, saving first."""
        self.interrupted = signal.SIGTERM
        raise KeyboardInterrupt

    def on_uncaught(self, kind, value, traceback):
        """Ctrl-C or SIGTERM outside the training loop (while envs and networks are made): the
        summary and exit status of an interrupted run, not a traceback. One that lands inside an
        import may come as the cause of another error: Python 3.11 wraps what a `__set_name__`
        raises in a RuntimeError, and building a torch optimizer imports torch._dynamo, which
        runs many."""
        interrupt = value
        while interrupt is not None and not isinstance(interrupt, KeyboardInterrupt):
            interrupt = interrupt.__cause__
        if interrupt is None:
            return sys.__excepthook__(kind, value, traceback)
        self.interrupted = self.interrupted or signal.SIGINT
        try:
            self.finish(self.step, self.updates, {}, None)
        except SystemExit as e:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code)

    def scalars(self, step, values):
        """One point of the charts at `step`, written at the next log point (`write`)."""
        self.points.append((step, values))

    def write(self):
        """The points since the last log point, handed to TensorBoard and wandb at once.
        TensorBoard's writer thread takes the GIL for each event it is handed: one at a time (a
        finished episode every few steps in lean PQN) cost 8% of its steps/s, in one go 3%."""
        # Ctrl-C and SIGTERM wait until the writers are done: a KeyboardInterrupt inside
        # TensorBoard's writer can leave it so that close() hangs (tensorboard 2.21).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for step, values in self.points:
                if self.writer:
                    # One event holds all the values: add_scalar writes one per value, and each
                    # costs about 40 us on a CPU (10 metrics at every log point, 2 per episode).
                    summary = self.summary(value=[self.summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
                    self.writer.file_writer.add_summary(summary, step)
                if self.wandb:
                    self.wandb.log(values, step=step)
            self.points.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def episodes(self, step, infos):
        """CleanRL's charts, one point per finished episode."""
        for _, r, n in self.finished(step, infos):
            self.record(step, r, n)

    @staticmethod
    def finished(step, infos):
        """The episodes that ended in `infos`, as (step, return, length), from gymnasium's episode
        statistics (in infos["final_info"] under SAME_STEP autoreset)."""
        info = infos.get("final_info", infos)
        if "episode" not in info:
            return []
        done = info["_episode"]
        return [(step, float(r), int(n)) for r, n in zip(info["episode"]["r"][done], info["episode"]["l"][done])]

    def record(self, step, r, n):
        self.returns.append(r)
        self.scalars(step, {"charts/episodic_return": r, "charts/episodic_length": n})

    def seed_returns(self):
        """Each seed's mean return over its last 10 episodes (None before its first), in seed order."""
        return [float(np.mean(run.returns)) if run.returns else None for run in self.seeds]

    def sps(self):
        if self.warmup_s is None or self.step <= self.warm_step:
            return None
        return (self.step - self.warm_step) / (time.perf_counter() - self.warm_time)

    def log(self, step, updates, metrics, networks):
        """A log point: steps/s (from the first log point with `warmup_updates` updates done, when
        every compiled callable has run), bar, curve, metrics, and the weights as last good if
        they are finite (with --save-model)."""
        self.bar = self.bar or tqdm.tqdm(total=self.total_steps * len(self.seeds), file=sys.stderr, disable=not self.main or self.lead is not self)
        self.bar.update((step - self.step) * len(self.seeds))
        self.step, self.updates, now = step, updates, time.perf_counter()
        if self.warmup_s is None and updates >= self.warmup_updates:
            self.warmup_s, self.warm_step, self.warm_time = now - self.start, step, now
        # The summary's steps/s is the last log point's: closing envs and saving are not training.
        sps = self.last_sps = self.sps()
        mean_return = np.mean(self.returns) if self.returns else float("nan")
        means = [m for m in self.seed_returns() if m is not None]
        self.bar.set_description(f"sps={(sps or float('nan')) * len(self.seeds):6.0f} return={np.mean(means) if means else float('nan'):8.2f}")
        if self.returns:
            self.curve.write(f"{step},{now - self.start:.3f},{mean_return:.3f}\n")
        self.scalars(step, {**metrics, "charts/SPS": sps or 0.0})
        self.write()
        if self.args.save_model:
            state = {name: {k: v.detach().clone() for k, v in net.state_dict().items()} for name, net in networks.items()}
            if torch.stack([v.isfinite().all() for sd in state.values() for v in sd.values()]).all():
                self.last_good = state

    def finish(self, step, updates, networks, evaluate, **fields):
        """Save, evaluate, close and print the summary. Exit 1 after a non-finite loss, 130 after
        Ctrl-C, 143 after SIGTERM; a checkpoint is only ever saved from finite weights."""
        self.step, self.updates = step, updates
        end_sps, wall_s = self.last_sps, time.perf_counter() - self.start
        # A second Ctrl-C or SIGTERM must not break the save or the summary (evaluation aside).
        handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.bar:
            self.bar.close()
        if self.interrupted and self.main and self.lead is self:
            print(f"notice: interrupted at step {self.step}; saving what there is", file=sys.stderr)
        checkpoint, state = None, self.last_good
        if self.args.save_model and self.main and networks:
            current = {name: net.state_dict() for name, net in networks.items()}
            if self.stop_reason is None and all(v.isfinite().all() for sd in current.values() for v in sd.values()):
                state = current
            if state is None:
                print("notice: the weights were never finite at a log point; no checkpoint saved", file=sys.stderr)
            else:
                # A copy: a seed's weights are a view of all seeds' storage, which torch.save writes whole.
                model = {name: {k: v.detach().to("cpu", copy=True) for k, v in sd.items()} for name, sd in state.items()}
                saved = {"algorithm": ALGORITHM, "env_id": self.args.env_id, "args": vars(self.args), "model": model}
                checkpoint = atomic_save(saved, f"{self.dir}/{self.args.exp_name}.pt")
                print(f"notice: model saved to {checkpoint}", file=sys.stderr)
        eval_return = None
        if self.args.eval_episodes > 0 and self.main and self.stop_reason is None and not (self.interrupted or self.lead.interrupted):
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
            try:
                eval_return = evaluate()
            except KeyboardInterrupt:
                self.interrupted = self.interrupted or signal.SIGINT
                self.lead.interrupted = self.lead.interrupted or self.interrupted
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.curve.close()
        self.write()
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()
        self.eval_return = eval_return
        if self.lead is not self:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
            return
        returns, evals = self.seed_returns(), [run.eval_return for run in self.seeds]
        found = [m for m in returns if m is not None]
        per_seed = {"episodic_returns": [None if m is None else round(m, 3) for m in returns],
                    "eval_returns": [None if m is None else round(m, 3) for m in evals]}
        summary = {
            "script": os.path.basename(__file__), "env_id": self.args.env_id, "seed": self.args.seed, "num_seeds": len(self.seeds),
            "compile": getattr(self.args, "compile", False), "cudagraphs": False, **fields,
            "total_steps": self.step, "updates": self.updates, "wall_s": wall_s, "sps": end_sps and end_sps * len(self.seeds),
            "warmup_s": self.warmup_s, "episodic_return": np.mean(found) if found else None,
            **(per_seed if len(self.seeds) > 1 else {}),
            "eval_return": np.mean(evals) if None not in evals else None, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "interrupted": bool(self.interrupted), "checkpoint": checkpoint, "run_dir": self.dir,
        }
        # Strict JSON: non-finite numbers become null.
        summary = {k: (round(float(v), 3) if math.isfinite(v) else None) if isinstance(v, (float, np.floating)) else v for k, v in summary.items()}
        if self.main:
            print(json.dumps(summary), flush=True)
        if self.stop_reason:
            print(f"error: {self.stop_reason}", file=sys.stderr)
            sys.exit(1)
        if self.interrupted:
            sys.exit(143 if self.interrupted == signal.SIGTERM else 130)


def main(args: Args):
    check_args(args)
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    num_iterations = args.total_timesteps // args.num_envs
    run = Run(args, num_iterations * args.num_envs)

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
        load_checkpoint(args.load_model, {"q_network": q_network}, args.env_id)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(n_obs, n_act, device=device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(args.buffer_size, n_obs)

    global_step = updates = 0
    loss = old_val = None
    obs, _ = envs.reset(seed=args.seed)
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
            run.episodes(global_step, infos)

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
                stats = {"losses/td_loss": loss.item(), "losses/q_values": old_val.mean().item()} if loss is not None else {}
                if stats and not math.isfinite(stats["losses/td_loss"]):
                    run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
                    break
                run.log(global_step, updates, {**stats, "charts/epsilon": epsilon}, {"q_network": q_network})
    except KeyboardInterrupt:
        run.interrupted = run.interrupted or signal.SIGINT
    envs.close()
    run.finish(global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, run.name, device), device=device.type)


if __name__ == "__main__":
    main(tyro.cli(Args))

"""DQN, lean: torch.compile, CUDA graphs and tensordict.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the details
and defaults of CleanRL's `dqn.py`: an MLP Q-network, a replay buffer, a target network and
linearly decaying epsilon-greedy exploration. It learns as the plain script `dqn.py` does; what
changes is where the time goes: the replay buffer lives on the training device and is gathered
inside the update, the update (gather, both forward passes, backward, Adam) is one function
that compiles to one graph, acting applies the layers directly (and only on steps where some env
acts greedily: exploration is drawn on the host, 256 steps at once), and nothing syncs the host
with the device between two log points.

    python leanrl/dqn_torchcompile.py
    python leanrl/dqn_torchcompile.py --compile
    python leanrl/dqn_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains N independent agents (seeds seed ... seed+N-1) in one process: their
weights and Adam states stacked on a leading seed dimension, so that acting and the update are
one batched call for all of them, each agent on its own slice of one vector env and its own
column of the replay storage. Seed k is not bit-identical to a single run of seed+k: the agents
share one stream of random numbers for exploration and sampling.
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
from dataclasses import dataclass, replace

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tqdm
import tyro
from tensordict import from_module
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
    num_seeds: int = 1
    """independent agents trained at once, seeds `seed` to `seed + num-seeds - 1` (`total-timesteps` each)"""

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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (see main: one wins beside any other process)"""


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


class SameStepEnvs(gym.vector.SyncVectorEnv):
    """gymnasium's SyncVectorEnv under SAME_STEP autoreset, with a shorter step: the same
    observations, rewards, terminations and truncations, and infos holding only the episode ends
    (final_obs, final_info: all this script reads). gymnasium's generic batching and copies cost
    more than a small env: a step took 10 us against 18.5 (one CartPole), 34 against 49 (four),
    38 against 51 (HalfCheetah); compiled DQN, PQN and PPO runs 8-14% faster."""

    def __init__(self, env_fns):
        super().__init__(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def step(self, actions):
        observations, infos = [], {}
        rewards, terminations, truncations = np.zeros(self.num_envs), np.zeros(self.num_envs, bool), np.zeros(self.num_envs, bool)
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            obs, rewards[i], terminations[i], truncations[i], info = env.step(action)
            if terminations[i] or truncations[i]:
                infos = self._add_info(infos, {"final_obs": obs, "final_info": info}, i)
                obs, _ = env.reset()
            observations.append(obs)
        return np.stack(observations), rewards, terminations, truncations, infos


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
        envs = SameStepEnvs(thunks)
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


def seed_slice(infos, k, num_envs):
    """Seed k's share of a vector env's infos: the values of its sub-envs, k * num_envs onwards."""
    part = slice(k * num_envs, (k + 1) * num_envs)
    return {key: seed_slice(value, k, num_envs) if isinstance(value, dict) else value[part] for key, value in infos.items()}


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


def stack_seeds(networks):
    """The networks' parameters stacked on a leading seed dimension, as flat names -> tensors.
    Each network's parameters become views of its slice, so that it acts, evaluates and saves
    (a state_dict the single-seed script loads) with its seed's current weights."""
    stacked = torch.stack([from_module(net).data for net in networks]).contiguous()
    for k, net in enumerate(networks):
        stacked[k].to_module(net)
    return stacked.flatten_keys(".")


def seeds_q_values(params, x):
    """QNetwork.forward for all seeds at once: x [seeds, rows, n_obs] -> [seeds, rows, n_act],
    one batched matmul per layer over the stacked weights of `stack_seeds`."""
    for i, layer in enumerate(("network.0", "network.2", "network.4")):
        x = torch.baddbmm(params[f"{layer}.bias"].unsqueeze(1), x, params[f"{layer}.weight"].mT)
        x = x.relu() if i < 2 else x
    return x


class ReplayBuffer:
    """Transitions in tensors allocated once on the training device (one per field; `empty`, so
    pages are touched only as the buffer fills, and rows are never read before written), written in
    place and gathered inside the update. Steps are staged in host arrays and copied to the
    device in blocks (when the stage is full, and before each update): one copy per field per
    block, not per step. On a CPU a torch call costs microseconds, more than the copy it makes;
    on CUDA each copy is a transfer."""

    def __init__(self, buffer_size, fields, stage_rows, device):
        # fields: name -> (shape of one row, dtype)
        row_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())
        check_memory(buffer_size * row_bytes, torch.device(device), f"--buffer-size {buffer_size}")
        self.storage = {k: torch.empty(buffer_size, *shape, dtype=dtype, device=device) for k, (shape, dtype) in fields.items()}
        self.stage = {k: np.zeros((stage_rows, *shape), dtype=torch.empty(0, dtype=dtype).numpy().dtype) for k, (shape, dtype) in fields.items()}
        self.buffer_size, self.stage_rows, self.device = buffer_size, stage_rows, device
        self.pos = self.size = self.pending = 0

    def add(self, **rows):
        n = len(next(iter(rows.values())))
        for key, value in rows.items():
            self.stage[key][self.pending : self.pending + n] = value
        self.pending += n
        if self.pending + n > self.stage_rows:
            self.flush()

    def flush(self):
        """Copy the staged steps into the device storage, in at most two slices per field."""
        n, pos = self.pending, self.pos
        if n == 0:
            return
        first = min(n, self.buffer_size - pos)
        for key, staged in self.stage.items():
            dest = self.storage[key]
            dest[pos : pos + first].copy_(torch.from_numpy(staged[:first]))
            if first < n:
                dest[: n - first].copy_(torch.from_numpy(staged[first:n]))
        self.pos, self.size, self.pending = (pos + n) % self.buffer_size, min(self.size + n, self.buffer_size), 0

    def sample(self, batch_size):
        """Indices of a uniform batch, drawn on the device (no host sync; a CUDA graph of the
        update takes them as its input)."""
        self.flush()
        return torch.randint(self.size, (batch_size,), device=self.device)


class Adam:
    """torch.optim.Adam's step as a call on tensors: torch's functional `adam` (the code that
    `optim.Adam.step()` runs) on state kept here. In a compiled update it traces into the one
    graph, where `optimizer.step()` would break it (and, on CUDA, compile once per optimizer).

    `params`: (name, parameter) pairs; their detached views are updated in place, so the modules
    see each step. `lr` may be a 0-d tensor annealed in place. `fused`: one kernel for all the
    tensors, for eager updates. `capturable` (CUDA): the step counts stay on the device, so a
    step never syncs and can be captured in a CUDA graph."""

    def __init__(self, params, lr, eps=1e-8, fused=False, capturable=False):
        self.params = {name: p.detach() for name, p in params}
        self.exp_avgs = [torch.zeros_like(p) for p in self.params.values()]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params.values()]
        self.steps = [torch.zeros((), device=p.device) for p in self.params.values()]
        self.lr, self.eps, self.fused, self.capturable = lr, eps, fused, capturable

    @torch.no_grad()
    def step(self, grads):
        # torch.func may return a gradient in the layout its backward made (transposed for a
        # weight used as `w.mT`); the fused kernel reads it as if laid out like the weight.
        grads = [grads[name].contiguous() for name in self.params]
        adam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
            foreach=False, fused=self.fused or None, capturable=self.capturable,
            amsgrad=False, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False,
        )


def draw_exploration(epsilons, num_envs, n_act, device):
    """Epsilon-greedy's draws for a block of steps at once, [num_steps, num_envs]: whether each
    env explores at each step (a uniform below that step's epsilon) and the random action it would
    take. Two ops per block, not two per step: numpy's draws of a few numbers cost several us each,
    11% of a compiled run on a CPU."""
    explore = torch.rand(len(epsilons), num_envs, device=device) < torch.tensor(epsilons, device=device).unsqueeze(1)
    return explore, torch.randint(n_act, (len(epsilons), num_envs), device=device)


def make_policy(params, num_seeds, host):
    """Acting: for observations [seeds * envs, n_obs] (seed k's envs in block k), the greedy action
    of each under its seed's network (exploration is drawn on the host in the loop, as in dqn.py,
    so a step where every env explores skips the network). `params`: the Q-networks' parameters
    with a leading seed dimension (`stack_seeds`, or one network's unsqueezed).
    `host` (a CPU): numpy in and out, on views of the parameters (`Tensor.numpy()` shares their
    memory, so every Adam step is seen at once), where an op on a few numbers costs under a
    microsecond and a torch op several. In the loop, on a CPU (one thread, between CartPole
    steps): 16 us a step in numpy, 27 us with F.linear; whole compiled runs 1.02-1.28x faster
    (8 interleaved pairs). With no torch call left around it (the observations, actions and
    stacked seeds in numpy too), 1.06-1.23x faster again (4 pairs, AMD EPYC; 8 seeds
    1.08-1.40x, 3 pairs). Else `seeds_q_values` in torch, which CUDA compiles and graphs (the
    loop calls it through `host_arrays`)."""
    if not host:

        def policy(obs):
            return seeds_q_values(params, obs.view(num_seeds, -1, obs.shape[-1])).argmax(dim=2).flatten()

        return policy

    layers = [(params[f"{layer}.weight"].numpy().swapaxes(1, 2), params[f"{layer}.bias"].numpy()[:, None]) for layer in ("network.0", "network.2", "network.4")]

    def host_policy(obs):
        x = obs.reshape(num_seeds, -1, obs.shape[-1])
        for weight_t, bias in layers[:-1]:
            x = x @ weight_t
            x += bias
            np.maximum(x, 0, out=x)
        q = x @ layers[-1][0]
        q += layers[-1][1]
        return q.argmax(2).ravel()

    return host_policy


def host_arrays(policy, device):
    """A device policy as the loop calls it: host observations in, host actions out."""

    def call(obs):
        # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
        return policy(torch.from_numpy(obs).to(device)).cpu().numpy()

    return call


def make_update(q_network, target_network, optimizer, storage, gamma):
    """One gradient step on the minibatch at rows `idx` of the replay storage. The gradient comes
    from torch.func and the step from `Adam`, so that gather, both forward passes, backward and
    Adam form one graph. Returns the metrics as one tensor that stays on the device."""

    def td_loss(params, obs, actions, td_target):
        old_val = torch.func.functional_call(q_network, params, (obs,)).gather(1, actions.unsqueeze(1)).squeeze(1)
        return F.mse_loss(td_target, old_val), old_val

    def update(idx):
        batch = {key: value[idx] for key, value in storage.items()}
        with torch.no_grad():
            target_max = target_network(batch["next_obs"]).max(dim=1).values
            td_target = batch["rewards"] + gamma * target_max * (1 - batch["dones"])
        grads, (loss, old_val) = torch.func.grad_and_value(td_loss, has_aux=True)(optimizer.params, batch["obs"], batch["actions"], td_target)
        optimizer.step(grads)
        return torch.stack([loss, old_val.mean()]).detach()

    return update


def make_seeds_update(params, target_params, optimizer, storage, gamma, num_seeds):
    """make_update for stacked seeds, one graph for all. `idx` holds num_seeds blocks of
    batch_size rows, block k read from seed k's column of the storage ([buffer_size, seeds, ...]).
    The sum of the seeds' losses is differentiated: seed k's part of its gradient is its own loss's
    gradient, and Adam is elementwise, so one step over the stack is num_seeds independent steps.
    Returns the metrics as one [len(METRICS), seeds] tensor."""
    seeds = torch.arange(num_seeds, device=next(iter(storage.values())).device).unsqueeze(1)

    def td_loss(params, obs, actions, td_target):
        old_val = seeds_q_values(params, obs).gather(2, actions.unsqueeze(2)).squeeze(2)
        losses = (td_target - old_val).square().mean(dim=1)
        return losses.sum(), (losses, old_val)

    def update(idx):
        batch = {key: value[idx.view(num_seeds, -1), seeds] for key, value in storage.items()}
        with torch.no_grad():
            target_max = seeds_q_values(target_params, batch["next_obs"]).max(dim=2).values
            td_target = batch["rewards"] + gamma * target_max * (1 - batch["dones"])
        grads, (_, (losses, old_val)) = torch.func.grad_and_value(td_loss, has_aux=True)(optimizer.params, batch["obs"], batch["actions"], td_target)
        optimizer.step(grads)
        return torch.stack([losses, old_val.mean(dim=1)]).detach()

    return update


METRICS = ["losses/td_loss", "losses/q_values"]


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


# The guards torch.compile checks before each call of a compiled function (its guard_filter_fn):
# those that tell one value from another (tensor shapes, dtypes and devices, constants, object
# identities and types, grad mode, the function's own closures), so that an update built again
# with other tensors or hyper-parameters in the same process compiles anew. Dropped: the checks
# that modules, hooks, containers and library functions are as they were, which these scripts
# never change. DQN's compiled update: 188 us a call with every guard, 165 with these, 148 with none.
VALUE_GUARDS = {"TENSOR_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH", "ID_MATCH", "TYPE_MATCH", "GRAD_MODE"}


def value_guards(entries):
    return [entry.guard_type in VALUE_GUARDS or (entry.guard_type == "CLOSURE_MATCH" and not entry.is_global) for entry in entries]


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
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // args.num_envs
    if args.seed + num_seeds > 2**32:
        fail(f"--seed {args.seed} + --num-seeds {num_seeds} passes 2**32: use a smaller seed")
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cpu":
        # One intra-op thread unless --threads says more (2-core CPU, --compile, steps/s with 1
        # and 2 threads): idle, DQN 5,847 and 4,191, PPO 2,139 and 1,995, Atari PQN 196 and 273,
        # Atari PPO 295 and 380; beside one busy process, DQN 4,916 and 1,543, PPO 1,999 and
        # 1,541, Atari PQN 177 and 110, Atari PPO 299 and 168. More threads pay only for the Atari
        # convolutions on an idle machine, and stall every script beside anything else.
        torch.set_num_threads(args.threads)
    if num_seeds > 1:
        # One line before num_seeds x num_envs envs are made: rows of float32 obs and next_obs,
        # an int64 action, a float32 reward and done flag, buffer_size of them per seed.
        probe = make_envs(args, "probe", 1)
        row_bytes = 8 * math.prod(probe.single_observation_space.shape) + 16
        probe.close()
        check_memory(num_seeds * args.buffer_size * row_bytes, device, f"--num-seeds {num_seeds} with --buffer-size {args.buffer_size}")
    run = Run(args, num_iterations * args.num_envs)
    runs = [run] + [Run(replace(args, seed=args.seed + k), run.total_steps, lead=run) for k in range(1, num_seeds)]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    # Sub-env k * num_envs + i is env i of seed k.
    envs = make_envs(args, run.name, num_seeds * args.num_envs, args.capture_video)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_network = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, {"q_network": q_network}, args.env_id)
    target_network = QNetwork(n_obs, n_act, device=device)

    # Blocks of train_frequency steps (whole vector steps, at most the buffer) go to the device at once.
    stage_steps = max(1, min(-(-args.train_frequency // args.num_envs), args.buffer_size // args.num_envs))
    # With several seeds a row holds one transition of each seed: [buffer_size, seeds, ...].
    seed_dim = (num_seeds,) if num_seeds > 1 else ()
    fields = {"obs": ((*seed_dim, n_obs), torch.float32), "next_obs": ((*seed_dim, n_obs), torch.float32),
              "actions": (seed_dim, torch.int64), "rewards": (seed_dim, torch.float32), "dones": (seed_dim, torch.float32)}
    rb = ReplayBuffer(args.buffer_size, fields, stage_steps * args.num_envs, device)

    def rows(x):
        """Per-sub-env values as buffer rows: env i of every seed in row i."""
        return x if num_seeds == 1 else x.reshape(num_seeds, args.num_envs, *x.shape[1:]).swapaxes(0, 1)

    # On CUDA, Adam's step counts live on the device (capturable), so the update never syncs.
    capturable, q_networks = device.type == "cuda", [q_network]
    if num_seeds == 1:
        q_params, target_params = from_module(q_network).data, from_module(target_network).data
        target_params.copy_(q_params)
        optimizer = Adam(q_network.named_parameters(), args.learning_rate, capturable=capturable)
        params = {name: p.detach().unsqueeze(0) for name, p in q_network.named_parameters()}
        update = make_update(q_network, target_network, optimizer, rb.storage, args.gamma)
    else:
        for k in range(1, num_seeds):
            # Seed k starts from the weights a single run of seed + k starts from.
            torch.manual_seed(args.seed + k)
            q_networks.append(QNetwork(n_obs, n_act, device=device))
            if args.load_model:
                load_checkpoint(args.load_model, {"q_network": q_networks[k]}, args.env_id)
        q_params = stack_seeds(q_networks)
        target_params = q_params.clone()
        optimizer = Adam(q_params.items(), args.learning_rate, capturable=capturable)
        params = dict(q_params.items())
        update = make_seeds_update(params, dict(target_params.items()), optimizer, rb.storage, args.gamma, num_seeds)
    policy = make_policy(params, num_seeds, host=device.type == "cpu")
    # What --compile compiles (2-core CPU, torch 2.13, one thread, batch 128):
    # - update: 1.5 ms eager, 0.38 ms compiled (one graph: 11 matmuls and 9 fused kernels),
    #   0.33 ms with inductor's C++ wrapper, which drops the Python glue between kernels (CPU only);
    # - policy: 15-20 us eager, 35 us compiled for one observation on a CPU (the compiled call's
    #   wrappers cost more than fusing eight tiny ops saves): numpy there (make_policy), compiled
    #   on CUDA.
    if args.compile:
        update = torch.compile(update, options={"guard_filter_fn": value_guards, "cpp_wrapper": device.type == "cpu"})
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": value_guards})
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)
    if device.type != "cpu":
        policy = host_arrays(policy, device)

    global_step = updates = 0
    metrics, epsilon = None, args.start_e
    draw_steps = 256  # exploration is drawn for this many vector steps at once
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    obs, _ = envs.reset(seed=[args.seed + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    obs = obs.reshape(num_seeds * args.num_envs, n_obs).astype(np.float32, copy=False)
    try:
        # Gradients come from torch.func inside the update, which this context does not reach.
        with torch.no_grad():
            for iteration in range(num_iterations):
                step = iteration % draw_steps
                if step == 0:
                    # Drawn on the host, where the env is: a step where every env explores skips the network.
                    epsilons = [linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step + args.num_envs * t)
                                for t in range(draw_steps)]
                    explore, random_actions = (x.numpy() for x in draw_exploration(epsilons, num_seeds * args.num_envs, n_act, "cpu"))
                epsilon, actions = epsilons[step], random_actions[step]
                if not explore[step].all():
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    actions = np.where(explore[step], actions, policy(obs))
                next_obs, rewards, terminations, truncations, infos = envs.step(actions)
                global_step += args.num_envs
                if num_seeds == 1:
                    run.episodes(global_step, infos)
                elif "final_info" in infos:
                    for k, seed_run in enumerate(runs):
                        seed_run.episodes(global_step, seed_slice(infos["final_info"], k, args.num_envs))

                # The done flag is the termination only: a time-limit truncation still bootstraps
                # from the true last observation (see make_envs for the autoreset).
                next_obs = next_obs.reshape(num_seeds * args.num_envs, n_obs).astype(np.float32, copy=False)
                rb.add(obs=rows(obs), next_obs=rows(real_next_obs(next_obs, infos)), actions=rows(actions), rewards=rows(rewards), dones=rows(terminations))
                obs = next_obs

                if global_step > args.learning_starts:
                    for _ in range(crossings(global_step, args.num_envs, args.train_frequency)):
                        idx = rb.sample(num_seeds * args.batch_size)
                        if cudagraphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        # The graphed output is overwritten by the next call; only the latest is read.
                        metrics = update(idx)
                        updates += 1
                    if crossings(global_step, args.num_envs, args.target_network_frequency):
                        target_params.lerp_(q_params, args.tau)

                if crossings(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                    # note: the loop's only host sync is here, at the log points
                    seed_stats = [dict(zip(METRICS, values)) for values in metrics.view(len(METRICS), -1).T.tolist()] if metrics is not None else [{}] * num_seeds
                    diverged = [k for k, stats in enumerate(seed_stats) if stats and not math.isfinite(stats["losses/td_loss"])]
                    if diverged:
                        k, which = diverged[0], f" (seed {args.seed + diverged[0]})" if num_seeds > 1 else ""
                        for seed_run in runs:
                            seed_run.stop_reason = f"non-finite td_loss {seed_stats[k]['losses/td_loss']} at step {global_step}{which}"
                        break
                    for seed_run, stats, net in zip(runs, seed_stats, q_networks):
                        seed_run.log(global_step, updates, {**stats, "charts/epsilon": epsilon}, {"q_network": net})
    except KeyboardInterrupt:
        for seed_run in runs:
            seed_run.interrupted = run.interrupted or signal.SIGINT
    envs.close()
    # The lead finishes last: its summary reports every seed.
    for seed_run, net in reversed(list(zip(runs, q_networks))):
        seed_run.finish(global_step, updates, {"q_network": net}, lambda: evaluate(net, seed_run.args, seed_run.name, device), device=device.type, cudagraphs=cudagraphs)


if __name__ == "__main__":
    main(tyro.cli(Args))

"""TD3 for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

Twin Delayed Deep Deterministic policy gradient (Fujimoto et al., 2018,
https://arxiv.org/abs/1802.09477) with the details and defaults of CleanRL's
`td3_continuous_action.py`: clipped double-Q learning with twin critics, delayed policy and
target updates, and target policy smoothing. It learns as the plain script
`td3_continuous_action.py` does; what changes is where the time goes: the replay buffer lives on
the training device and is gathered inside the update, the twin critics run as one batched
network, each update (gather, target, both losses, backward, Adam) is one function that compiles
to one graph, the targets move by one lerp_, and nothing syncs the host with the device between
two log points.

    python leanrl/td3_continuous_action_torchcompile.py
    python leanrl/td3_continuous_action_torchcompile.py --compile
    python leanrl/td3_continuous_action_torchcompile.py --compile --cudagraphs
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
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
import tqdm
import tyro
from tensordict import TensorDict, from_module, from_modules
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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (see main: one wins beside any other process)"""


ALGORITHM = "td3_continuous_action"
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
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. HalfCheetah-v5")
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
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; TD3 handles continuous (Box) actions only")
    if not isinstance(envs.single_observation_space, gym.spaces.Box) or len(envs.single_observation_space.shape) != 1:
        fail(f"{args.env_id} has observations of type {type(envs.single_observation_space).__name__}; this script handles flat Box observations only")
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


def crossings(step: int, n: int, every: int) -> int:
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


def critic(params, x):
    """Both critics at once from their stacked (2, ...) parameters: x is (batch, n_obs + n_act),
    the result (2, batch, 1); one batched matmul with its bias per layer.

    `torch.vmap` over `torch.func.functional_call` computes the same thing; on a 2-core CPU
    (torch 2.13, one thread, CPU time, median of 3) a whole TD3 update took 9.9 ms with vmap,
    7.9 ms written out like this, 9.2 ms for the plain script's two separate networks: vmap
    batches each linear as a bmm plus a separate bias add, and dispatches per op."""
    h = torch.baddbmm(params["fc1.bias"].unsqueeze(1), x.expand(2, *x.shape), params["fc1.weight"].mT).relu()
    h = torch.baddbmm(params["fc2.bias"].unsqueeze(1), h, params["fc2.weight"].mT).relu()
    return torch.baddbmm(params["fc3.bias"].unsqueeze(1), h, params["fc3.weight"].mT)


def first_critic(params, x):
    """The first critic alone from the stacked parameters: QNetwork.forward on slice 0."""
    h = F.linear(x, params["fc1.weight"][0], params["fc1.bias"][0]).relu()
    h = F.linear(h, params["fc2.weight"][0], params["fc2.bias"][0]).relu()
    return F.linear(h, params["fc3.weight"][0], params["fc3.bias"][0])


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


def make_policy(actor, exploration_noise, action_low, action_high):
    """Acting: the deterministic action plus Gaussian exploration noise, drawn on the device.
    `actor` runs on detached views of the trained parameters: no autograd bookkeeping per step,
    and every Adam step is seen at once."""

    def policy(obs):
        action = actor(obs)
        action = action + torch.randn_like(action) * actor.action_scale * exploration_noise
        return action.clamp(action_low, action_high)

    return policy


def make_update(actor, target_actor, q_optimizer, actor_optimizer, q_target_params, storage, action_bounds, args):
    """The two update steps on the minibatch at rows `idx` of the replay storage: the critics
    only, and the critics then the actor (every `policy_frequency`-th). Two functions rather than
    one with a flag: under torch.compile a flag would recompile the same code for its second
    value. Gradients come from torch.func and the steps from `Adam`, so that each update (gather,
    target, losses, backward, Adam) is one graph. Returns the metrics as one tensor that stays on
    the device, in the order of METRICS."""
    gamma, policy_noise, noise_clip = args.gamma, args.policy_noise, args.noise_clip
    action_low, action_high = action_bounds
    # What torch.func differentiates with respect to: the detached parameters that Adam updates
    # in place (the modules' parameters share their storage).
    q_params, actor_params = q_optimizer.params, actor_optimizer.params

    def critic_loss(params, obs_actions, next_q_value):
        qf_a_values = critic(params, obs_actions).view(2, -1)
        qf_losses = (qf_a_values - next_q_value).pow(2).mean(1)
        return qf_losses.sum(), torch.cat([qf_a_values.mean(1), qf_losses, qf_losses.mean().view(1)]).detach()

    def actor_loss(params, obs):
        # The first critic after its step, as in CleanRL; its parameters are constants here, so
        # only the gradient with respect to the action flows back.
        return -first_critic(q_params, torch.cat([obs, torch.func.functional_call(actor, params, (obs,))], 1)).mean()

    critic_grad = torch.func.grad(critic_loss, has_aux=True)
    actor_grad = torch.func.grad_and_value(actor_loss)

    def critic_step(idx):
        batch = {key: value[idx] for key, value in storage.items()}
        with torch.no_grad():
            clipped_noise = (torch.randn_like(batch["actions"]) * policy_noise).clamp(-noise_clip, noise_clip) * target_actor.action_scale
            next_state_actions = (target_actor(batch["next_obs"]) + clipped_noise).clamp(action_low, action_high)
            min_qf_next_target = critic(q_target_params, torch.cat([batch["next_obs"], next_state_actions], 1)).amin(0).view(-1)
            next_q_value = batch["rewards"] + (1 - batch["dones"]) * gamma * min_qf_next_target
        grads, metrics = critic_grad(q_params, torch.cat([batch["obs"], batch["actions"]], 1), next_q_value)
        q_optimizer.step(grads)
        return batch["obs"], metrics

    def update_critic(idx):
        return critic_step(idx)[1]

    def update_critic_and_actor(idx):
        obs, metrics = critic_step(idx)
        grads, loss = actor_grad(actor_params, obs)
        actor_optimizer.step(grads)
        return torch.cat([metrics, loss.detach().view(1)])

    return update_critic, update_critic_and_actor


METRICS = ["losses/qf1_values", "losses/qf2_values", "losses/qf1_loss", "losses/qf2_loss", "losses/qf_loss", "losses/actor_loss"]


def evaluate(actor, args, run_name, device):
    """Mean return of the deterministic policy (no exploration noise) over `eval_episodes` episodes."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            action = actor(torch.as_tensor(obs, device=device, dtype=torch.float))
            obs, _, _, _, infos = eval_envs.step(action.cpu().numpy())
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
    if args.num_envs > args.buffer_size:
        fail(f"--num-envs {args.num_envs} is larger than --buffer-size {args.buffer_size}: make the buffer hold one step of every env")
    num_iterations = args.total_timesteps // args.num_envs
    run = Run(args, num_iterations * args.num_envs)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cpu":
        # One intra-op thread unless --threads says more (2-core CPU, --compile, steps/s with 1
        # and 2 threads): idle, DQN 5,847 and 4,191, PPO 2,139 and 1,995, Atari PQN 196 and 273,
        # Atari PPO 295 and 380; beside one busy process, DQN 4,916 and 1,543, PPO 1,999 and
        # 1,541, Atari PQN 177 and 110, Atari PPO 299 and 168. More threads pay only for the Atari
        # convolutions on an idle machine, and stall every script beside anything else.
        torch.set_num_threads(args.threads)
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_envs(args, run.name, args.num_envs, args.capture_video)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    action_bounds = (torch.as_tensor(low, device=device), torch.as_tensor(high, device=device))

    actor = Actor(n_obs, n_act, low, high, device=device)
    qf1, qf2 = QNetwork(n_obs, n_act, device=device), QNetwork(n_obs, n_act, device=device)
    networks = {"actor": actor, "qf1": qf1, "qf2": qf2}
    if args.load_model:
        load_checkpoint(args.load_model, networks, args.env_id)
    # The twin critics as one set of stacked (2, ...) parameters, run by `critic`; qf1 and qf2
    # become views of its two slices, so that checkpoints read and write the stack.
    q_stack = from_modules(qf1, qf2).data
    for i, qf in enumerate((qf1, qf2)):
        q_stack[i].to_module(qf)
    params = TensorDict(actor=from_module(actor).data, qnet=q_stack)
    target_params = params.clone()
    actor_detach, target_actor = Actor(n_obs, n_act, low, high, device="meta"), Actor(n_obs, n_act, low, high, device="meta")
    params["actor"].to_module(actor_detach)
    target_params["actor"].to_module(target_actor)
    q_target_params = dict(target_params["qnet"].flatten_keys(".").items())
    # Adam: fused (one kernel for all parameters of each optimizer instead of about ten per
    # parameter) when the updates run eager; the single-tensor loop, which inductor fuses into
    # the update's graph, when they are compiled. On CUDA its step counts live on the device
    # (capturable): no host sync per step, and CUDA graphs can capture it.
    adam_options = {"fused": not args.compile, "capturable": device.type == "cuda"}
    q_optimizer = Adam(q_stack.flatten_keys(".").items(), args.learning_rate, **adam_options)
    actor_optimizer = Adam(actor.named_parameters(), args.learning_rate, **adam_options)

    # Before learning starts, blocks of up to LOG_EVERY steps go to the device at once; then each
    # update's sample copies its step.
    stage_steps = max(1, min(LOG_EVERY, args.buffer_size // args.num_envs))
    fields = {"obs": ((n_obs,), torch.float32), "actions": ((n_act,), torch.float32), "rewards": ((), torch.float32),
              "next_obs": ((n_obs,), torch.float32), "dones": ((), torch.float32)}
    rb = ReplayBuffer(args.buffer_size, fields, stage_steps * args.num_envs, device)

    policy = make_policy(actor_detach, args.exploration_noise, *action_bounds)
    update_critic, update_critic_and_actor = make_update(
        actor, target_actor, q_optimizer, actor_optimizer, q_target_params, rb.storage, action_bounds, args
    )
    # What --compile compiles (2-core CPU, torch 2.13, batch 256, HalfCheetah sizes, one thread,
    # CPU time, median of 7 rounds of 20 steps): the updates. A critic step plus a
    # critic-and-actor step took 7.3 ms per update eager and 5.5 ms compiled, each one graph.
    # Written with loss.backward() and optim.Adam, the compiled updates broke into several graphs
    # and took 10.4 ms against 7.9 ms eager. The policy, for one observation, stays eager on a CPU
    # (0.10 ms eager, 0.13 ms compiled: guards cost more than fusion saves); on CUDA, where kernel
    # launches bound these small networks, it is compiled too.
    if args.compile:
        if device.type == "cpu":
            # Random numbers inside the compiled updates come from torch's own kernel: on a CPU the
            # kernel that draws the target-policy noise (256 x 6) and adds it took 190 us a call;
            # torch's randn_like draws it in 4.5 us (whole compiled runs 1.05-1.12x faster, 3
            # interleaved pairs), and a compiled update then draws the same numbers as an eager one.
            torch._inductor.config.fallback_random = True
        update_critic = torch.compile(update_critic, fullgraph=True, options={"guard_filter_fn": value_guards})
        update_critic_and_actor = torch.compile(update_critic_and_actor, fullgraph=True, options={"guard_filter_fn": value_guards})
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": value_guards})
    if cudagraphs:
        update_critic = CudaGraphModule(update_critic, device=device)
        update_critic_and_actor = CudaGraphModule(update_critic_and_actor, device=device)
        policy = CudaGraphModule(policy, device=device)

    global_step = updates = 0
    # The graphed outputs are overwritten by the next call: the latest are copied here.
    metrics = torch.zeros(len(METRICS), device=device)
    obs, _ = envs.reset(seed=args.seed)
    obs = obs.astype(np.float32, copy=False)
    try:
        # Gradients come from torch.func inside the updates, which this context does not reach.
        with torch.no_grad():
            for iteration in range(num_iterations):
                if global_step < args.learning_starts:
                    actions = envs.action_space.sample()
                else:
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
                    actions = policy(torch.from_numpy(obs).to(device)).cpu().numpy()
                next_obs, rewards, terminations, truncations, infos = envs.step(actions)
                global_step += args.num_envs
                run.episodes(global_step, infos)

                # The done flag is the termination only: a time-limit truncation still bootstraps
                # from the true last observation (see make_envs for the autoreset).
                rb.add(obs=obs, actions=actions, rewards=rewards, next_obs=real_next_obs(next_obs, infos), dones=terminations)
                obs = next_obs.astype(np.float32, copy=False)

                if global_step > args.learning_starts:
                    idx = rb.sample(args.batch_size)
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # Counted in updates, not env steps, so that --num-envs keeps the delay.
                    if (updates + 1) % args.policy_frequency == 0:
                        metrics.copy_(update_critic_and_actor(idx))
                        target_params.lerp_(params, args.tau)
                    else:
                        metrics[:-1].copy_(update_critic(idx))
                    updates += 1

                if crossings(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                    # note: the loop's only host sync is here, at the log points
                    stats = dict(zip(METRICS, metrics.tolist())) if updates else {}
                    bad = [k for k in ("losses/qf_loss", "losses/actor_loss") if k in stats and not math.isfinite(stats[k])]
                    if bad:
                        run.stop_reason = f"non-finite {bad[0][len('losses/'):]} {stats[bad[0]]} at step {global_step}"
                        break
                    run.log(global_step, updates, stats, networks)
    except KeyboardInterrupt:
        run.interrupted = run.interrupted or signal.SIGINT
    envs.close()
    run.finish(global_step, updates, networks, lambda: evaluate(actor, args, run.name, device), device=device.type, cudagraphs=cudagraphs)


if __name__ == "__main__":
    main(tyro.cli(Args))

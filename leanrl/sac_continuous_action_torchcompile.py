"""SAC for continuous actions, lean: tensordict, batched critics, torch.compile and CUDA graphs.

Soft Actor-Critic (Haarnoja et al., 2018, https://arxiv.org/abs/1801.01290, with the automatic
entropy tuning of https://arxiv.org/abs/1812.05905) with the details and defaults of CleanRL's
`sac_continuous_action.py`. Same defaults and the same learning as the plain script
`sac_continuous_action.py`; only the speed differs. What makes it fast: the twin critics are one
batched call over their stacked parameters (tensordict `from_modules`), the target update is one
`lerp_`, the replay buffer is one preallocated tensor on the training device, gathered inside
the update, the actor's step never computes the critics' weight gradients, Adam is fused, and
nothing syncs the host with the device between two log points.

    python leanrl/sac_continuous_action_torchcompile.py
    python leanrl/sac_continuous_action_torchcompile.py --compile
    python leanrl/sac_continuous_action_torchcompile.py --compile --cudagraphs
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
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tqdm
import tyro
from tensordict import from_module, from_modules
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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""


# CleanRL logs the losses every 100 environment steps; here that is also the only host sync.
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
    """One preallocated tensor on the training device, one row per transition:
    [obs | action | reward | next obs | termination]. Allocated once with `torch.empty`
    (buffer_size x (2 obs + action + 2) floats; rows are never read before they are written), so
    that adding a step is one host-to-device copy and a sampled batch is one gather, done inside
    the update. obs and action are adjacent, so the critic's input needs no concatenation."""

    def __init__(self, buffer_size, n_obs, n_act, device):
        self.buffer_size, self.device = buffer_size, device
        self.n_obs, self.n_act = n_obs, n_act
        self.storage = torch.empty((buffer_size, 2 * n_obs + n_act + 2), device=device)
        self.pos, self.size = 0, 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        n, o, a = len(obs), self.n_obs, self.n_act
        rows = np.empty((n, self.storage.shape[1]), dtype=np.float32)
        rows[:, :o] = obs
        rows[:, o : o + a] = actions
        rows[:, o + a] = rewards
        rows[:, o + a + 1 : 2 * o + a + 1] = next_obs
        rows[:, -1] = terminations
        rows = torch.from_numpy(rows).to(self.device, non_blocking=True)
        first = min(n, self.buffer_size - self.pos)
        self.storage[self.pos : self.pos + first] = rows[:first]
        self.storage[: n - first] = rows[first:]
        self.pos = (self.pos + n) % self.buffer_size
        self.size = min(self.size + n, self.buffer_size)

    def sample_index(self, batch_size):
        # Drawn on the device: no host-device sync, and the CUDA graph of the update takes it
        # as an input.
        return torch.randint(0, self.size, (batch_size,), device=self.device)


def split_rows(rows, n_obs, n_act):
    """Views of a batch of buffer rows: (obs and action side by side, obs, action, reward,
    next obs, termination)."""
    obs_act = rows[:, : n_obs + n_act]
    reward = rows[:, n_obs + n_act]
    next_obs = rows[:, n_obs + n_act + 1 : 2 * n_obs + n_act + 1]
    return obs_act, obs_act[:, :n_obs], obs_act[:, n_obs:], reward, next_obs, rows[:, -1]


class SoftQNetwork(nn.Module):
    """Same layers (and state-dict keys) as the plain script's, so that checkpoints move
    between the two. The lean script never calls it: it stacks the parameters of two of them
    and runs both at once in `critic` below."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)


LOG_STD_MAX = 2
LOG_STD_MIN = -5
# log N(x_t; mean, std) with x_t = mean + std * noise is -noise^2 / 2 - log std - log sqrt(2 pi),
# with the same gradient as torch.distributions.Normal's (which differentiates through x_t),
# and without building a distribution object per call.
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


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
        return squashed_sample(*self(x), self.action_scale, self.action_bias)


def squashed_sample(mean, log_std, action_scale, action_bias):
    """Actor.get_action from the actor's output: a sampled action, its log-probability and the
    deterministic action. Apart from the module, so that the actor's loss can run the network
    through torch.func.functional_call."""
    noise = torch.randn_like(mean)
    y_t = torch.tanh(mean + log_std.exp() * noise)
    action = y_t * action_scale + action_bias
    # Enforcing Action Bound
    log_prob = -0.5 * noise.pow(2) - log_std - LOG_SQRT_2PI - torch.log(action_scale * (1 - y_t.pow(2)) + 1e-6)
    log_prob = log_prob.sum(1, keepdim=True)
    mean = torch.tanh(mean) * action_scale + action_bias
    return action, log_prob, mean


def critic(params, x):
    """Both critics at once from their stacked (2, ...) parameters: x is (batch, n_obs + n_act),
    the result (2, batch, 1); one batched matmul with its bias per layer.

    `torch.vmap` over `torch.func.functional_call` computes the same thing, but on a 2-core CPU
    (torch 2.13, batch 256, one thread, loaded machine, min of 7 runs) its per-op dispatch made
    the critics' forward and backward 3.9 ms against 2.95 ms written out like this, and a whole
    SAC step 14-15 ms against 12 ms, no faster than the plain script's two separate networks
    (15 ms). Compiled, the vmapped critics took 9.5 ms."""
    h = torch.baddbmm(params["fc1.bias"].unsqueeze(1), x.expand(2, *x.shape), params["fc1.weight"].mT).relu()
    h = torch.baddbmm(params["fc2.bias"].unsqueeze(1), h, params["fc2.weight"].mT).relu()
    return torch.baddbmm(params["fc3.bias"].unsqueeze(1), h, params["fc3.weight"].mT)


class Adam:
    """`optim.Adam` with its defaults, as a call on tensors: torch's functional `adam` (the code
    `optim.Adam.step()` runs) on state kept here, given the gradients by parameter name. Inside a
    compiled update it traces into the update's single graph. `loss.backward()` and
    `optimizer.step()` there break the graph instead, and dynamo then compiles Adam's step on its
    own, once per optimizer (seen on CUDA as recompiles).

    `params` are detached views of the parameters, updated in place: the update differentiates
    with respect to them. `fused`: one kernel for all the parameters, for eager updates; compiled
    updates take the single-tensor loop, which inductor fuses. `capturable`: the step counts
    stay on the device, so a step never syncs with the host and can be captured in a CUDA graph."""

    def __init__(self, named_params, lr, fused=False, capturable=False):
        self.params = {name: p.detach() for name, p in named_params}
        self.exp_avgs = [torch.zeros_like(p) for p in self.params.values()]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params.values()]
        self.steps = [torch.zeros((), device=p.device) for p in self.params.values()]
        self.lr, self.fused, self.capturable = lr, fused, capturable

    @torch.no_grad()
    def step(self, grads):
        # torch.func returns a weight's gradient in the layout the backward made it (transposed,
        # for a weight used as `w.mT`); the fused kernel reads it as if laid out like the weight
        # (seen on a CPU, torch 2.13: wrong steps for the transposed weights).
        grads = [grads[name].contiguous() for name in self.params]
        adam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
            foreach=False, fused=self.fused or None, capturable=self.capturable,
            amsgrad=False, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=1e-8, maximize=False,
        )


def make_learner(n_obs, n_act, action_low, action_high, args, device, checkpoint=None, capturable=False, fused=False):
    """Networks, targets, entropy coefficient and optimizers, fresh or from a checkpoint of
    either script of the pair (per-network state dicts). `capturable` and `fused` go to Adam."""
    actor = Actor(n_obs, n_act, action_low, action_high, device=device)
    qf1 = SoftQNetwork(n_obs, n_act, device=device)
    qf2 = SoftQNetwork(n_obs, n_act, device=device)
    if checkpoint is not None:
        actor.load_state_dict(checkpoint["actor"])
        qf1.load_state_dict(checkpoint["qf1"])
        qf2.load_state_dict(checkpoint["qf2"])
    # The twin critics as one TensorDict of stacked (2, ...) parameters, and their targets as
    # its detached copy: the Polyak update is one lerp_ over all of them.
    q_stack = from_modules(qf1, qf2, as_module=True)
    q_stack_data = q_stack.data
    q_target_stack = q_stack_data.clone()
    # Acting uses a detached view of the actor's parameters: no autograd bookkeeping per step,
    # and every optimizer step is visible to it at once (the storages are shared).
    actor_detach = Actor(n_obs, n_act, action_low, action_high, device="meta")
    from_module(actor).data.to_module(actor_detach)

    if args.autotune:
        log_alpha = torch.zeros(1, device=device, requires_grad=True)
        if checkpoint is not None:
            with torch.no_grad():
                log_alpha.copy_(checkpoint["log_alpha"])
    else:
        log_alpha = torch.full((1,), math.log(args.alpha), device=device)
    # alpha lives in a tensor that the actor step updates in place: the critic step reads the
    # new value without a host sync and without recompiling.
    alpha = log_alpha.detach().exp()

    q_params = dict(q_stack.flatten_keys(".").items())
    opt = dict(capturable=capturable, fused=fused)
    q_optimizer = Adam(q_params.items(), args.q_lr, **opt)
    actor_optimizer = Adam(actor.named_parameters(), args.policy_lr, **opt)
    a_optimizer = Adam([("log_alpha", log_alpha)], args.q_lr, **opt) if args.autotune else None
    return SimpleNamespace(
        actor=actor,
        actor_detach=actor_detach,
        q_stack=q_stack,
        q_stack_data=q_stack_data,
        q_target_stack=q_target_stack,
        q_params=q_params,
        q_target=dict(q_target_stack.flatten_keys(".").items()),
        log_alpha=log_alpha,
        alpha=alpha,
        q_optimizer=q_optimizer,
        actor_optimizer=actor_optimizer,
        a_optimizer=a_optimizer,
    )


def make_update(sac, storage, n_obs, n_act, args):
    """The two hot callables, closing over the learner `sac` (see make_learner) and the buffer
    storage:

    - update_critic(idx): one step of both critics on the buffer rows `idx`;
    - update_actor(idx): one step of the actor (and of the entropy coefficient with
      `--autotune`) on the same rows;
    - update_target(): the Polyak average of the critics into their targets.

    The first two gather their batch from the buffer themselves, so that the gather fuses with
    the forward pass, and return their metrics as one detached tensor that stays on the
    device. Gradients come from torch.func and the steps from `Adam` above, so that each update
    is one graph under torch.compile: gather, forward, backward and Adam."""
    actor, q_target, alpha = sac.actor, sac.q_target, sac.alpha
    q_optimizer, actor_optimizer, a_optimizer = sac.q_optimizer, sac.actor_optimizer, sac.a_optimizer
    action_scale, action_bias = actor.action_scale, actor.action_bias
    gamma, tau, autotune = args.gamma, args.tau, args.autotune
    target_entropy = -float(n_act)
    # What torch.func differentiates with respect to: the detached parameters that Adam updates
    # in place (the modules' parameters share their storage).
    q_params, actor_params = q_optimizer.params, actor_optimizer.params

    def critic_loss(q_params, obs_act, next_q_value):
        q_a_values = critic(q_params, obs_act).view(2, -1)
        q_losses = (q_a_values - next_q_value).pow(2).mean(1)
        qf_loss = q_losses.sum()
        return qf_loss, torch.stack([q_a_values[0].mean(), q_a_values[1].mean(), q_losses[0], q_losses[1], qf_loss]).detach()

    def actor_loss(actor_params, obs):
        pi, log_pi, _ = squashed_sample(*torch.func.functional_call(actor, actor_params, (obs,)), action_scale, action_bias)
        # The critics' parameters are constants here: their weight gradients, which CleanRL
        # computes in this step and throws away at the next critic step, are never computed
        # (half of the critics' backward matmuls in the actor step).
        min_qf_pi = critic(q_params, torch.cat([obs, pi], 1)).min(0).values
        return ((alpha * log_pi) - min_qf_pi).mean()

    def alpha_loss(log_alpha, log_pi):
        return (-log_alpha.exp() * (log_pi + target_entropy)).mean()

    critic_grad = torch.func.grad(critic_loss, has_aux=True)
    actor_grad = torch.func.grad_and_value(actor_loss)
    alpha_grad = torch.func.grad_and_value(alpha_loss)

    def update_critic(idx):
        obs_act, _, _, reward, next_obs, termination = split_rows(storage[idx], n_obs, n_act)
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(next_obs)
            q_next_target = critic(q_target, torch.cat([next_obs, next_state_actions], 1))
            min_qf_next_target = q_next_target.min(0).values - alpha * next_state_log_pi
            next_q_value = reward + (1 - termination) * gamma * min_qf_next_target.view(-1)

        grads, stats = critic_grad(q_params, obs_act, next_q_value)
        q_optimizer.step(grads)
        return stats

    def update_actor(idx):
        obs = storage[idx, :n_obs]
        grads, loss = actor_grad(actor_params, obs)
        actor_optimizer.step(grads)

        if autotune:
            with torch.no_grad():
                _, log_pi, _ = actor.get_action(obs)
            log_alpha = a_optimizer.params["log_alpha"]
            grad, a_loss = alpha_grad(log_alpha, log_pi)
            a_optimizer.step({"log_alpha": grad})
            alpha.copy_(log_alpha.exp())
        else:
            a_loss = torch.zeros((), device=obs.device)
        return torch.stack([loss, a_loss, alpha.view(())]).detach()

    def update_target():
        # target <- tau * online + (1 - tau) * target for all twelve tensors in one foreach op,
        # in place, so the target dict the critic step reads sees it.
        sac.q_target_stack.lerp_(sac.q_stack_data, tau)

    return update_critic, update_actor, update_target


def make_policy(actor):
    """Acting: a sampled action, without autograd."""

    def policy(obs):
        return actor.get_action(obs)[0]

    return policy


CRITIC_METRICS = ["qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss"]
ACTOR_METRICS = ["actor_loss", "alpha_loss", "alpha"]


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
            _, _, action = actor.get_action(torch.as_tensor(obs, device=device, dtype=torch.float))
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
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_envs(args, run_name, args.num_envs)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high

    checkpoint = load_checkpoint(args.load_model) if args.load_model else None
    # Adam: fused (one kernel for all parameters) when the updates run eager; the single-tensor
    # loop, which inductor fuses into the update's graph, when they are compiled. On CUDA its
    # step counts live on the device (capturable): no host sync, and CUDA graphs can capture it.
    sac = make_learner(n_obs, n_act, action_low, action_high, args, device, checkpoint, capturable=device.type == "cuda", fused=not args.compile)

    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)
    update_critic, update_actor, update_target = make_update(sac, rb.storage, n_obs, n_act, args)
    policy = make_policy(sac.actor_detach)
    # What --compile compiles, measured on a 2-core CPU with torch 2.13 (batch 256, HalfCheetah
    # sizes, one thread, CPU time, median of 7 rounds of 10 steps): the updates. A SAC step
    # (critic step, actor step, target update) took 11.8 ms eager and 7.9 ms with both updates
    # compiled, each one graph (gather, forward, torch.func backward, Adam). Written with
    # loss.backward() and optim.Adam, the compiled step broke into several graphs and took
    # 16.3 ms against 11.9 ms eager. The policy, for one observation, stays eager on a CPU,
    # where it measured slower compiled (guards cost more than fusion saves); on CUDA, where
    # kernel launches bound these small networks, it is compiled too.
    if args.compile:
        update_critic = torch.compile(update_critic, fullgraph=True)
        update_actor = torch.compile(update_actor, fullgraph=True)
        if device.type == "cuda":
            policy = torch.compile(policy)
    if cudagraphs:
        update_critic = CudaGraphModule(update_critic)
        update_actor = CudaGraphModule(update_actor)
        policy = CudaGraphModule(policy)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    def state():
        critics = [dict(sac.q_stack_data[i].flatten_keys(".").items()) for i in range(2)]
        return {"actor": sac.actor.state_dict(), "qf1": critics[0], "qf2": critics[1], "log_alpha": sac.log_alpha}

    def snapshot():
        return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v.detach().clone()) for k, v in state().items()}

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, next_log, logged_step = 0, 0, LOG_EVERY, 0
    critic_stats, actor_stats = None, None
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
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad():
                    # note: a CPU-GPU sync point on CUDA; a no-copy view on a CPU
                    actions = policy(torch.as_tensor(obs, device=device, dtype=torch.float)).cpu().numpy()

            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs
            if "final_info" in infos:
                final = infos["final_info"]
                recent_returns.extend(final["episode"]["r"][final["_episode"]].tolist())

            # Only a termination cuts the bootstrap: a truncated episode (time limit) is
            # bootstrapped from its true final observation.
            rb.add(obs, actions, rewards, transition_next_obs(next_obs, infos), terminations)
            obs = next_obs

            if global_step >= args.learning_starts:
                idx = rb.sample_index(args.batch_size)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                critic_stats = update_critic(idx)
                updates += 1
                if updates % args.policy_frequency == 0:  # TD 3 Delayed update support
                    for _ in range(args.policy_frequency):  # compensate for the delay by doing 'actor_update_interval' instead of 1
                        if cudagraphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        actor_stats = update_actor(idx)
                if updates % args.target_network_frequency == 0:
                    update_target()

            if global_step < next_log:
                continue
            # Logging, every LOG_EVERY steps: the host syncs of this loop are all here.
            next_log = (global_step // LOG_EVERY + 1) * LOG_EVERY
            pbar.update(global_step - logged_step)
            logged_step = global_step
            losses = {}
            if critic_stats is not None:
                losses.update(zip(CRITIC_METRICS, critic_stats.tolist()))
            if actor_stats is not None:
                losses.update(zip(ACTOR_METRICS, actor_stats.tolist()))
                if not args.autotune:
                    del losses["alpha_loss"]
            bad = [name for name in ("qf_loss", "actor_loss", "alpha_loss") if name in losses and not math.isfinite(losses[name])]
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
            if wandb is not None and critic_stats is not None:
                log = {f"losses/{k}": v for k, v in losses.items()}
                log["losses/qf_loss"] = losses["qf_loss"] / 2.0
                log["losses/alpha"] = losses.get("alpha", sac.alpha.item())
                log["charts/SPS"] = sps
                if recent_returns:
                    log["charts/episodic_return"] = mean_return
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
        eval_return = evaluate(sac.actor_detach, args, run_name, device)
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

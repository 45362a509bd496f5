"""TD3 for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

Twin Delayed Deep Deterministic policy gradient (Fujimoto et al., 2018,
https://arxiv.org/abs/1802.09477): clipped double-Q learning with twin critics, delayed policy
and target updates, and target policy smoothing. Same defaults and the same learning as the
plain script `td3_continuous_action.py` (CleanRL's); only the speed differs.

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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""


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


class ReplayBuffer:
    """A ring buffer of transitions preallocated on the training device and written in place.

    Its footprint is buffer_size transitions (obs, next obs, action, reward, done in float32),
    allocated once at start; `torch.empty` leaves the pages untouched until written. `sample`
    runs inside the update, so that a compiled update (CUDA) fuses the gather into its kernels
    and no batch crosses from the host."""

    def __init__(self, buffer_size, n_obs, n_act, device):
        self.buffer_size = buffer_size
        self.observations = torch.empty((buffer_size, n_obs), device=device)
        self.next_observations = torch.empty((buffer_size, n_obs), device=device)
        self.actions = torch.empty((buffer_size, n_act), device=device)
        self.rewards = torch.empty(buffer_size, device=device)
        # Terminations only: a truncated episode is not done, its next state has a value.
        self.dones = torch.empty(buffer_size, device=device)
        # The number of valid rows, as a tensor updated in place: read by the compiled sampler,
        # so that filling the buffer never recompiles it.
        self.size = torch.zeros((), device=device)
        self.pos, self.count = 0, 0

    def add(self, obs, next_obs, actions, rewards, terminations):
        n = obs.shape[0]
        if self.pos + n <= self.buffer_size:
            rows = slice(self.pos, self.pos + n)
        else:
            rows = torch.arange(self.pos, self.pos + n, device=self.rewards.device) % self.buffer_size
        for storage, value in (
            (self.observations, obs),
            (self.next_observations, next_obs),
            (self.actions, actions),
            (self.rewards, rewards),
            (self.dones, terminations),
        ):
            storage[rows] = torch.as_tensor(value, device=storage.device, dtype=storage.dtype)
        self.pos = (self.pos + n) % self.buffer_size
        self.count = min(self.count + n, self.buffer_size)
        self.size.fill_(self.count)

    def sample(self, batch_size):
        # Uniform over the valid rows; floor(u * size) < size for u < 1 and sizes below 2**24.
        idx = (torch.rand(batch_size, device=self.size.device) * self.size).long()
        return self.observations[idx], self.actions[idx], self.next_observations[idx], self.dones[idx], self.rewards[idx]


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


def make_policy(actor, exploration_noise, action_low, action_high):
    """Acting: the deterministic action plus Gaussian exploration noise, drawn on the device."""

    def policy(obs):
        action = actor(obs)
        action = action + torch.randn_like(action) * actor.action_scale * exploration_noise
        return action.clamp(action_low, action_high)

    return policy


def twin_q(params, obs, action):
    """Both critics at once from their stacked (2, ...) parameters: one batched matmul with its
    bias per layer. Returns (2, batch, 1). The input is shared, so it is expanded, not copied.

    Written out rather than torch.vmap over torch.func.functional_call (the original LeanRL's
    way, same result): on a 2-core CPU (torch 2.13, one thread, CPU time, median of 3) a whole
    update took 9.9 ms with vmap, 7.9 ms with this, 9.2 ms for the plain script's two separate
    networks; vmap batches each linear as a bmm plus a separate bias add, and dispatches per op."""
    x = torch.cat([obs, action], 1).expand(2, -1, -1)
    x = F.relu(torch.baddbmm(params["fc1.bias"].unsqueeze(1), x, params["fc1.weight"].transpose(1, 2)))
    x = F.relu(torch.baddbmm(params["fc2.bias"].unsqueeze(1), x, params["fc2.weight"].transpose(1, 2)))
    return torch.baddbmm(params["fc3.bias"].unsqueeze(1), x, params["fc3.weight"].transpose(1, 2))


def first_q(params, obs, action):
    """The first critic alone from the stacked parameters: QNetwork.forward on slice 0."""
    x = torch.cat([obs, action], 1)
    x = F.relu(F.linear(x, params["fc1.weight"][0], params["fc1.bias"][0]))
    x = F.relu(F.linear(x, params["fc2.weight"][0], params["fc2.bias"][0]))
    return F.linear(x, params["fc3.weight"][0], params["fc3.bias"][0])


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


def make_learner(actor, qf1, qf2, action_low, action_high, args, adam_options=None):
    """Everything the update reads and writes, built from the three online networks.

    - the twin critics as one TensorDict of stacked parameters (leading dimension 2,
      `from_modules`), run by `twin_q` (checkpoints are unstacked from `q_stacked`; qf1 and qf2
      keep their own storage and are not used after this);
    - `actor_detach`, a detached view of the actor's parameters for acting: no autograd
      bookkeeping per step, and every optimizer step is visible to it at once;
    - the targets, as copies: `q_target_params` and `target_actor`, whose tensors are the
      leaves of `targets`, paired key by key with the online ones in `online` for one lerp_;
    - one Adam per loss, built with `adam_options` (fused, capturable: see main), over the
      detached parameters that the update differentiates with torch.func (the critics' keyed by
      QNetwork's parameter names)."""
    n_obs, n_act = actor.fc1.in_features, actor.fc_mu.out_features
    q_stacked = from_modules(qf1, qf2, as_module=True)
    q_target_stacked = q_stacked.data.clone()
    actor_online = from_module(actor).data
    actor_detach = Actor(n_obs, n_act, action_low, action_high, device="meta")
    actor_online.to_module(actor_detach)
    actor_target_params = actor_online.clone()
    target_actor = Actor(n_obs, n_act, action_low, action_high, device="meta")
    actor_target_params.to_module(target_actor)
    q_params = {".".join(k): v for k, v in q_stacked.items(True, True)}
    return SimpleNamespace(
        actor=actor,
        action_low=action_low,
        action_high=action_high,
        actor_detach=actor_detach,
        target_actor=target_actor,
        q_stacked=q_stacked,
        q_target_params={".".join(k): v for k, v in q_target_stacked.items(True, True)},
        online=TensorDict(actor=actor_online, qnet=q_stacked.data),
        targets=TensorDict(actor=actor_target_params, qnet=q_target_stacked),
        q_optimizer=Adam(q_params.items(), args.learning_rate, **(adam_options or {})),
        actor_optimizer=Adam(actor.named_parameters(), args.learning_rate, **(adam_options or {})),
    )


def make_target(learner, rb, args):
    """Samples a batch from `rb` and computes its TD target (clipped double-Q with target policy
    smoothing). Forward only, without autograd."""
    gamma, policy_noise, noise_clip, batch_size = args.gamma, args.policy_noise, args.noise_clip, args.batch_size
    target_actor, q_target_params = learner.target_actor, learner.q_target_params
    action_scale, action_low, action_high = learner.actor.action_scale, learner.action_low, learner.action_high

    @torch.no_grad()
    def sample_and_target():
        obs, actions, next_obs, dones, rewards = rb.sample(batch_size)
        clipped_noise = (torch.randn_like(actions) * policy_noise).clamp(-noise_clip, noise_clip) * action_scale
        next_state_actions = (target_actor(next_obs) + clipped_noise).clamp(action_low, action_high)
        min_qf_next_target = twin_q(q_target_params, next_obs, next_state_actions).amin(0).view(-1)
        next_q_value = rewards + (1 - dones) * gamma * min_qf_next_target
        return obs, actions, next_q_value

    return sample_and_target


def make_update(learner, sample_and_target):
    """The two update steps: critics only, and critics then actor (every `policy_frequency`-th).
    Two functions rather than one with a flag: under torch.compile a flag would recompile the
    same code for its second value.

    Gradients come from torch.func and the steps from `Adam` above, so that each update is one
    graph under torch.compile: sampling, target, both losses, backward and Adam."""
    actor = learner.actor
    q_optimizer, actor_optimizer = learner.q_optimizer, learner.actor_optimizer
    # What torch.func differentiates with respect to: the detached parameters that Adam updates
    # in place (the modules' parameters share their storage).
    q_params, actor_params = q_optimizer.params, actor_optimizer.params

    def critic_loss(params, obs, actions, next_q_value):
        qf_a_values = twin_q(params, obs, actions).view(2, -1)
        qf_losses = (qf_a_values - next_q_value).pow(2).mean(1)
        return qf_losses.sum(), torch.cat([qf_a_values.mean(1), qf_losses]).detach()

    def actor_loss(params, obs):
        # The first critic after its step, as in CleanRL; its parameters are constants here, so
        # only the gradient with respect to the action flows back, not the critic's weights'.
        return -first_q(q_params, obs, torch.func.functional_call(actor, params, (obs,))).mean()

    critic_grad = torch.func.grad(critic_loss, has_aux=True)
    actor_grad = torch.func.grad_and_value(actor_loss)

    def critic_step():
        obs, actions, next_q_value = sample_and_target()
        grads, stats = critic_grad(q_params, obs, actions, next_q_value)
        q_optimizer.step(grads)
        return obs, stats

    def update_critic():
        return critic_step()[1]

    def update_critic_and_actor():
        obs, stats = critic_step()
        grads, loss = actor_grad(actor_params, obs)
        actor_optimizer.step(grads)
        return torch.cat([stats, loss.detach().view(1)])

    return update_critic, update_critic_and_actor


def make_soft_update(target_params, params, tau):
    """Polyak averaging of every target parameter at once: one lerp_ on the TensorDict (one
    fused foreach kernel), target <- target + tau * (online - target)."""

    def soft_update():
        target_params.lerp_(params, tau)

    return soft_update


STATS = ["qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "actor_loss"]


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, networks, args):
    """`networks` maps "actor", "qf1", "qf2" to state dicts: the format the plain script writes too."""
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
            action = actor(torch.as_tensor(obs, device=device, dtype=torch.float))
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
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_envs(args, run_name, args.num_envs, args.capture_video)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    action_low = torch.as_tensor(low, dtype=torch.float32, device=device)
    action_high = torch.as_tensor(high, dtype=torch.float32, device=device)

    actor = Actor(n_obs, n_act, low, high, device=device)
    qf1 = QNetwork(n_obs, n_act, device=device)
    qf2 = QNetwork(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, {"actor": actor, "qf1": qf1, "qf2": qf2})

    # What --compile compiles, measured on a 2-core CPU with torch 2.13 (batch 256, HalfCheetah
    # sizes, one thread, CPU time, median of 7 rounds of 20 steps): the updates. A critic step
    # plus a critic-and-actor step took 7.3 ms per update eager and 5.5 ms compiled, each one graph
    # (sampling, target, forward, torch.func backward, Adam). Written with loss.backward() and
    # optim.Adam, the compiled updates broke into several graphs and took 10.4 ms against 7.9 ms
    # eager. The policy, for one observation, stays eager on a CPU (0.10 ms eager, 0.13 ms
    # compiled: guards cost more than fusion saves); on CUDA, where kernel launches bound these
    # small networks, it is compiled too.
    # Adam: fused (one kernel for all parameters of each optimizer instead of about ten per
    # parameter) when the updates run eager; the single-tensor loop, which inductor fuses into
    # the update's graph, when they are compiled. On CUDA its step counts live on the device
    # (capturable): no host sync per step, and CUDA graphs can capture it.
    adam_options = {"fused": not args.compile, "capturable": device.type == "cuda"}
    learner = make_learner(actor, qf1, qf2, action_low, action_high, args, adam_options)
    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)
    policy = make_policy(learner.actor_detach, args.exploration_noise, action_low, action_high)
    update_critic, update_critic_and_actor = make_update(learner, make_target(learner, rb, args))
    soft_update = make_soft_update(learner.targets, learner.online, args.tau)
    if args.compile:
        update_critic = torch.compile(update_critic, fullgraph=True)
        update_critic_and_actor = torch.compile(update_critic_and_actor, fullgraph=True)
        if device.type == "cuda":
            policy = torch.compile(policy)
    if cudagraphs:
        update_critic = CudaGraphModule(update_critic, device=device)
        update_critic_and_actor = CudaGraphModule(update_critic_and_actor, device=device)
        policy = CudaGraphModule(policy, device=device)

    def networks():
        """Per-network state dicts, the critics unstacked (copies, not views of the stack)."""
        critics = {f"qf{i + 1}": {k: v.detach().clone() for k, v in learner.q_stacked[i].flatten_keys(".").items()} for i in range(2)}
        return {"actor": {k: v.clone() for k, v in actor.state_dict().items()}, **critics}

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, next_log = 0, 0, 0
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = None
    interrupted = False
    stop_reason = None
    stats = torch.zeros(len(STATS), device=device)

    try:
        obs_np, _ = envs.reset(seed=args.seed)
    except gym.error.DependencyNotInstalled as e:
        # RecordVideo renders the first frame here: an env that cannot render fails now.
        fail(f"{args.env_id} cannot render for --capture-video: {e}")
    obs = torch.as_tensor(obs_np, device=device, dtype=torch.float)
    pbar = tqdm.tqdm(total=args.total_timesteps, disable=args.total_timesteps == 0, file=sys.stderr)
    try:
        while global_step < args.total_timesteps:
            if global_step < args.learning_starts:
                actions_np = envs.action_space.sample()
                actions = actions_np
            else:
                with torch.no_grad():
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    actions = policy(obs)
                # note: a CPU-GPU sync point on CUDA; a no-copy view on a CPU
                actions_np = actions.cpu().numpy()

            next_obs_np, rewards, terminations, truncations, infos = envs.step(actions_np)

            if "final_info" in infos:
                final = infos["final_info"]
                for episodic_return, episodic_length in zip(final["episode"]["r"][final["_episode"]], final["episode"]["l"][final["_episode"]]):
                    recent_returns.append(float(episodic_return))
                    if wandb is not None:
                        wandb.log({"charts/episodic_return": episodic_return, "charts/episodic_length": episodic_length}, step=global_step)

            # Stored `dones` are the terminations only: a truncated episode bootstraps from the
            # value of its final observation.
            rb.add(obs, real_next_obs(next_obs_np, infos), actions, rewards, terminations)
            obs = torch.as_tensor(next_obs_np, device=device, dtype=torch.float)
            global_step += args.num_envs
            pbar.update(args.num_envs)

            if global_step > args.learning_starts:
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                # Counted in updates, not env steps, so that --num-envs keeps the delay.
                if (updates + 1) % args.policy_frequency == 0:
                    stats.copy_(update_critic_and_actor())
                    soft_update()
                else:
                    stats[:4].copy_(update_critic())
                updates += 1

                if global_step >= next_log:
                    next_log = global_step + 100
                    # Logging: the host syncs of the training loop are all here.
                    losses = dict(zip(STATS, stats.tolist()))
                    bad = [k for k in ("qf1_loss", "qf2_loss", "actor_loss") if not math.isfinite(losses[k])]
                    if bad:
                        stop_reason = f"non-finite {bad[0]} {losses[bad[0]]} at step {global_step}"
                        break
                    if args.save_model:
                        last_good = networks()
                    if warmup_s is None and updates >= 2 * args.policy_frequency:
                        warmup_s = time.perf_counter() - start_time
                        warm_step, warm_time = global_step, time.perf_counter()
                    sps = (global_step - warm_step) / max(time.perf_counter() - warm_time, 1e-9) if warmup_s is not None and global_step > warm_step else float("nan")
                    mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
                    pbar.set_description(f"sps={sps:6.0f} return={mean_return:8.2f}")
                    if recent_returns:
                        curve.append((global_step, round(time.perf_counter() - start_time, 3), round(mean_return, 3)))
                    if wandb is not None:
                        log = {f"losses/{k}": v for k, v in losses.items()}
                        log["losses/qf_loss"] = (losses["qf1_loss"] + losses["qf2_loss"]) / 2.0
                        log["charts/SPS"] = sps
                        wandb.log(log, step=global_step)
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

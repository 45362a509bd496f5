"""PPO for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the implementation details of CleanRL's `ppo_continuous_action.py` (Huang et al., "The 37
Implementation Details of PPO", ICLR blog track 2022). It learns as the plain script
`ppo_continuous_action.py` does; what changes is where the time goes: the minibatch step
(gather, forward, backward, gradient clipping, Adam) is one function that compiles to one
graph, acting skips torch.distributions and autograd, and nothing syncs the host with the
device between two log points but the `--target-kl` check. Observation and reward normalization,
their clips and the action clip, which the plain script runs as gymnasium wrappers in Python per
sub-env (three quarters of a MuJoCo step's time), are done once per vector step on the whole batch
in numpy on the host, with the same per-env statistics (`Normalization`).

    python leanrl/ppo_continuous_action_torchcompile.py
    python leanrl/ppo_continuous_action_torchcompile.py --compile
    python leanrl/ppo_continuous_action_torchcompile.py --compile --cudagraphs

Data-parallel over processes, GPUs and nodes when torchrun starts it: --num-envs is per process,
each minibatch step averages the gradients over all of them, and rank 0 alone prints and saves.

    torchrun --standalone --nproc_per_node 2 leanrl/ppo_continuous_action_torchcompile.py --compile
"""

import copy
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
from datetime import timedelta

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
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
    """whether to save the model (and observation statistics) into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes of the deterministic policy to run after training (0: none)"""
    num_seeds: int = 1
    """independent agents trained at once, seeds `seed` to `seed + num-seeds - 1` (`total-timesteps` each)"""

    # algorithm
    env_id: str = "HalfCheetah-v5"
    """the id of the environment"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantage normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (see main: one wins beside any other process)"""
    backend: str | None = None
    """the torch.distributed backend under torchrun: gloo or nccl (default: nccl on CUDA, gloo on a CPU)"""
    dist_timeout: float = 300.0
    """seconds a rank under torchrun waits for the others (to start, at each collective) before it stops"""


ALGORITHM = "ppo_continuous_action"
# log N(x; mu, std) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), written out because
# building a torch.distributions.Normal costs more than the arithmetic at these sizes.
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def make_env(env_id, idx, capture_video, run_name):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        if not isinstance(env.action_space, gym.spaces.Box):
            fail(f"{env_id} has a {type(env.action_space).__name__} action space; this script handles continuous (Box) actions only")
        if not (isinstance(env.observation_space, gym.spaces.Box) and len(env.observation_space.shape) == 1):
            env = gym.wrappers.FlattenObservation(env)
        # Counted on the raw reward, so that the reported returns are the true ones. The rest of
        # CleanRL's per-env stack (ClipAction, NormalizeObservation, NormalizeReward, their clips)
        # is `Normalization`, once per vector step on the whole batch: in Python per sub-env it
        # cost 0.19 ms of a 0.25 ms HalfCheetah step (MuJoCo itself 0.06 ms).
        return gym.wrappers.RecordEpisodeStatistics(env)

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
        fail(f"unknown environment id {args.env_id!r}: pass --env-id with a registered gymnasium id, e.g. HalfCheetah-v5")
    if capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL=glfw or
        # osmesa set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")
    thunks = [make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: the step that ends an episode already returns the first
        # observation of the next one (the final one is in infos["final_obs"]). Every stored
        # step is then a real transition, and GAE cuts the bootstrap at `done` exactly as in
        # the gym 0.26 loop CleanRL was written for. Under the NEXT_STEP default the step after
        # a done would be a no-op reset step that PPO would have to mask out of its losses.
        envs = SameStepEnvs(thunks)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    return envs


def seed_slice(infos, k, num_envs):
    """Seed k's share of a vector env's infos: the values of its sub-envs, k * num_envs onwards."""
    part = slice(k * num_envs, (k + 1) * num_envs)
    return {key: seed_slice(value, k, num_envs) if isinstance(value, dict) else value[part] for key, value in infos.items()}


def rms_update(mean, var, count, x):
    """gymnasium's RunningMeanStd.update in place, one sample per sub-env (row of `x`): its
    update_mean_var_count_from_moments with batch_var 0 and batch_count 1, in the same order of
    operations, so the float64 statistics are the wrappers' to the last bits."""
    delta = x - mean
    total = count + 1
    mean += delta / total
    var[...] = (var * count + np.square(delta) * count / total) / total
    count[...] = total


def clip(x, low, high):
    """np.clip(x, low, high) in half the time (0.9 against 1.8 us for one observation)."""
    return np.minimum(np.maximum(x, low), high)


class Normalization:
    """What CleanRL's per-env wrappers do to the data, done once per vector step on whole batches
    in numpy on the host, where the env's arrays are: NormalizeObservation then a clip at +-10,
    NormalizeReward(gamma) then a clip at +-10, ClipAction. On a CPU a numpy op on a few numbers
    costs about 1 us and a torch op several, and the wrappers' Python costs 0.19 ms a step. The
    statistics are the wrappers', per sub-env and in float64: a running mean, var and count (from
    1e-4) of the observations, every one the sub-env returns, the final observation of an episode
    and the first of the next alike; a discounted return `ret = ret * gamma * (1 - terminated) +
    reward` (not reset at a truncation, as gymnasium 1.4 does) whose running variance scales the
    rewards.

    state_dict: the observation statistics in the plain script's checkpoint format (per-env mean,
    var, count); the policy only works on observations normalized as in training. A checkpoint of
    fewer envs gives its last statistics to the rest. The reward scale is not kept, as in the plain
    script. `training = False` freezes the statistics (evaluation)."""

    def __init__(self, num_envs, n_obs, action_space, gamma, device, clip=10.0, epsilon=1e-8):
        self.mean, self.var, self.count = np.zeros((num_envs, n_obs)), np.ones((num_envs, n_obs)), np.full((num_envs, 1), 1e-4)
        self.ret, self.ret_mean, self.ret_var, self.ret_count = (np.full(num_envs, v) for v in (0.0, 0.0, 1.0, 1e-4))
        self.low, self.high = action_space.low, action_space.high
        self.gamma, self.clip, self.epsilon, self.device, self.training = gamma, clip, epsilon, device, True

    def obs(self, x):
        """Observations (num_envs, n_obs) -> normalized and clipped float32 ones on the device."""
        x = np.asarray(x, dtype=np.float64)
        if self.training:
            rms_update(self.mean, self.var, self.count, x)
        normalized = clip((x - self.mean) / np.sqrt(self.var + self.epsilon), -self.clip, self.clip)
        return torch.as_tensor(normalized.astype(np.float32), device=self.device)

    def final_obs(self, x, rows):
        """The statistics' update for the final observations `x` (one row each) of the sub-envs
        `rows` whose episodes just ended: a wrapper sees its final observation before the reset's."""
        if self.training:
            rows = np.asarray(rows)
            mean, var, count = self.mean[rows], self.var[rows], self.count[rows]
            rms_update(mean, var, count, np.asarray(x, dtype=np.float64))
            self.mean[rows], self.var[rows], self.count[rows] = mean, var, count

    def reward(self, reward, terminated):
        """Rewards and terminations (num_envs,) -> scaled and clipped rewards (float64, host)."""
        self.ret = self.ret * self.gamma * (1.0 - terminated) + reward
        rms_update(self.ret_mean, self.ret_var, self.ret_count, self.ret)
        return clip(reward / np.sqrt(self.ret_var + self.epsilon), -self.clip, self.clip)

    def action(self, action):
        """Actions (num_envs, n_act) on the host -> clipped to the action space, for the env."""
        return clip(action, self.low, self.high)

    def state_dict(self):
        return {"mean": torch.from_numpy(self.mean), "var": torch.from_numpy(self.var), "count": torch.from_numpy(self.count).view(-1)}

    def seed(self, k, num_envs):
        """Seed k's share (sub-envs k * num_envs onwards) as a Normalization whose statistics are
        views of these: what seed k saves and evaluates with."""
        part, rows = copy.copy(self), slice(k * num_envs, (k + 1) * num_envs)
        part.mean, part.var, part.count = self.mean[rows], self.var[rows], self.count[rows]
        return part

    def load_state_dict(self, state):
        if state["mean"].shape[1:] != self.mean.shape[1:]:
            raise RuntimeError("observation size mismatch")
        rows = np.minimum(np.arange(len(self.count)), len(state["count"]) - 1)
        self.mean[...] = state["mean"].numpy()[rows]
        self.var[...] = state["var"].numpy()[rows]
        self.count[...] = state["count"].numpy()[rows].reshape(-1, 1)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act, device=device))

    def forward(self, obs):
        action_mean = self.actor_mean(obs)
        return action_mean, self.actor_logstd.expand_as(action_mean), self.critic(obs).flatten()


def stack_seeds(networks):
    """The networks' parameters stacked on a leading seed dimension, as flat names -> tensors.
    Each network's parameters become views of its slice, so that it acts, evaluates and saves
    (a state_dict the single-seed script loads) with its seed's current weights."""
    stacked = torch.stack([from_module(net).data for net in networks]).contiguous()
    for k, net in enumerate(networks):
        stacked[k].to_module(net)
    return stacked.flatten_keys(".")


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


def make_policy(agent, params, num_seeds, host, seed=0):
    """Acting: for observations [seeds * envs, n_obs] (seed k's envs in block k), one forward of
    each seed's actor and critic, without autograd; the action's noise is drawn here. `params`:
    the agents' parameters with a leading seed dimension (`stack_seeds`, or one agent's
    unsqueezed); `agent`, a meta-device Agent for torch (with one seed, holding its views).
    `host` (a CPU): in numpy, on views of the parameters (`Tensor.numpy()` shares their memory,
    so every Adam step is seen at once), with noise from a numpy generator seeded with `seed`
    (the seeds share it): for a few observations a numpy op costs under a microsecond and a torch
    op several, and a compiled call's wrappers more than its kernels. In the loop, on a CPU (one
    thread, between HalfCheetah steps): 96 us a step in numpy, 202 us compiled with inductor's C++
    wrapper, 223 us eager; whole compiled runs 1.04-1.56x faster (8 interleaved pairs). Else in
    torch (stacked seeds through torch.func.vmap), which CUDA compiles and graphs."""
    if host:
        def arrays(net):
            return [(params[f"{net}.{i}.weight"].numpy().swapaxes(1, 2), params[f"{net}.{i}.bias"].numpy()[:, None]) for i in (0, 2, 4)]

        actor, critic, logstd = arrays("actor_mean"), arrays("critic"), params["actor_logstd"].numpy()
        rng = np.random.default_rng(seed)

        def mlp(x, layers):
            for weight_t, bias in layers[:-1]:
                x = np.tanh(x @ weight_t + bias)
            return x @ layers[-1][0] + layers[-1][1]

        def host_policy(obs):
            x = obs.numpy().reshape(num_seeds, -1, obs.shape[-1])
            action_mean = mlp(x, actor)
            noise = rng.standard_normal(action_mean.shape, dtype=np.float32)
            logprob = (-0.5 * np.square(noise) - logstd - LOG_SQRT_2PI).sum(2)
            action = action_mean + np.exp(logstd) * noise
            return torch.from_numpy(action.reshape(-1, action.shape[-1])), torch.from_numpy(logprob.ravel()), torch.from_numpy(mlp(x, critic).ravel())

        return host_policy

    if num_seeds == 1:
        forward = agent
    else:
        vmapped = torch.func.vmap(lambda p, x: torch.func.functional_call(agent, p, (x,)))

        def forward(obs):
            return tuple(x.flatten(0, 1) for x in vmapped(params, obs.view(num_seeds, -1, obs.shape[-1])))

    def policy(obs):
        action_mean, logstd, value = forward(obs)
        noise = torch.randn_like(action_mean)
        action = action_mean + logstd.exp() * noise
        logprob = (-0.5 * noise.pow(2) - logstd - LOG_SQRT_2PI).sum(1)
        return action, logprob, value

    return policy


def make_gae(gamma, gae_lambda):
    """Generalized advantage estimation over a rollout of shape (num_steps, num_envs).

    `dones[t]` says that the episode ended at step t, so neither the value of the next state nor
    the next advantage flows back into step t.
    """

    def gae(rewards, values, dones, next_value):
        nextnonterminal = 1.0 - dones
        nextvalues = torch.cat([values[1:], next_value.unsqueeze(0)])
        deltas = rewards + gamma * nextvalues * nextnonterminal - values
        # The recursion itself is sequential; each step is two ops on a (num_envs,) row.
        decay = gamma * gae_lambda * nextnonterminal
        advantages = torch.empty_like(deltas)
        lastgaelam = torch.zeros_like(next_value)
        for t in range(deltas.shape[0] - 1, -1, -1):
            lastgaelam = deltas[t] + decay[t] * lastgaelam
            advantages[t] = lastgaelam
        return advantages, advantages + values

    return gae


def make_update(agent, optimizer, args, world_size=1, num_seeds=1):
    """One minibatch step on the rows `idx` of the rollout: gather, forward, backward
    (torch.func), `clip_grad_norm_`'s arithmetic on the gradients and `Adam`, as one function
    that compiles to one graph. Written with `loss.backward()` and `optim.Adam.step()` it broke
    into three graphs with eager glue between them and cost about 3x more per call on a CPU.
    Returns METRICS as one tensor that stays on the device.

    With `world_size` > 1 (under torchrun) the gradients and the metrics are averaged over the
    ranks before clipping, as one flat buffer in one `all_reduce` inside the same graph (dynamo
    traces it as a functional collective), so every rank takes the same Adam step and reads the
    same `--target-kl` and non-finite checks. The average of the ranks' minibatch means is the
    gradient of their minibatches together; advantages are normalized per rank, as in CleanRL's
    multi-GPU PPO.

    With `num_seeds` > 1 the parameters are stacked seeds (`stack_seeds`), the rollout tensors
    [seeds, batch, ...] and `idx` [seeds, minibatch]: torch.func.vmap maps the gradient and its
    clipping over the seeds, and one Adam step (elementwise) updates them all."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef
    norm_adv, clip_vloss, max_grad_norm = args.norm_adv, args.clip_vloss, args.max_grad_norm

    def loss_fn(params, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values):
        action_mean, logstd, newvalue = torch.func.functional_call(agent, params, (mb_obs,))
        newlogprob = (-0.5 * ((mb_actions - action_mean) / logstd.exp()).pow(2) - logstd - LOG_SQRT_2PI).sum(1)
        entropy = (0.5 + LOG_SQRT_2PI + logstd).sum(1)

        logratio = newlogprob - mb_logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()

        if norm_adv:
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        if clip_vloss:
            v_loss_unclipped = (newvalue - mb_returns) ** 2
            v_clipped = mb_values + torch.clamp(newvalue - mb_values, -clip_coef, clip_coef)
            v_loss_clipped = (v_clipped - mb_returns) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
        else:
            v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
        return loss, torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()

    grad_fn = torch.func.grad(loss_fn, has_aux=True)

    def clipped_grads(params, obs, actions, logprobs, advantages, returns, values, idx):
        minibatch = (obs[idx], actions[idx], logprobs[idx], advantages[idx], returns[idx], values[idx])
        grads, metrics = grad_fn(params, *minibatch)
        if world_size > 1:
            grads, metrics = all_reduce_mean(grads, metrics, world_size)
        # nn.utils.clip_grad_norm_
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        return {name: g * clip for name, g in grads.items()}, metrics

    if num_seeds > 1:
        clipped_grads = torch.func.vmap(clipped_grads)

    def update(*batch_and_idx):
        grads, metrics = clipped_grads(optimizer.params, *batch_and_idx)
        optimizer.step(grads)
        return metrics

    return update


METRICS = ["losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/old_approx_kl", "losses/approx_kl", "losses/clipfrac"]

CLIPFRAC, APPROX_KL = METRICS.index("losses/clipfrac"), METRICS.index("losses/approx_kl")


def init_distributed(args):
    """This process's (rank, world size, device). Under torchrun (WORLD_SIZE > 1 in the
    environment) it joins the process group, gloo on a CPU and nccl on CUDA unless --backend
    says otherwise, each rank on the GPU of its LOCAL_RANK; a single process makes no group.
    Every collective waits at most --dist-timeout, so a rank that stops (Ctrl-C, a crash) never
    leaves the others waiting for ever."""
    cuda = torch.cuda.is_available() and args.cuda
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = args.backend or ("nccl" if cuda else "gloo")
    if args.backend is not None or world_size > 1:
        if backend not in ("gloo", "nccl"):
            fail(f"--backend {backend} is not supported: use gloo (CPU or CUDA) or nccl (CUDA)")
        if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
            fail(f"this torch build has no {backend} backend: use --backend {'gloo' if backend == 'nccl' else 'nccl'}")
        if backend == "nccl" and not cuda:
            fail("--backend nccl needs a CUDA device (and no --no-cuda): use --backend gloo on a CPU")
    if world_size == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:
        if backend == "nccl" and local_rank >= torch.cuda.device_count():
            fail(f"rank {rank} has no GPU of its own ({torch.cuda.device_count()} visible; nccl needs one per process): start at most that many per node, or pass --backend gloo")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.dist_timeout))
    except Exception as e:  # the store, the backend and the rendezvous raise many types
        fail(f"rank {rank} could not join the {world_size} processes ({error_line(e)}): check that every node runs the same torchrun command and reaches --rdzv-endpoint")
    return rank, world_size, device


def error_line(e):
    """A torch.distributed error in one short line: gloo and c10d open theirs with the C++ source
    location and go on for lines."""
    line = (str(e).strip().splitlines() or [""])[0]
    if line.startswith("[") and "] " in line:
        line = line[line.index("] ") + 2:]
    return f"{type(e).__name__}: {line[:160]}"


def broadcast_parameters(params):
    """Rank 0's parameters to every rank, as one flat buffer: the same initial weights whatever
    each rank seeded or loaded."""
    params = [p.detach() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    for p, new in zip(params, flat.split([p.numel() for p in params])):
        p.copy_(new.view_as(p))


def all_reduce_mean(grads, metrics, world_size):
    """The mean over the ranks of the gradients (name -> tensor) and of the metrics, through one
    flat buffer and one `all_reduce`: one collective per step, not one per parameter."""
    flat = torch.cat([g.reshape(-1) for g in grads.values()] + [metrics])
    dist.all_reduce(flat)
    flat = flat / world_size
    *parts, metrics = flat.split([g.numel() for g in grads.values()] + [metrics.numel()])
    return {name: part.view(g.shape) for (name, g), part in zip(grads.items(), parts)}, metrics


def gather_episodes(episodes, rank, world_size):
    """Every rank's finished episodes of one iteration, (step, return, length) from Run.finished,
    on rank 0 in step order (an empty list on the other ranks). note: a host sync, once per
    iteration."""
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(episodes, gathered, dst=0)
    return sorted(e for rank_episodes in gathered for e in rank_episodes) if rank == 0 else []


def finish_distributed(run, params, world_size, lost):
    """At the end of a torchrun run: every rank's parameter checksum (rank 0's checkpoint must be
    every rank's model; ranks that drifted apart stop the run with exit 1), then leave the group.
    After Ctrl-C or a lost rank the others may be gone, so no collective is tried."""
    fields = {}
    if not run.interrupted and not lost:
        flat = torch.cat([p.detach().reshape(-1) for p in params]).double()
        # A position-weighted sum: a change in any one parameter, or two swapped, changes it.
        checksum = (flat * torch.arange(1, flat.numel() + 1, device=flat.device, dtype=flat.dtype)).sum().reshape(1)
        checksums = [torch.empty_like(checksum) for _ in range(world_size)]
        dist.all_gather(checksums, checksum)
        checksums = [float(c) for c in checksums]
        fields["rank_checksums"] = [repr(c) for c in checksums]
        if len(set(checksums)) > 1 and run.stop_reason is None:
            run.stop_reason = f"the ranks' parameters differ at the end (checksums {checksums}): the gradient all-reduce did not keep them identical"
    dist.destroy_process_group()
    return fields


def evaluate(agent, normalization, args, run_name, device):
    """Mean return of the deterministic policy (the action mean) over `eval_episodes` episodes,
    with the observation statistics frozen at those of the first training env."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    frozen = Normalization(1, normalization.mean.shape[1], eval_envs.single_action_space, args.gamma, device)
    frozen.load_state_dict(normalization.state_dict())
    frozen.training = False
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            action = agent.actor_mean(frozen.obs(obs.reshape(1, -1)))
            obs, _, _, _, infos = eval_envs.step(frozen.action(action.cpu().numpy()))
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
    rank, world_size, device = init_distributed(args)
    if device.type == "cpu":
        # One intra-op thread unless --threads says more (2-core CPU, --compile, steps/s with 1
        # and 2 threads): idle, DQN 5,847 and 4,191, PPO 2,139 and 1,995, Atari PQN 196 and 273,
        # Atari PPO 295 and 380; beside one busy process, DQN 4,916 and 1,543, PPO 1,999 and
        # 1,541, Atari PQN 177 and 110, Atari PPO 299 and 168. More threads pay only for the Atari
        # convolutions on an idle machine, and stall every script beside anything else.
        torch.set_num_threads(args.threads)
    # --num-envs is per rank: a batch is num_envs * num_steps per rank, all ranks' together per update.
    batch_size = args.num_envs * args.num_steps
    global_batch = batch_size * world_size
    if args.total_timesteps < global_batch and not (args.total_timesteps == 0 and args.load_model):
        per = f" * {world_size} ranks" if world_size > 1 else ""
        fail(f"--total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps{per} = {global_batch}): give at least {global_batch}")
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps): pass a divisor of it")
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: use at most {batch_size // 2}, or --no-norm-adv")
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // global_batch
    if num_seeds > 1:
        if world_size > 1:
            fail("--num-seeds runs several agents in one process: under torchrun give --num-seeds 1")
        if args.target_kl is not None:
            fail("--target-kl stops each seed's epochs at a different point, which one stacked update cannot: drop it or use --num-seeds 1")
        if args.seed + num_seeds > 2**32:
            fail(f"--seed {args.seed} + --num-seeds {num_seeds} passes 2**32: use a smaller seed")
        # One line before num_seeds x num_envs envs are made: float32 obs, action, logprob, value,
        # reward, done, advantage and return per step, and up to 1 MiB per sub-env (MuJoCo: about 1 MiB).
        probe = make_envs(args, "probe", 1)
        row_bytes = 4 * (math.prod(probe.single_observation_space.shape) + math.prod(probe.single_action_space.shape) + 6)
        probe.close()
        check_memory(num_seeds * (batch_size * row_bytes + args.num_envs * 2**20), device, f"--num-seeds {num_seeds} with --num-envs {args.num_envs}")
    run = Run(args, num_iterations * global_batch, rank=rank)
    runs = [run] + [Run(replace(args, seed=args.seed + k), run.total_steps, lead=run) for k in range(1, num_seeds)]

    # Each rank its own random streams (envs, exploration noise, minibatch order); the initial
    # weights come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs and rank == 0:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)
    if cudagraphs and world_size > 1 and dist.get_backend() != "nccl":
        # gloo runs its collectives on the host, where a CUDA graph cannot capture them.
        cudagraphs = False
        if rank == 0:
            print("notice: --cudagraphs under torchrun needs --backend nccl; running without CUDA graphs", file=sys.stderr)

    # Sub-env k * num_envs + i is env i of seed k.
    num_envs = num_seeds * args.num_envs
    envs = make_envs(args, run.name, num_envs, args.capture_video and rank == 0)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    agent = Agent(n_obs, n_act, device=device)
    # Under torchrun each rank normalizes observations by its own envs' statistics, as CleanRL's
    # multi-GPU PPO does: they are not synced (rank 0's are saved). Ranks see the same
    # distribution, so the statistics agree up to sampling noise.
    normalization = Normalization(num_envs, n_obs, envs.single_action_space, args.gamma, device)
    if args.load_model:
        load_checkpoint(args.load_model, {"agent": agent, "obs_rms": normalization}, args.env_id)
    if world_size > 1:
        broadcast_parameters(agent.parameters())
    # Acting uses a detached view of the same parameters: no autograd bookkeeping per step, and
    # every optimizer step is visible to it at once (the storages are shared).
    agent_inference = Agent(n_obs, n_act, device="meta")
    agents, params = [agent], from_module(agent).data
    for k in range(1, num_seeds):
        # Seed k starts from the weights a single run of seed + k starts from.
        torch.manual_seed(args.seed + k)
        agents.append(Agent(n_obs, n_act, device=device))
        if args.load_model:
            load_checkpoint(args.load_model, {"agent": agents[k]}, args.env_id)
    if num_seeds > 1:
        params = stack_seeds(agents)
    seed_networks = [{"agent": a, "obs_rms": normalization.seed(k, args.num_envs)} for k, a in enumerate(agents)]

    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # Eager updates step Adam with the fused kernel; a compiled update traces its per-tensor form.
    lr = torch.tensor(args.learning_rate, device=device)
    named = agent.named_parameters() if num_seeds == 1 else params.items()
    optimizer = Adam(named, lr, eps=1e-5, fused=not args.compile, capturable=device.type == "cuda")

    # Acting in numpy on a CPU; elsewhere in torch, one agent through its detached view, stacked
    # seeds through vmap.
    host = device.type == "cpu"
    if num_seeds == 1:
        params.to_module(agent_inference)
    seed_params = {name: p.detach().unsqueeze(0) for name, p in agent.named_parameters()} if num_seeds == 1 else dict(params.items())
    policy = make_policy(agent_inference, seed_params, num_seeds, host, seed=args.seed + rank)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agent, optimizer, args, world_size, num_seeds)
    # What --compile compiles (2-core CPU, torch 2.13, one thread, minibatch 64):
    # - update: 2.0 ms eager, 0.32 ms compiled (one graph); inductor's C++ wrapper measured
    #   0.26-0.27 ms alone but no faster in whole runs, and adds 7 s to a cold compile. Compiled
    #   on every device;
    # - policy: numpy on a CPU (make_policy); compiled elsewhere;
    # - gae: a sequential loop of num_steps steps (28 ms per 2048 here); compiling it would unroll
    #   all of them into one graph, so it stays eager;
    # - Normalization is numpy on the host (see the class).
    if args.compile:
        update = torch.compile(update, fullgraph=True, options={"guard_filter_fn": value_guards})
        if not host:
            policy = torch.compile(policy, options={"guard_filter_fn": value_guards})
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)

    def seeds_first(x):
        """A rollout [num_steps, num_seeds * num_envs, ...] as a batch [batch_size, ...], or with
        several seeds [num_seeds, batch_size, ...] (seed k's steps in row k)."""
        if num_seeds == 1:
            return x.reshape(batch_size, *x.shape[2:])
        return x.unflatten(1, (num_seeds, args.num_envs)).transpose(0, 1).reshape(num_seeds, batch_size, *x.shape[2:])

    global_step = updates = 0
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    next_obs, _ = envs.reset(seed=args.seed + rank if num_seeds == 1 else [args.seed + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    next_obs = normalization.obs(next_obs.reshape(num_envs, n_obs))
    next_done = torch.zeros(num_envs, device=device)
    lost = False
    try:
        for iteration in range(1, num_iterations + 1):
            lr_now = args.learning_rate
            if args.anneal_lr:
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
                lr.copy_(lr_now)

            obs_list, done_list, act_list, logprob_list, value_list, reward_list = [], [], [], [], [], []
            finished = []
            with torch.no_grad():
                for _ in range(args.num_steps):
                    global_step += args.num_envs * world_size
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    action, logprob, value = policy(next_obs)
                    obs_list.append(next_obs)
                    done_list.append(next_done)
                    act_list.append(action)
                    logprob_list.append(logprob)
                    value_list.append(value)
                    # note: a CPU-GPU sync point on CUDA; a no-copy view on a CPU
                    next_obs_np, reward, terminations, truncations, infos = envs.step(normalization.action(action.cpu().numpy()))
                    done_np = np.logical_or(terminations, truncations)
                    if done_np.any():
                        rows = np.flatnonzero(done_np)
                        normalization.final_obs(np.stack([infos["final_obs"][i] for i in rows]).reshape(len(rows), n_obs), rows)
                    reward_list.append(normalization.reward(reward, terminations))
                    next_obs = normalization.obs(next_obs_np.reshape(num_envs, n_obs))
                    next_done = torch.as_tensor(done_np.astype(np.float32), device=device)
                    if world_size > 1:
                        finished += run.finished(global_step, infos)
                    elif num_seeds == 1:
                        run.episodes(global_step, infos)
                    elif "final_info" in infos:
                        for k, seed_run in enumerate(runs):
                            seed_run.episodes(global_step, seed_slice(infos["final_info"], k, args.num_envs))

                obs_b = torch.stack(obs_list)
                dones = torch.stack(done_list[1:] + [next_done])
                values = torch.stack(value_list)
                rewards = torch.as_tensor(np.stack(reward_list), device=device, dtype=torch.float)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                next_value = policy(next_obs)[2].clone()
                advantages, returns = gae(rewards, values, dones, next_value)

            if world_size > 1:
                for step, r, n in gather_episodes(finished, rank, world_size):
                    run.record(step, r, n)

            act_b, logprob_b = torch.stack(act_list), torch.stack(logprob_list)
            batch = tuple(seeds_first(x) for x in (obs_b, act_b, logprob_b, advantages, returns, values))
            clipfrac_sum = torch.zeros(num_seeds, device=device).squeeze(0)
            for epoch in range(args.update_epochs):
                # Each seed its own minibatch order.
                order = torch.randperm(batch_size, device=device) if num_seeds == 1 else torch.rand(num_seeds, batch_size, device=device).argsort(1)
                for idx in order.split(minibatch_size, dim=-1):
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call: the last one is read.
                    metrics = update(*batch, idx)
                    clipfrac_sum += metrics[..., CLIPFRAC]
                    updates += 1
                # note: a host sync, once per epoch and only with --target-kl
                if args.target_kl is not None and metrics[APPROX_KL].item() > args.target_kl:
                    break

            # As CleanRL: the last minibatch's losses, clipfrac over all minibatches; per seed.
            y_pred, y_true = batch[5].view(num_seeds, -1), batch[4].view(num_seeds, -1)
            var_y = y_true.var(1, unbiased=False)
            explained_var = torch.where(var_y > 0, 1 - (y_true - y_pred).var(1, unbiased=False) / var_y, torch.nan)
            clipfrac = clipfrac_sum.view(num_seeds, 1) / ((epoch + 1) * args.num_minibatches)
            # note: the loop's only host sync is here, once per iteration
            seed_stats = torch.cat([metrics.view(num_seeds, -1)[:, :CLIPFRAC], clipfrac, explained_var.view(num_seeds, 1)], 1).tolist()
            seed_losses = [dict(zip([*METRICS, "losses/explained_variance"], stats)) for stats in seed_stats]
            bad = next(((k, name) for k, losses in enumerate(seed_losses) for name in METRICS if not math.isfinite(losses[name])), None)
            if bad:
                k, name = bad
                which = f" (seed {args.seed + k})" if num_seeds > 1 else ""
                for seed_run in runs:
                    seed_run.stop_reason = f"non-finite {name[len('losses/'):]} {seed_losses[k][name]} at step {global_step}{which}"
                break
            for seed_run, losses, networks in zip(runs, seed_losses, seed_networks):
                seed_run.log(global_step, updates, {"charts/learning_rate": lr_now, **losses}, networks)
    except KeyboardInterrupt:
        for seed_run in runs:
            seed_run.interrupted = run.interrupted or signal.SIGINT
    except RuntimeError as e:  # gloo's and nccl's errors (dist.DistError among them)
        if world_size == 1:
            raise
        # Under torchrun a rank that stops (Ctrl-C, a crash) or does not answer within
        # --dist-timeout ends the others' collectives with an error: end as after a bad loss.
        lost = True
        run.stop_reason = f"rank {rank} stopped at step {global_step}: another rank is gone or was silent for --dist-timeout ({error_line(e)})"
    envs.close()
    fields = finish_distributed(run, agent.parameters(), world_size, lost) if world_size > 1 else {}
    # The lead finishes last: its summary reports every seed.
    for seed_run, networks in reversed(list(zip(runs, seed_networks))):
        seed_run.finish(global_step, updates, networks, lambda: evaluate(networks["agent"], networks["obs_rms"], seed_run.args, seed_run.name, device),
                        device=device.type, cudagraphs=cudagraphs, world_size=world_size, batch_size=global_batch, **fields)


if __name__ == "__main__":
    main(tyro.cli(Args))

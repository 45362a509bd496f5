"""PPO for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

PPO (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with the details of CleanRL's
`ppo_continuous_action.py`, learning as that plain script does. What changes is where the time
goes: the minibatch step compiles to one graph, acting skips torch.distributions and autograd,
nothing syncs the host with the device between two log points but `--target-kl`, and the
normalization wrappers run once per vector step on the whole batch.

    python leanrl/ppo_continuous_action_torchcompile.py
    python leanrl/ppo_continuous_action_torchcompile.py --compile
    python leanrl/ppo_continuous_action_torchcompile.py --compile --cudagraphs

Under torchrun it is data-parallel: --num-envs per process, each step's gradients averaged over all.

    torchrun --standalone --nproc_per_node 2 leanrl/ppo_continuous_action_torchcompile.py --compile
"""

import copy
import importlib.util
import math
import os
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tensordict.nn import CudaGraphModule

from leanrl_utils import acting, checks, cli, fail, optimizers, resume, seeds, speed, torchrun, vector


@dataclass
class Args(resume.Flags):
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
    """intra-op threads on a CPU (one wins beside any other process)"""
    backend: str | None = None
    """the torch.distributed backend under torchrun: gloo or nccl (default: nccl on CUDA, gloo on a CPU)"""
    dist_timeout: float = 300.0
    """seconds a rank under torchrun waits for the others (to start, at each collective) before it stops"""


# log N(x; mu, std) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), written out because
# building a torch.distributions.Normal costs more than the arithmetic at these sizes.
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def normal_logprob(z, logstd):
    """The log-density of a diagonal Gaussian at z = (x - mean) / std, summed over the action's
    dimensions: Normal(mean, std).log_prob(x).sum(-1), for torch tensors and numpy arrays alike."""
    return (-0.5 * z**2 - logstd - LOG_SQRT_2PI).sum(-1)


def make_env(env_id, idx, capture_video, run_name):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        if not isinstance(env.action_space, gym.spaces.Box):
            fail(f"{env_id} has a {type(env.action_space).__name__} action space; this script handles continuous actions only")
        if not (isinstance(env.observation_space, gym.spaces.Box) and len(env.observation_space.shape) == 1):
            env = gym.wrappers.FlattenObservation(env)
        # Counted on the raw reward, so that the reported returns are the true ones. The rest of
        # CleanRL's per-env stack is `Normalization`, once per vector step on the whole batch.
        return gym.wrappers.RecordEpisodeStatistics(env)

    return thunk


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


def make_update(agent, optimizer, args, world_size=1, num_seeds=1):
    """One minibatch step on the rows `idx` of the rollout: gather, forward, backward (torch.func),
    `clip_grad_norm_`'s arithmetic and `optimizers.Adam`, one function that compiles to one graph (with
    `loss.backward()` and `optim.Adam.step()` it broke into three). Returns METRICS on the device.
    `world_size` > 1 (torchrun): gradients and metrics averaged over the ranks by one `all_reduce`
    in the graph (advantages normalized per rank, as CleanRL's multi-GPU PPO). `num_seeds`: stacked
    seeds [seeds, ...] (parameters, rollout, `idx`, metrics), the gradient and its clipping vmapped,
    a stack of one the agent's own ops (`seeds.vmap`)."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef
    norm_adv, clip_vloss, max_grad_norm = args.norm_adv, args.clip_vloss, args.max_grad_norm

    def loss_fn(params, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values):
        action_mean, logstd, newvalue = torch.func.functional_call(agent, params, (mb_obs,))
        newlogprob = normal_logprob((mb_actions - action_mean) / logstd.exp(), logstd)
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
            grads, metrics = torchrun.all_reduce_mean(grads, metrics, world_size)
        # nn.utils.clip_grad_norm_
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        return {name: g * clip for name, g in grads.items()}, metrics

    seeds_grads = seeds.vmap(clipped_grads, num_seeds)

    def update(*batch_and_idx):
        grads, metrics = seeds_grads(optimizer.params, *batch_and_idx)
        optimizer.step(grads)
        return metrics

    return update


METRICS = [f"losses/{name}" for name in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")]
CLIPFRAC, APPROX_KL = METRICS.index("losses/clipfrac"), METRICS.index("losses/approx_kl")
# What each seed logs per iteration: the last minibatch's losses, clipfrac over all minibatches.
STATS = [*METRICS, "losses/explained_variance"]


def make_gae(gamma, gae_lambda):
    """Generalized advantage estimation over a rollout (num_steps, num_envs). `dones[t]`: the episode
    ended at step t, so neither the next state's value nor the next advantage flows back into it."""

    def gae(rewards, values, dones, next_value):
        nextnonterminal = 1.0 - dones
        nextvalues = torch.cat([values[1:], next_value.unsqueeze(0)])
        deltas = rewards + gamma * nextvalues * nextnonterminal - values
        decay = gamma * gae_lambda * nextnonterminal
        advantages = torch.empty_like(deltas)
        lastgaelam = torch.zeros_like(next_value)
        for t in range(deltas.shape[0] - 1, -1, -1):
            lastgaelam = deltas[t] + decay[t] * lastgaelam
            advantages[t] = lastgaelam
        return advantages, advantages + values

    return gae


def make_policy(agent, params, num_seeds, host, seed=0):
    """Acting on observations [seeds * envs, n_obs] (seed k's envs in block k): each seed's actor and
    critic (`params` stacked), a Gaussian action and its log-probability. Derived from `agent`: `host`
    (a CPU), numpy (`acting.numpy_forward`, noise from a generator seeded with `seed`), where an op on a few
    numbers costs less than a torch op; else torch (`seeds.forward`), which CUDA compiles and graphs."""
    if host:
        forward, rng = acting.numpy_forward(agent, params), np.random.default_rng(seed)

        def host_policy(obs):
            action_mean, logstd, value = forward(obs.numpy().reshape(num_seeds, -1, obs.shape[-1]))
            noise = rng.standard_normal(action_mean.shape, dtype=np.float32)
            logprob = normal_logprob(noise, logstd)
            action = (action_mean + np.exp(logstd) * noise).reshape(-1, action_mean.shape[-1])
            return torch.from_numpy(action), torch.from_numpy(logprob.ravel()), torch.from_numpy(value.ravel())

        return host_policy

    forward = seeds.forward(agent)

    def policy(obs):
        action_mean, logstd, value = (x.flatten(0, 1) for x in forward(params, obs.view(num_seeds, -1, obs.shape[-1])))
        noise = torch.randn_like(action_mean)
        action = action_mean + logstd.exp() * noise
        logprob = normal_logprob(noise, logstd)
        return action, logprob, value

    return policy


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
    if capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display (a user's MUJOCO_GL wins).
        os.environ.setdefault("MUJOCO_GL", "egl")
    thunks = [make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: every stored step is a real transition, and GAE cuts the bootstrap
        # at `done` exactly as in the gym 0.26 loop CleanRL was written for.
        envs = vector.SameStepEnvs(thunks)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    return envs


def rms_update(mean, var, count, x):
    """gymnasium's RunningMeanStd.update in place, one sample per sub-env (row of `x`), in its order
    of operations (batch_var 0, batch_count 1): the float64 statistics are the wrappers' to the bit."""
    delta = x - mean
    total = count + 1
    mean += delta / total
    var[...] = (var * count + np.square(delta) * count / total) / total
    count[...] = total


def clip(x, low, high):
    """np.clip(x, low, high), at half its cost on a few numbers."""
    return np.minimum(np.maximum(x, low), high)


class Normalization:
    """CleanRL's per-env wrappers (NormalizeObservation, NormalizeReward(gamma), each clipped at +-10,
    ClipAction) once per vector step on the whole batch in numpy: their Python per sub-env costs more
    than a MuJoCo step. Their statistics, per sub-env in float64: running mean, var and count (from
    1e-4) of every observation, final ones included; a discounted return `ret = ret * gamma * (1 -
    terminated) + reward` (kept at a truncation, as gymnasium 1.4) whose running variance scales the
    rewards. state_dict: the observation statistics, as the plain script's; `training = False` freezes them."""

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

    def final_obs(self, final_obs, rows):
        """The update for the final observations (infos["final_obs"]) of the sub-envs `rows`."""
        if self.training:
            mean, var, count = self.mean[rows], self.var[rows], self.count[rows]
            rms_update(mean, var, count, np.stack([final_obs[i] for i in rows]).reshape(len(rows), -1).astype(np.float64))
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
        return {k: torch.from_numpy(v) for k, v in (("mean", self.mean), ("var", self.var), ("count", self.count[:, 0]))}

    def seed(self, k, num_envs):
        """Seed k's sub-envs (k * num_envs onwards), on views of these statistics: what it saves."""
        part, rows = copy.copy(self), slice(k * num_envs, (k + 1) * num_envs)
        part.mean, part.var, part.count = self.mean[rows], self.var[rows], self.count[rows]
        return part

    def load_state_dict(self, state):
        if state["mean"].shape[1:] != self.mean.shape[1:]:
            raise RuntimeError("observation size mismatch")
        rows = np.minimum(np.arange(len(self.count)), len(state["count"]) - 1)  # fewer envs: the last one's for the rest
        self.mean[...] = state["mean"].numpy()[rows]
        self.var[...] = state["var"].numpy()[rows]
        self.count[...] = state["count"].numpy()[rows].reshape(-1, 1)


def evaluate(agent, normalization, args, run_name, device):
    """Mean return of the action mean over `eval_episodes` episodes, with the first env's statistics frozen."""
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


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args)
    rank, world_size, device = torchrun.init(args)
    _, cudagraphs = speed.setup(args, rank)
    if cudagraphs and world_size > 1 and dist.get_backend() != "nccl":
        # gloo runs its collectives on the host, where a CUDA graph cannot capture them.
        cudagraphs = False
        if rank == 0:
            print("notice: --cudagraphs under torchrun needs --backend nccl; running without CUDA graphs", file=sys.stderr)
    # --num-envs is per rank: a batch is num_envs * num_steps per rank, all ranks' together per update.
    batch_size = args.num_envs * args.num_steps
    global_batch = batch_size * world_size
    if args.total_timesteps < global_batch and not (args.total_timesteps == 0 and args.load_model):
        per = f" * {world_size} ranks" if world_size > 1 else ""
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps{per} = {global_batch}): "
            f"give at least {global_batch}"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps): "
            "pass a divisor of it"
        )
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(
            f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: "
            f"use at most {batch_size // 2}, or --no-norm-adv"
        )
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // global_batch
    if num_seeds > 1:
        if world_size > 1:
            fail("--num-seeds runs several agents in one process: under torchrun give --num-seeds 1")
        if args.target_kl is not None:
            fail("--target-kl stops each seed at another epoch, which one stacked update cannot: drop it or use --num-seeds 1")
    # One line before the envs are made: 4 bytes for each obs, action and 6 scalars per step, 1 MiB per sub-env.
    checks.rollout(args, 4 * (sum(vector.env_sizes(args.env_id)) + 6), device, per_env=2**20)
    runs = seeds.runs(args, num_iterations * global_batch, __file__, resumed, rank=rank)
    run = runs[0]

    # Each rank its own random streams (envs, noise, minibatch order); the weights are rank 0's.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # Sub-env k * num_envs + i is env i of seed k.
    num_envs = num_seeds * args.num_envs
    envs = make_envs(args, run.name, num_envs, args.capture_video and rank == 0)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    agent = Agent(n_obs, n_act, device=device)
    # Under torchrun each rank normalizes by its own envs' statistics (rank 0's are saved), as
    # CleanRL's multi-GPU PPO does: the ranks see the same distribution.
    normalization = Normalization(num_envs, n_obs, envs.single_action_space, args.gamma, device)
    if args.load_model:
        run.load({"agent": agent, "obs_rms": normalization})
    if world_size > 1:
        torchrun.broadcast(agent.parameters())
    agents = [agent]
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        agents.append(Agent(n_obs, n_act, device=device))
        if args.load_model:
            run.load({"agent": agents[k]})
    params = seeds.stack(agents)
    seed_networks = [{"agent": a, "obs_rms": normalization.seed(k, args.num_envs)} for k, a in enumerate(agents)]

    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # Eager updates step optimizers.Adam with the fused kernel; a compiled update traces its per-tensor form.
    lr = torch.tensor(args.learning_rate, device=device)
    optimizer = optimizers.Adam(params.items(), lr, eps=1e-5, fused=not args.compile, capturable=device.type == "cuda")
    policy = make_policy(agent, dict(params.items()), num_seeds, device.type == "cpu", seed=args.seed + rank)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agent, optimizer, args, world_size, num_seeds)
    # --compile: the update everywhere; the policy off a CPU (numpy acts there); GAE stays eager,
    # as compiling its sequential loop would unroll num_steps steps into one graph.
    if args.compile:
        # use_decompose_tanh: inductor's C++ code computes tanh as 2 / (1 + exp(-2x)) - 1 (within
        # 2e-7 of torch.tanh): its vectorized tanh cost several times eager's (benchmark/RESULTS.md).
        update = torch.compile(
            update, fullgraph=True, options={"guard_filter_fn": speed.value_guards, "cpp.use_decompose_tanh": True}
        )
        if device.type != "cpu":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update, policy = CudaGraphModule(update), CudaGraphModule(policy)

    # A rollout [num_steps, seeds * envs, ...] as a batch per seed [seeds, batch_size, ...].
    by_seed = lambda x: x.unflatten(1, (num_seeds, -1)).transpose(0, 1).reshape(num_seeds, batch_size, *x.shape[2:])

    global_step = updates = 0
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    next_obs, _ = envs.reset(seed=[args.seed + rank + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    next_obs = normalization.obs(next_obs.reshape(num_envs, n_obs))
    next_done = torch.zeros(num_envs, device=device)
    lost = False
    objects = {"params": params, "optimizer": optimizer, "normalization": normalization, "envs": envs, "policy": policy}
    loop = lambda: (global_step, updates, next_obs, next_done)
    global_step, updates, next_obs, next_done = run.resume(objects, loop, device)
    try:
        for iteration in range(global_step // global_batch + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            lr.copy_(lr_now)

            rollout, reward_list, finished = [], [], []
            with torch.no_grad():
                for _ in range(args.num_steps):
                    global_step += args.num_envs * world_size
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    action, logprob, value = policy(next_obs)
                    rollout.append((next_obs, next_done, action, logprob, value))
                    # note: a CPU-GPU sync point on CUDA; a no-copy view on a CPU
                    raw_obs, reward, terminations, truncations, infos = envs.step(normalization.action(action.cpu().numpy()))
                    done_np = np.logical_or(terminations, truncations)
                    if done_np.any():
                        normalization.final_obs(infos["final_obs"], np.flatnonzero(done_np))
                    reward_list.append(normalization.reward(reward, terminations))
                    next_obs = normalization.obs(raw_obs.reshape(num_envs, n_obs))
                    next_done = torch.as_tensor(done_np.astype(np.float32), device=device)
                    if world_size > 1:
                        finished += vector.ended_episodes(global_step, infos)
                    else:
                        seeds.episodes(runs, global_step, infos, args.num_envs)

                obs_b, done_b, act_b, logprob_b, values = (torch.stack(x) for x in zip(*rollout))
                dones = torch.cat([done_b[1:], next_done[None]])
                rewards = torch.as_tensor(np.stack(reward_list), device=device, dtype=torch.float)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                next_value = policy(next_obs)[2].clone()
                advantages, returns = gae(rewards, values, dones, next_value)

            for step, r, n in torchrun.gather_episodes(finished, rank, world_size) if world_size > 1 else []:
                run.record(step, r, n)

            batch = tuple(by_seed(x) for x in (obs_b, act_b, logprob_b, advantages, returns, values))
            clipfrac_sum = torch.zeros(num_seeds, device=device)
            for epoch in range(args.update_epochs):
                # Each seed its own minibatch order.
                order = torch.stack([torch.randperm(batch_size, device=device) for _ in range(num_seeds)])
                for idx in order.split(minibatch_size, dim=1):
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call: the last one is read.
                    metrics = update(*batch, idx)
                    clipfrac_sum += metrics[:, CLIPFRAC]
                    updates += 1
                # note: a host sync, once per epoch and only with --target-kl (one seed)
                if args.target_kl is not None and metrics[0, APPROX_KL].item() > args.target_kl:
                    break

            y_pred, y_true = batch[5], batch[4]
            var_y = y_true.var(1, unbiased=False)
            explained_var = torch.where(var_y > 0, 1 - (y_true - y_pred).var(1, unbiased=False) / var_y, torch.nan)
            clipfrac = clipfrac_sum / ((epoch + 1) * args.num_minibatches)
            stats = torch.cat([metrics[:, :CLIPFRAC], clipfrac[:, None], explained_var[:, None]], 1).T
            # note: the loop's only host sync is here, once per iteration
            if not seeds.log(runs, global_step, updates, stats, STATS, seed_networks, **{"charts/learning_rate": lr_now}):
                break
    except RuntimeError as e:  # gloo's and nccl's errors (dist.DistError among them)
        if world_size == 1:
            raise
        # Under torchrun a rank gone or silent ends the others' collectives with an error: end as after a bad loss.
        lost = True
        gone = f"another rank is gone or was silent for --dist-timeout ({torchrun.error_line(e)})"
        run.stop_reason = f"rank {rank} stopped at step {global_step}: {gone}"
    envs.close()
    fields = torchrun.leave(run, agent.parameters(), world_size, lost) if world_size > 1 else {}
    seeds.finish(
        runs, global_step, updates, seed_networks,
        lambda nets, seed_args, name: evaluate(nets["agent"], nets["obs_rms"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs, world_size=world_size, batch_size=global_batch, **fields,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

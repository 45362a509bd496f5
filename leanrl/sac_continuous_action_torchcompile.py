"""SAC for continuous actions, lean: tensordict, batched critics, torch.compile and CUDA graphs.

Soft Actor-Critic (Haarnoja et al., 2018, https://arxiv.org/abs/1801.01290, with the automatic
entropy tuning of https://arxiv.org/abs/1812.05905) with the details and defaults of CleanRL's
`sac_continuous_action.py`. It learns as the plain script `sac_continuous_action.py` does; what
changes is where the time goes: the twin critics are one batched call of SoftQNetwork's forward
over their stacked parameters (torch.func.vmap), the target update is one `lerp_`, the replay
buffer lives on the training device and is gathered inside the update, each update (gather,
forward, backward, optimizers.Adam) is one function that compiles to one graph, the actor's step never
computes the critics' weight gradients, and nothing syncs the host with the device between two
log points.

    python leanrl/sac_continuous_action_torchcompile.py
    python leanrl/sac_continuous_action_torchcompile.py --compile
    python leanrl/sac_continuous_action_torchcompile.py --compile --cudagraphs
"""

import importlib.util
import math
import os
import random
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from leanrl_utils import checks, cli, fail, optimizers, resume, seeds, speed, vector
from leanrl_utils.buffers import ReplayBuffer


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
    """the batch size of sample from the replay memory"""
    learning_starts: int = 5_000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """Entropy regularization coefficient."""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (one wins beside any other process)"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100


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
        self.register_buffer(
            "action_scale", torch.tensor((action_high - action_low) / 2.0, dtype=torch.float32, device=device)
        )
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


def make_update(actor, qf, target_params, alpha, q_optimizer, actor_optimizer, a_optimizer, storage, gamma):
    """update_critic(idx): one step of both Q-networks (`qf`'s forward on the stacked parameters
    of `q_optimizer`, and `target_params` for their targets) on the rows `idx` of the replay storage;
    update_actor(idx): one of the actor, and of log alpha when `a_optimizer` is given (--autotune),
    updating the tensor `alpha` in place (no host sync, no recompile). Gradients come from
    torch.func and the steps from `optimizers.Adam`, so that each update (gather, forward, backward, optimizers.Adam) is
    one graph under torch.compile. Each returns its METRICS as one tensor that stays on the device."""
    action_scale, action_bias = actor.action_scale, actor.action_bias
    target_entropy = -float(action_scale.numel())
    q_params, actor_params = q_optimizer.params, actor_optimizer.params
    target = dict(target_params.items())  # the very tensors lerp_ updates
    # Both Q-networks in one call: SoftQNetwork's own forward over their stacked parameters.
    critic = seeds.forward(qf, shared=(0, 1))

    def critic_loss(q_params, obs, actions, next_q_value):
        q_a_values = critic(q_params, obs, actions).view(2, -1)
        q_losses = (q_a_values - next_q_value).pow(2).mean(1)
        qf_loss = q_losses.sum()
        # CleanRL logs half the critics' summed loss as losses/qf_loss.
        metrics = torch.stack([qf_loss / 2, q_losses[0], q_losses[1], q_a_values[0].mean(), q_a_values[1].mean()])
        return qf_loss, metrics.detach()

    def actor_loss(actor_params, obs):
        pi, log_pi, _ = squashed_sample(*torch.func.functional_call(actor, actor_params, (obs,)), action_scale, action_bias)
        # The critics' parameters are constants here: their weight gradients, which CleanRL
        # computes in this step and throws away at the next critic step, are never computed
        # (half of the critics' backward matmuls in the actor step).
        min_qf_pi = critic(q_params, obs, pi).min(0).values
        return ((alpha * log_pi) - min_qf_pi).mean()

    def alpha_loss(log_alpha, log_pi):
        return (-log_alpha.exp() * (log_pi + target_entropy)).mean()

    critic_grad = torch.func.grad(critic_loss, has_aux=True)
    actor_grad = torch.func.grad_and_value(actor_loss)
    alpha_grad = torch.func.grad_and_value(alpha_loss)

    def update_critic(idx):
        obs, actions, next_obs = storage["obs"][idx], storage["actions"][idx], storage["next_obs"][idx]
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(next_obs)
            q_next_target = critic(target, next_obs, next_state_actions)
            min_qf_next_target = q_next_target.min(0).values - alpha * next_state_log_pi
            next_q_value = storage["rewards"][idx] + (1 - storage["dones"][idx]) * gamma * min_qf_next_target.view(-1)
        grads, metrics = critic_grad(q_params, obs, actions, next_q_value)
        q_optimizer.step(grads)
        return metrics

    def update_actor(idx):
        obs = storage["obs"][idx]
        grads, loss = actor_grad(actor_params, obs)
        actor_optimizer.step(grads)
        if a_optimizer is None:
            return torch.stack([loss, alpha.view(())]).detach()
        with torch.no_grad():
            _, log_pi, _ = actor.get_action(obs)
        log_alpha = a_optimizer.params["log_alpha"]
        grad, a_loss = alpha_grad(log_alpha, log_pi)
        a_optimizer.step({"log_alpha": grad})
        alpha.copy_(log_alpha.exp())
        return torch.stack([loss, alpha.view(()), a_loss]).detach()

    return update_critic, update_actor


# The critic step returns the first five, the actor step the rest (alpha_loss with --autotune).
METRICS = [
    "losses/qf_loss", "losses/qf1_loss", "losses/qf2_loss", "losses/qf1_values", "losses/qf2_values",
    "losses/actor_loss", "losses/alpha", "losses/alpha_loss",
]  # fmt: skip


def make_policy(actor):
    """Acting: a sampled action, from a copy of the actor on detached views of its parameters."""

    def policy(obs):
        return actor.get_action(obs)[0]

    return policy


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
    if capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")
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
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(
            f"{args.env_id} has a {type(envs.single_action_space).__name__} action space; "
            "SAC handles continuous (Box) actions only (e.g. Pendulum-v1)"
        )
    return envs


def evaluate(actor, args, run_name, device):
    """Mean return of the deterministic policy (the squashed mean action) over `eval_episodes`
    episodes on a fresh env."""
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
    resumed = resume.read(args, __file__)
    checks.flags(args)
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    if args.num_envs > args.buffer_size:
        fail(
            f"--num-envs {args.num_envs} is larger than --buffer-size {args.buffer_size}: "
            "make the buffer hold a step of every env"
        )
    num_iterations = args.total_timesteps // args.num_envs
    runs = seeds.runs(args, num_iterations * args.num_envs, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device, cudagraphs = speed.setup(args)

    envs = make_envs(args, run.name, args.num_envs, args.capture_video)
    envs.action_space.seed(args.seed)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    action_low, action_high = envs.single_action_space.low, envs.single_action_space.high

    actor = Actor(n_obs, n_act, action_low, action_high, device=device)
    qf1, qf2 = SoftQNetwork(n_obs, n_act, device=device), SoftQNetwork(n_obs, n_act, device=device)
    entropy = nn.ParameterDict({"log_alpha": nn.Parameter(torch.zeros(1, device=device), requires_grad=args.autotune)})
    networks = {"actor": actor, "qf1": qf1, "qf2": qf2, "entropy": entropy}
    if args.load_model:
        run.load(networks)
    log_alpha = entropy["log_alpha"]
    if not args.autotune:
        log_alpha.fill_(math.log(args.alpha))
    alpha = log_alpha.detach().exp()
    # The two Q-networks' parameters stacked (qf1 and qf2 become views of their halves, for
    # checkpoints), and their targets as its copy: the Polyak update is one lerp_.
    q_params = seeds.stack([qf1, qf2])
    target_params = q_params.clone()
    actor_detach = Actor(n_obs, n_act, action_low, action_high, device="meta")
    from_module(actor).data.to_module(actor_detach)
    # optimizers.Adam: fused (one kernel for all parameters) when the updates run eager; the single-tensor
    # loop, which inductor fuses into the update's graph, when they are compiled. On CUDA its
    # step counts live on the device (capturable): no host sync, and CUDA graphs can capture it.
    opt = dict(fused=not args.compile, capturable=device.type == "cuda")
    q_optimizer = optimizers.Adam(q_params.items(), args.q_lr, **opt)
    actor_optimizer = optimizers.Adam(actor.named_parameters(), args.policy_lr, **opt)
    a_optimizer = optimizers.Adam([("log_alpha", log_alpha)], args.q_lr, **opt) if args.autotune else None

    # Before learning starts, steps go to the device in blocks of up to LOG_EVERY steps; after,
    # each update's sample copies the one step staged since the last.
    stage_steps = max(1, min(LOG_EVERY, args.buffer_size // args.num_envs))
    fields = {
        "obs": ((n_obs,), torch.float32), "actions": ((n_act,), torch.float32), "rewards": ((), torch.float32),
        "next_obs": ((n_obs,), torch.float32), "dones": ((), torch.float32),
    }  # fmt: skip
    rb = ReplayBuffer(args.buffer_size, fields, stage_steps * args.num_envs, device)

    policy = make_policy(actor_detach)
    update_critic, update_actor = make_update(
        actor, qf1, target_params, alpha, q_optimizer, actor_optimizer, a_optimizer, rb.storage, args.gamma
    )
    # --compile: each update is one graph (gather, forward, torch.func backward, optimizers.Adam), which
    # loss.backward() and optim.Adam would break into several. The policy, for one observation,
    # only on CUDA, where kernel launches bound these small networks: on a CPU its guards cost more
    # than fusion saves.
    if args.compile:
        # fallback_random: on a CPU the action noise inside the compiled updates comes from torch's own
        # kernel, much faster than inductor's, and the same numbers as an eager update draws.
        options = {"guard_filter_fn": speed.value_guards, "fallback_random": device.type == "cpu"}
        update_critic = torch.compile(update_critic, fullgraph=True, options=options)
        update_actor = torch.compile(update_actor, fullgraph=True, options=options)
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update_critic, update_actor, policy = speed.interruptible(run, update_critic, update_actor, policy)
    if cudagraphs:
        update_critic = CudaGraphModule(update_critic)
        update_actor = CudaGraphModule(update_actor)
        policy = CudaGraphModule(policy)

    global_step = updates = 0
    critic_metrics = actor_metrics = None
    obs, _ = envs.reset(seed=args.seed)
    optimizer_states = {
        "q_optimizer": q_optimizer,
        "actor_optimizer": actor_optimizer,
        "a_optimizer": args.autotune and a_optimizer,
    }
    objects = {"actor": actor, "entropy": entropy, "alpha": alpha, "q_params": q_params, "target_params": target_params}
    objects |= {**optimizer_states, "rb": rb, "envs": envs}
    loop = lambda: (global_step, updates, obs, critic_metrics, actor_metrics)
    global_step, updates, obs, critic_metrics, actor_metrics = run.resume(objects, loop, device)
    # Gradients come from torch.func inside the updates, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // args.num_envs, num_iterations):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            if global_step < args.learning_starts:
                actions = envs.action_space.sample()
            else:
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
                actions = policy(torch.as_tensor(obs, device=device, dtype=torch.float)).cpu().numpy()
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs
            seeds.episodes(runs, global_step, infos, args.num_envs)

            # The done flag is the termination only: a time-limit truncation still bootstraps
            # from the true last observation (see make_envs for the autoreset).
            real_next = vector.real_next_obs(next_obs, infos)
            rb.add(obs=obs, actions=actions, rewards=rewards, next_obs=real_next, dones=terminations)
            obs = next_obs

            if global_step > args.learning_starts:
                idx = rb.sample(args.batch_size)
                # Graphed outputs are overwritten by the next call; only the latest is read.
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                critic_metrics = update_critic(idx)
                updates += 1
                if updates % args.policy_frequency == 0:  # TD 3 Delayed update support
                    # compensate for the delay by doing 'actor_update_interval' instead of 1
                    for _ in range(args.policy_frequency):
                        if cudagraphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        actor_metrics = update_actor(idx)
                if updates % args.target_network_frequency == 0:
                    target_params.lerp_(q_params, args.tau)

            if global_step // LOG_EVERY > (global_step - args.num_envs) // LOG_EVERY or iteration == num_iterations - 1:
                # note: the loop's only host sync is here, at the log points
                metrics = [m for m in (critic_metrics, actor_metrics) if m is not None] or [torch.empty(0)]
                metrics = torch.cat(metrics)
                if not seeds.log(runs, global_step, updates, metrics.unsqueeze(1), METRICS[: len(metrics)], [networks]):
                    break
    envs.close()
    seeds.finish(
        runs, global_step, updates, [networks],
        lambda nets, seed_args, name: evaluate(nets["actor"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

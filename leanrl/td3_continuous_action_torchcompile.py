"""TD3 for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

Twin Delayed Deep Deterministic policy gradient (Fujimoto et al., 2018,
https://arxiv.org/abs/1802.09477), learning as the plain `td3_continuous_action.py` (CleanRL's)
does: clipped double-Q learning with twin critics, delayed policy and target updates, and target
policy smoothing. What changes is where the time goes: the replay buffer lives on the device and
is gathered inside the update, the twin critics run as one batched call of QNetwork over their
stacked parameters, each update (gather, target, both losses, backward, optimizers.Adam) compiles to one
graph, the targets move by one lerp_, and nothing syncs the host with the device between two log
points.

    python leanrl/td3_continuous_action_torchcompile.py
    python leanrl/td3_continuous_action_torchcompile.py --compile
    python leanrl/td3_continuous_action_torchcompile.py --compile --cudagraphs
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
from tensordict import TensorDict, from_module
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
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    return thunk


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


def make_critics(q_network):
    """The twin critics, both QNetwork's own forward (torch.func over `q_network`, so that an edit
    of QNetwork reaches the update): `critic(params, obs, actions)` -> [2, batch, 1] from their
    parameters stacked by `seeds.stack`, one batched call for both; `first_critic`, the first alone
    -> [batch, 1]."""

    def first_critic(params, obs, actions):
        return torch.func.functional_call(q_network, {name: p[0] for name, p in params.items()}, (obs, actions))

    return seeds.forward(q_network, shared=(0, 1)), first_critic


def make_update(q_network, actor, target_actor, q_optimizer, actor_optimizer, q_target_params, storage, action_bounds, args):
    """The two update steps on the minibatch at rows `idx` of the replay storage: the critics
    only, and the critics then the actor (every `policy_frequency`-th); two functions, as a flag
    would compile the same code twice. Gradients come from torch.func and the steps from `optimizers.Adam`,
    so that each update is one graph. Returns the metrics as one tensor that stays on the device,
    in the order of METRICS."""
    gamma, policy_noise, noise_clip = args.gamma, args.policy_noise, args.noise_clip
    action_low, action_high = action_bounds
    critic, first_critic = make_critics(q_network)
    # What torch.func differentiates with respect to: the detached parameters that optimizers.Adam updates
    # in place (the modules' parameters share their storage).
    q_params, actor_params = q_optimizer.params, actor_optimizer.params

    def critic_loss(params, obs, actions, next_q_value):
        qf_a_values = critic(params, obs, actions).view(2, -1)
        qf_losses = (qf_a_values - next_q_value).pow(2).mean(1)
        return qf_losses.sum(), torch.cat([qf_losses.mean().view(1), qf_losses, qf_a_values.mean(1)]).detach()

    def actor_loss(params, obs):
        # The first critic after its step, as in CleanRL; its parameters are constants here, so
        # only the gradient with respect to the action flows back.
        return -first_critic(q_params, obs, torch.func.functional_call(actor, params, (obs,))).mean()

    critic_grad = torch.func.grad(critic_loss, has_aux=True)
    actor_grad = torch.func.grad_and_value(actor_loss)

    def critic_step(idx):
        batch = {key: value[idx] for key, value in storage.items()}
        with torch.no_grad():
            noise = (torch.randn_like(batch["actions"]) * policy_noise).clamp(-noise_clip, noise_clip)
            clipped_noise = noise * target_actor.action_scale
            next_state_actions = (target_actor(batch["next_obs"]) + clipped_noise).clamp(action_low, action_high)
            min_qf_next_target = critic(q_target_params, batch["next_obs"], next_state_actions).amin(0).view(-1)
            next_q_value = batch["rewards"] + (1 - batch["dones"]) * gamma * min_qf_next_target
        grads, metrics = critic_grad(q_params, batch["obs"], batch["actions"], next_q_value)
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


# The losses first: a non-finite one is reported by the first name (seeds.log).
METRICS = [
    "losses/qf_loss",
    "losses/qf1_loss",
    "losses/qf2_loss",
    "losses/qf1_values",
    "losses/qf2_values",
    "losses/actor_loss",
]


def make_policy(actor, exploration_noise, action_low, action_high):
    """Acting: the deterministic action plus Gaussian exploration noise, drawn on the device.
    `actor` runs on detached views of the trained parameters: no autograd bookkeeping per step,
    and every optimizers.Adam step is seen at once."""

    def policy(obs):
        action = actor(obs)
        action = action + torch.randn_like(action) * actor.action_scale * exploration_noise
        return action.clamp(action_low, action_high)

    return policy


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
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
    action_space, observation_space = envs.single_action_space, envs.single_observation_space
    if not isinstance(action_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(action_space).__name__} action space; TD3 handles continuous (Box) actions only")
    if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
        fail(
            f"{args.env_id} has observations of type {type(observation_space).__name__}; "
            "this script handles flat Box observations only"
        )
    return envs


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed going from step - n to step: with
    several envs the counter moves by num_envs at a time."""
    return step // every - (step - n) // every


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
    resumed = resume.read(args, __file__)
    checks.flags(args)
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    if args.num_envs > args.buffer_size:
        fail(
            f"--num-envs {args.num_envs} is larger than --buffer-size {args.buffer_size}: "
            "make the buffer hold one step of every env"
        )
    num_iterations = args.total_timesteps // args.num_envs
    device, cudagraphs = speed.setup(args)
    runs = seeds.runs(args, num_iterations * args.num_envs, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

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
        run.load(networks)
    # The twin critics' parameters stacked [2, ...]; qf1 and qf2 view its slices (checkpoints).
    q_params = seeds.stack([qf1, qf2])
    params = TensorDict(actor=from_module(actor).data, qnet=q_params)
    target_params = params.clone()
    actor_detach, target_actor = Actor(n_obs, n_act, low, high, device="meta"), Actor(n_obs, n_act, low, high, device="meta")
    params["actor"].to_module(actor_detach)
    target_params["actor"].to_module(target_actor)
    # optimizers.Adam: fused (one kernel for all parameters) eager; the single-tensor loop, which inductor
    # fuses into the update's graph, compiled. On CUDA its step counts stay on the device
    # (capturable): no host sync per step, and CUDA graphs can capture it.
    adam_options = {"fused": not args.compile, "capturable": device.type == "cuda"}
    q_optimizer = optimizers.Adam(q_params.items(), args.learning_rate, **adam_options)
    actor_optimizer = optimizers.Adam(actor.named_parameters(), args.learning_rate, **adam_options)

    # Before learning starts, blocks of up to LOG_EVERY steps go to the device at once; then each
    # update's sample copies its step.
    stage_steps = max(1, min(LOG_EVERY, args.buffer_size // args.num_envs))
    fields = {
        "obs": ((n_obs,), torch.float32),
        "actions": ((n_act,), torch.float32),
        "rewards": ((), torch.float32),
        "next_obs": ((n_obs,), torch.float32),
        "dones": ((), torch.float32),
    }
    rb = ReplayBuffer(args.buffer_size, fields, stage_steps * args.num_envs, device)

    policy = make_policy(actor_detach, args.exploration_noise, *action_bounds)
    q_target_params = dict(target_params["qnet"].items())
    update_critic, update_critic_and_actor = make_update(
        qf1, actor, target_actor, q_optimizer, actor_optimizer, q_target_params, rb.storage, action_bounds, args
    )
    # --compile: each update is one graph; the policy only on CUDA, where kernel launches bound
    # these small networks (on a CPU a compiled call's guards cost more than fusion saves).
    if args.compile:
        # fallback_random: on a CPU inductor's own kernel for random numbers is far slower than
        # torch's, and torch's draws what an eager update draws.
        options = {"guard_filter_fn": speed.value_guards, "fallback_random": device.type == "cpu"}
        update_critic = torch.compile(update_critic, fullgraph=True, options=options)
        update_critic_and_actor = torch.compile(update_critic_and_actor, fullgraph=True, options=options)
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update_critic, update_critic_and_actor, policy = speed.interruptible(
            run, update_critic, update_critic_and_actor, policy
        )
    if cudagraphs:
        update_critic = CudaGraphModule(update_critic, device=device)
        update_critic_and_actor = CudaGraphModule(update_critic_and_actor, device=device)
        policy = CudaGraphModule(policy, device=device)

    global_step = updates = 0
    # The graphed outputs are overwritten by the next call: the latest are copied here.
    metrics = torch.zeros(len(METRICS), device=device)
    obs, _ = envs.reset(seed=args.seed)
    obs = obs.astype(np.float32, copy=False)
    objects = {
        "params": params,
        "target_params": target_params,
        "q_optimizer": q_optimizer,
        "actor_optimizer": actor_optimizer,
    }
    objects |= {"metrics": metrics, "rb": rb, "envs": envs}
    global_step, updates, obs = run.resume(objects, lambda: (global_step, updates, obs), device)
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
                actions = policy(torch.from_numpy(obs).to(device)).cpu().numpy()
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs
            seeds.episodes(runs, global_step, infos, args.num_envs)

            # The done flag is the termination only: a time-limit truncation still bootstraps
            # from the true last observation (see make_envs for the autoreset).
            real_next = vector.real_next_obs(next_obs, infos)
            rb.add(obs=obs, actions=actions, rewards=rewards, next_obs=real_next, dones=terminations)
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

            if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                # note: the loop's only host sync is here, at the log points
                if not seeds.log(runs, global_step, updates, metrics if updates else None, METRICS, [networks]):
                    break
    envs.close()
    seeds.finish(
        runs, global_step, updates, [networks],
        lambda nets, seed_args, name: evaluate(nets["actor"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

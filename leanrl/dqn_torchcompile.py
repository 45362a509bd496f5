"""DQN, lean: torch.compile, CUDA graphs and tensordict.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236), learning as the
plain `dqn.py` (CleanRL's) does, faster: the replay buffer lives on the device and is gathered in
the update, which compiles to one graph; acting runs only on steps where some env acts greedily;
nothing syncs the host with the device between two log points.

    python leanrl/dqn_torchcompile.py
    python leanrl/dqn_torchcompile.py --compile
    python leanrl/dqn_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains seeds seed ... seed+N-1 at once, stacked on a leading dimension (one seed is
a stack of one) and sharing one random stream, so seed k is not bit-identical to a run of seed+k.
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
from tensordict.nn import CudaGraphModule

from leanrl_utils import acting, checks, cli, fail, optimizers, resume, seeds, speed, vector
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
        self.network = nn.Sequential(
            nn.Linear(n_obs, 120, device=device),
            nn.ReLU(),
            nn.Linear(120, 84, device=device),
            nn.ReLU(),
            nn.Linear(84, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x)


def make_update(q_network, target_params, optimizer, storage, gamma, num_seeds):
    """One gradient step of every seed, one graph, on rows `idx` of the storage ([buffer_size, seeds,
    ...], block k from seed k's column). The summed losses are differentiated (torch.func) and optimizers.Adam
    is elementwise, so each seed steps on its own loss. Returns [len(METRICS), seeds] on the device."""
    forward = seeds.forward(q_network)
    seed_ids = torch.arange(num_seeds, device=next(iter(storage.values())).device).unsqueeze(1)

    def td_loss(params, obs, actions, td_target):
        old_val = forward(params, obs).gather(2, actions.unsqueeze(2)).squeeze(2)
        losses = (td_target - old_val).square().mean(dim=1)
        return losses.sum(), (losses, old_val)

    def update(idx):
        batch = {key: value[idx.view(num_seeds, -1), seed_ids] for key, value in storage.items()}
        with torch.no_grad():
            target_max = forward(target_params, batch["next_obs"]).max(dim=2).values
            td_target = batch["rewards"] + gamma * target_max * (1 - batch["dones"])
        grad_and_loss = torch.func.grad_and_value(td_loss, has_aux=True)
        grads, (_, (losses, old_val)) = grad_and_loss(optimizer.params, batch["obs"], batch["actions"], td_target)
        optimizer.step(grads)
        return torch.stack([losses, old_val.mean(dim=1)]).detach()

    return update


METRICS = ["losses/td_loss", "losses/q_values"]


def draw_exploration(epsilons, num_envs, n_act, device):
    """Epsilon-greedy's draws for a block of steps, [num_steps, num_envs]: whether each env explores
    and the random action it would take. Two ops per block, not two per step: each costs microseconds."""
    explore = torch.rand(len(epsilons), num_envs, device=device) < torch.tensor(epsilons, device=device).unsqueeze(1)
    return explore, torch.randint(n_act, (len(epsilons), num_envs), device=device)


def make_policy(q_network, params, num_seeds, host):
    """The greedy action for observations [seeds * envs, n_obs] (seed k's envs in block k) under
    each seed's network (`params` from `seeds.stack`), derived from `q_network`: on a CPU (`host`)
    in numpy, where an op on a few numbers costs under a microsecond and a torch op several."""
    if host:
        forward = acting.numpy_forward(q_network, params)
        return lambda obs: forward(obs.reshape(num_seeds, -1, obs.shape[-1])).argmax(2).ravel()
    forward = seeds.forward(q_network)
    return lambda obs: forward(params, obs.view(num_seeds, -1, obs.shape[-1])).argmax(dim=2).flatten()


def make_envs(args, run_name, num_envs, capture_video=False):
    """The vector env, or one clear line for an env this script cannot use."""
    if capture_video and importlib.util.find_spec("moviepy") is None:
        fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
    try:
        if capture_video:  # a missing renderer fails here, not at the first recorded frame
            probe = gym.make(args.env_id, render_mode="rgb_array")
            probe.reset(seed=args.seed)
            probe.render()
            probe.close()
        # SAME_STEP autoreset: the step that ends an episode returns the first observation of the
        # next one and the true last one in infos["final_obs"], so no transition spans an autoreset.
        envs = vector.SameStepEnvs([make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)])
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e})")
    space = envs.single_action_space
    if not isinstance(space, gym.spaces.Discrete):
        fail(f"{args.env_id} has a {type(space).__name__} action space; DQN handles discrete actions only (e.g. CartPole-v1)")
    space = envs.single_observation_space
    if not isinstance(space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(space).__name__} observation space; this script handles Box observations only")
    return envs


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed from step - n to step (n: num_envs)."""
    return step // every - (step - n) // every


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
    resumed = resume.read(args, __file__)
    checks.flags(args)
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // args.num_envs
    device, cudagraphs = speed.setup(args)
    if num_seeds > 1:  # one line before num_seeds x num_envs envs are made (rows as in `fields` below)
        probe = make_envs(args, "probe", 1)
        row_bytes = 8 * math.prod(probe.single_observation_space.shape) + 16
        probe.close()
        what = f"--num-seeds {num_seeds} with --buffer-size {args.buffer_size}"
        checks.memory(num_seeds * args.buffer_size * row_bytes, device, what)
    runs = seeds.runs(args, num_iterations * args.num_envs, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # Sub-env k * num_envs + i is env i of seed k.
    envs = make_envs(args, run.name, num_seeds * args.num_envs, args.capture_video)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_networks = [QNetwork(n_obs, n_act, device=device)]
    QNetwork(n_obs, n_act, device=device)  # dqn.py's target network: its draws keep the two scripts' streams together
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        q_networks.append(QNetwork(n_obs, n_act, device=device))
    for q_network in q_networks if args.load_model else []:
        run.load({"q_network": q_network})
    q_params = seeds.stack(q_networks)
    networks = [{"q_network": net} for net in q_networks]  # what each seed's Run logs and saves
    target_params = q_params.clone()

    # Blocks of train_frequency steps (whole vector steps, at most the buffer) go to the device at once.
    stage_steps = max(1, min(-(-args.train_frequency // args.num_envs), args.buffer_size // args.num_envs))
    # A row holds one transition of each seed: [buffer_size, seeds, ...].
    obs_row, scalar = ((num_seeds, n_obs), torch.float32), ((num_seeds,), torch.float32)
    fields = {"obs": obs_row, "next_obs": obs_row, "actions": ((num_seeds,), torch.int64), "rewards": scalar, "dones": scalar}
    rb = ReplayBuffer(args.buffer_size, fields, stage_steps * args.num_envs, device)

    def buffer_rows(**values):
        """Per-sub-env values as buffer rows: env i of every seed in row i (with one env per seed,
        as by default, a vector step is one row as it is: the views would cost more than the step)."""
        if args.num_envs == 1:
            return values
        return {k: x.reshape(num_seeds, args.num_envs, *x.shape[1:]).swapaxes(0, 1) for k, x in values.items()}

    # On CUDA, optimizers.Adam's step counts live on the device (capturable), so the update never syncs.
    optimizer = optimizers.Adam(q_params.items(), args.learning_rate, capturable=device.type == "cuda")
    update = make_update(q_networks[0], dict(target_params.items()), optimizer, rb.storage, args.gamma, num_seeds)
    policy = make_policy(q_networks[0], dict(q_params.items()), num_seeds, host=device.type == "cpu")
    # --compile: the update, one graph (on a CPU inductor's C++ wrapper drops the Python glue between
    # kernels); the policy only on CUDA: on a CPU a compiled call costs more than its few tiny ops.
    if args.compile:
        update = torch.compile(update, options={"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu"})
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update, policy = CudaGraphModule(update), CudaGraphModule(policy)
    if device.type != "cpu":
        policy = acting.host_arrays(policy, device)

    global_step = updates = 0
    metrics, epsilon = None, args.start_e
    draw_steps = 256  # exploration is drawn for this many vector steps at once
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    obs, _ = envs.reset(seed=[args.seed + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    obs = obs.reshape(num_seeds * args.num_envs, n_obs).astype(np.float32, copy=False)
    explore = random_actions = epsilons = None
    objects = {"q_params": q_params, "target_params": target_params, "optimizer": optimizer, "rb": rb, "envs": envs}
    loop = lambda: (global_step, updates, metrics, epsilon, obs, explore, random_actions, epsilons)
    global_step, updates, metrics, epsilon, obs, explore, random_actions, epsilons = run.resume(objects, loop, device)
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // args.num_envs, num_iterations):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            step = iteration % draw_steps
            if step == 0:
                # Drawn on the host, where the env is: a step where every env explores skips the network.
                duration = args.exploration_fraction * args.total_timesteps
                block = range(global_step, global_step + args.num_envs * draw_steps, args.num_envs)
                epsilons = [linear_schedule(args.start_e, args.end_e, duration, t) for t in block]
                draws = draw_exploration(epsilons, num_seeds * args.num_envs, n_act, "cpu")
                explore, random_actions = (x.numpy() for x in draws)
            epsilon, actions = epsilons[step], random_actions[step]
            if not explore[step].all():
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                actions = np.where(explore[step], actions, policy(obs))
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs
            seeds.episodes(runs, global_step, infos, args.num_envs)

            # The done flag is the termination only: a time-limit truncation still bootstraps
            # from the true last observation (see make_envs for the autoreset).
            next_obs = next_obs.reshape(num_seeds * args.num_envs, n_obs).astype(np.float32, copy=False)
            real_next = vector.real_next_obs(next_obs, infos)
            rb.add(**buffer_rows(obs=obs, next_obs=real_next, actions=actions, rewards=rewards, dones=terminations))
            obs = next_obs

            if global_step > args.learning_starts:
                for _ in range(multiples_passed(global_step, args.num_envs, args.train_frequency)):
                    idx = rb.sample(num_seeds * args.batch_size)
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call; only the latest is read.
                    metrics = update(idx)
                    updates += 1
                if multiples_passed(global_step, args.num_envs, args.target_network_frequency):
                    target_params.lerp_(q_params, args.tau)

            if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                # note: the loop's only host sync is here, at the log points
                if not seeds.log(runs, global_step, updates, metrics, METRICS, networks, **{"charts/epsilon": epsilon}):
                    break
    envs.close()
    evaluate_seed = lambda nets, seed_args, name: evaluate(nets["q_network"], seed_args, name, device)
    seeds.finish(runs, global_step, updates, networks, evaluate_seed, device=device.type, cudagraphs=cudagraphs)


if __name__ == "__main__":
    main(cli(Args))

"""PQN, lean: torch.compile, CUDA graphs and tensordict.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of CleanRL's `pqn.py`: Q-learning
with a LayerNorm MLP, vectorized envs, epsilon-greedy rollouts, Q(lambda) returns and a few epochs
of minibatch updates per rollout, with no replay buffer and no target network. It learns as the
plain script `pqn.py` does; what changes is where the time goes: on a CPU the rollout loop
acts in numpy with no torch call, the rollout is stored in arrays allocated once, the Q(lambda)
returns are one triangular solve, the minibatch step (gather, forward, backward, clipping,
optimizers.RAdam) is one function that compiles to one graph, and nothing syncs the host with the device
between two log points.

    python leanrl/pqn_torchcompile.py
    python leanrl/pqn_torchcompile.py --compile
    python leanrl/pqn_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains N independent agents (seeds seed ... seed+N-1) in one process: their
weights and optimizers.RAdam states stacked on a leading seed dimension (one seed is a stack of one), so
that acting and the update are one batched call for all of them, each agent on its own slice of
one vector env, with its own minibatches and its own gradient clipping. Seed k is not
bit-identical to a single run of seed+k: the agents share one stream of random numbers for
exploration and minibatches.
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
    num_envs: int = 4
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (one wins beside any other process)"""


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


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """CleanRL's PQN MLP: LayerNorm after each hidden layer, which is what lets PQN learn without
    a target network (Gallici et al., 2024, section 4)."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Linear(n_obs, 120, device=device)),
            nn.LayerNorm(120, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(120, 84, device=device)),
            nn.LayerNorm(84, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(84, n_act, device=device)),
        )

    def forward(self, x):
        return self.network(x)


def make_update(q_network, optimizer, max_grad_norm, num_seeds):
    """One minibatch step of every seed as a pure function of tensors, so that torch.compile sees
    all of it as one graph (`fullgraph=True`): the gather, forward, backward (`torch.func`),
    gradient clipping and optimizers.RAdam. obs, actions and returns are [seeds, batch, ...], `idx`
    [seeds, minibatch] holds each seed's own rows. The sum of the seeds' losses is differentiated:
    seed k's part of its gradient is its own loss's gradient; each seed's gradient is clipped by
    its own norm, and optimizers.RAdam is elementwise, so one step over the stack is num_seeds independent
    steps. Returns the METRICS as one [len(METRICS), seeds] tensor that stays on the device."""
    forward = seeds.forward(q_network)
    seed_ids = torch.arange(num_seeds, device=next(iter(optimizer.params.values())).device).unsqueeze(1)

    def td_loss(params, obs, actions, returns):
        old_val = forward(params, obs).gather(2, actions.unsqueeze(2)).squeeze(2)
        losses = (returns - old_val).square().mean(dim=1)
        return losses.sum(), (losses, old_val)

    def update(obs, actions, returns, idx):
        grads, (_, (losses, old_val)) = torch.func.grad_and_value(td_loss, has_aux=True)(
            optimizer.params, obs[seed_ids, idx], actions[seed_ids, idx], returns[seed_ids, idx]
        )
        # nn.utils.clip_grad_norm_ per seed: the norm over each seed's slices of the gradients
        norms = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]
        clip = (max_grad_norm / (torch.linalg.vector_norm(torch.stack(norms), dim=0) + 1e-6)).clamp(max=1.0)
        optimizer.step({name: g * clip.view(-1, *[1] * (g.dim() - 1)) for name, g in grads.items()})
        return torch.stack([losses, old_val.mean(dim=1)]).detach()

    return update


METRICS = ["losses/td_loss", "losses/q_values"]


def make_returns(gamma, q_lambda):
    """Q(lambda) returns over a rollout of shape (num_steps, num_envs), the plain script's loop on
    whole rows: G[t] = r[t] + gamma (1 - done[t]) ((1 - l) Q[t] + l G[t + 1]), with Q[t] max Q of
    the next observation (`values[t + 1]`, `next_value` after the last step) and l = q_lambda, or
    0 at the rollout's last step."""

    def returns_fn(rewards, values, next_value, dones):
        next_q = torch.cat([values[1:], next_value.unsqueeze(0)])
        lam = torch.full_like(rewards, q_lambda)
        lam[-1] = 0.0
        discount = gamma * (1.0 - dones)
        base = rewards + discount * (1.0 - lam) * next_q
        decay = discount * lam
        # G[t] = base[t] + decay[t] G[t + 1] is (I - U) G = base per env, U upper bidiagonal with
        # decay[t] at (t, t + 1): one batched triangular solve, whose back substitution is that
        # recursion, in a few ops where a loop costs one op per step eager and long to compile.
        # Memory: num_steps**2 * num_envs floats.
        upper = torch.diag_embed(-decay.T[:, :-1], offset=1)  # the diagonal is taken as ones
        solved = torch.linalg.solve_triangular(upper, base.T.unsqueeze(2), upper=True, unitriangular=True)
        return solved.squeeze(2).T.contiguous()

    return returns_fn


def make_policy(q_network, params, num_seeds, host):
    """Acting: for observations [seeds * envs, n_obs] (seed k's envs in block k), the greedy action
    of each under its seed's network and its max Q (the value the Q(lambda) returns bootstrap
    from); epsilon-greedy is mixed in by the loop. `params`: the Q-networks' parameters stacked on
    a leading seed dimension (`seeds.stack`). Both forms are derived from `QNetwork`: `host` (a
    CPU), numpy in and out (`acting.numpy_forward`, where an op on a few numbers costs under a
    microsecond and a torch op several, so the rollout loop makes no torch call at all); else
    torch, which CUDA compiles and graphs (the loop calls it through `acting.host_arrays`)."""
    if host:
        forward = acting.numpy_forward(q_network, params)

        def host_policy(obs):
            q = forward(obs.reshape(num_seeds, -1, obs.shape[-1]))
            return q.argmax(2).ravel(), q.max(2).ravel()

        return host_policy
    forward = seeds.forward(q_network)

    def policy(obs):
        value, greedy = forward(params, obs.view(num_seeds, -1, obs.shape[-1])).max(dim=2)
        return greedy.flatten(), value.flatten()

    return policy


def draw_exploration(epsilons, num_envs, n_act, device):
    """A rollout's epsilon-greedy draws at once, [num_steps, num_envs]: whether each env explores
    at each step (a uniform below that step's epsilon) and the random action it would take. Two
    ops per rollout, not four per step: on a CPU each op on a few numbers costs several us."""
    explore = torch.rand(len(epsilons), num_envs, device=device) < torch.tensor(epsilons, device=device).unsqueeze(1)
    return explore, torch.randint(n_act, (len(epsilons), num_envs), device=device)


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
        # SAME_STEP autoreset, as in the DQN pair: the step that ends an episode returns the first
        # observation of the next one, so every step of a rollout is one real transition
        # (NEXT_STEP would spend a step per episode on a reset whose transition the loss must
        # leave out).
        envs = vector.SameStepEnvs([make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)])
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e})")
    action_space, observation_space = envs.single_action_space, envs.single_observation_space
    if not isinstance(action_space, gym.spaces.Discrete):
        fail(
            f"{args.env_id} has a {type(action_space).__name__} action space; "
            "PQN handles discrete actions only (e.g. CartPole-v1)"
        )
    if not isinstance(observation_space, gym.spaces.Box):
        fail(
            f"{args.env_id} has a {type(observation_space).__name__} observation space; "
            "this script handles Box observations only"
        )
    return envs


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


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
    batch_size = args.num_envs * args.num_steps
    if args.total_timesteps < batch_size and not (args.total_timesteps == 0 and args.load_model):
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps = {batch_size}): "
            f"give at least {batch_size}"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps): "
            "pass a divisor of it"
        )
    if not 0 <= args.q_lambda <= 1:
        fail(f"--q-lambda {args.q_lambda} is out of range: use a number in [0, 1]")
    minibatch_size = batch_size // args.num_minibatches
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // batch_size
    device, cudagraphs = speed.setup(args)
    # One line before num_seeds x num_envs envs are made: per step of a sub-env, float32 obs
    # (three copies), values, rewards, dones and returns, an int64 action and a row of the
    # returns' triangular solve; 16 KiB per sub-env for the env itself.
    checks.rollout(args, 12 * vector.env_sizes(args.env_id)[0] + 24 + 4 * args.num_steps, device, per_env=2**14)
    runs = seeds.runs(args, num_iterations * batch_size, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # Sub-env k * num_envs + i is env i of seed k.
    sub_envs = num_seeds * args.num_envs
    envs = make_envs(args, run.name, sub_envs, args.capture_video)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = int(envs.single_action_space.n)

    q_networks = [QNetwork(n_obs, n_act, device=device)]
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        q_networks.append(QNetwork(n_obs, n_act, device=device))
    for q_network in q_networks if args.load_model else []:
        run.load({"q_network": q_network})
    q_params = seeds.stack(q_networks)

    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # optimizers.RAdam is capturable under torch.compile (its rectification's branch becomes a torch.where)
    # and on CUDA (no sync).
    lr = torch.tensor(args.learning_rate, device=device)
    optimizer = optimizers.RAdam(q_params.items(), lr, capturable=args.compile or device.type == "cuda")
    update = make_update(q_networks[0], optimizer, args.max_grad_norm, num_seeds)
    policy = make_policy(q_networks[0], dict(q_params.items()), num_seeds, host=device.type == "cpu")
    returns_fn = make_returns(args.gamma, args.q_lambda)

    def by_seed(x):
        """[num_steps, seeds * envs, ...] -> [seeds, num_steps * envs, ...]: each seed's rollout
        flattened as a single run flattens its own."""
        x = x.view(args.num_steps, num_seeds, args.num_envs, *x.shape[2:]).transpose(0, 1)
        return x.reshape(num_seeds, batch_size, *x.shape[3:])

    # The rollout: host arrays, where the envs and acting are (one copy per field per rollout to
    # the device).
    steps_envs = (args.num_steps, sub_envs)
    stage = {"obs": np.zeros((*steps_envs, n_obs), np.float32), "actions": np.zeros(steps_envs, np.int64),
             **{k: np.zeros(steps_envs, np.float32) for k in ("values", "rewards", "dones")}}  # fmt: skip
    storage = {k: torch.from_numpy(v).to(device, copy=True) for k, v in stage.items()}

    # --compile: the update is one graph (inductor's C++ wrapper drops the Python glue between its
    # kernels on a CPU); the policy only on CUDA: on a CPU a compiled call's wrappers cost more
    # than fusing a dozen tiny ops saves, so it acts in numpy there.
    if args.compile:
        options = {"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu"}
        update = torch.compile(update, fullgraph=True, options=options)
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update, returns_fn, policy = CudaGraphModule(update), CudaGraphModule(returns_fn), CudaGraphModule(policy)
    if device.type != "cpu":
        policy = acting.host_arrays(policy, device)

    global_step = updates = 0
    metrics, epsilon, lr_now = None, args.start_e, args.learning_rate
    duration = args.exploration_fraction * args.total_timesteps
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    obs, _ = envs.reset(seed=[args.seed + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    obs = obs.reshape(sub_envs, n_obs).astype(np.float32, copy=False)
    objects = {"q_params": q_params, "optimizer": optimizer, "envs": envs}
    global_step, updates, obs = run.resume(objects, lambda: (global_step, updates, obs), device)
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // batch_size + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            if args.anneal_lr:
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
                lr.copy_(lr_now)

            # Each step's epsilon is the schedule's after counting that step's env steps.
            counts = range(global_step + args.num_envs, global_step + args.num_envs * (args.num_steps + 1), args.num_envs)
            epsilons = [linear_schedule(args.start_e, args.end_e, duration, t) for t in counts]
            # Drawn on the host, where acting mixes them in.
            explore, random_actions = (x.numpy() for x in draw_exploration(epsilons, sub_envs, n_act, "cpu"))
            epsilon = epsilons[-1]
            for step in range(args.num_steps):
                global_step += args.num_envs
                stage["obs"][step] = obs
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                greedy, value = policy(obs)
                action = np.where(explore[step], random_actions[step], greedy)
                stage["actions"][step], stage["values"][step] = action, value
                next_obs, reward, termination, truncation, infos = envs.step(action)
                stage["rewards"][step] = reward
                stage["dones"][step] = termination | truncation  # a time limit ends the return too
                seeds.episodes(runs, global_step, infos, args.num_envs)
                obs = next_obs.reshape(sub_envs, n_obs).astype(np.float32, copy=False)

            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            next_value = torch.from_numpy(policy(obs)[1]).to(device)  # its values only
            for key, staged in stage.items():
                storage[key].copy_(torch.from_numpy(staged))
            returns = returns_fn(storage["rewards"], storage["values"], next_value, storage["dones"])

            batch = (by_seed(storage["obs"]), by_seed(storage["actions"]), by_seed(returns))
            for epoch in range(args.update_epochs):
                # Each seed its own order of its own rows.
                order = torch.stack([torch.randperm(batch_size, device=device) for _ in range(num_seeds)])
                for idx in order.split(minibatch_size, dim=1):
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call; only the latest is read.
                    metrics = update(*batch, idx)
                    updates += 1

            # As CleanRL: the last minibatch's loss and Q-values.
            # note: the loop's only host sync is here, once per iteration
            networks = [{"q_network": net} for net in q_networks]
            charts = {"charts/learning_rate": lr_now, "charts/epsilon": epsilon}
            if not seeds.log(runs, global_step, updates, metrics, METRICS, networks, **charts):
                break
    envs.close()
    seeds.finish(
        runs, global_step, updates, [{"q_network": net} for net in q_networks],
        lambda nets, seed_args, name: evaluate(nets["q_network"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

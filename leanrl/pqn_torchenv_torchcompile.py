"""PQN on torch-native envs, lean: the whole loop on the device, compiled and graphed.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of `pqn.py`, on the torch-native
twins of gymnasium's classic-control envs (`leanrl_envs`). It learns as the plain script
`pqn_torchenv.py` does; what changes is that nothing between two log points runs on the host:
a rollout's epsilon-greedy draws are made at once on the device, `--unroll` env steps (acting,
the env's step, the rows to store) are one compiled call, the Q(lambda) returns are one
triangular solve, the minibatch step (gather, forward, backward, clipping, optimizers.RAdam) is
one compiled call, and the episodes that ended are read from the stored rows once per iteration.
This is the case PureJaxRL made for envs on the device: with a cheap env, the host is the cost.

    python leanrl/pqn_torchenv_torchcompile.py
    python leanrl/pqn_torchenv_torchcompile.py --compile
    python leanrl/pqn_torchenv_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains N independent agents (seeds seed ... seed+N-1) in one process: their
weights and optimizers.RAdam states stacked on a leading seed dimension, and their envs too (seed
k has num-envs envs of its own, whose reset draws take the key seed + k, as a single run of
seed + k); acting, the env step (torch.func.vmap over the seeds) and the update are one batched
call for all of them. One seed is a stack of one. Seed k is not bit-identical to a single run of
seed + k: the agents share one stream of random numbers for exploration and minibatches.
"""

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from tensordict.nn import CudaGraphModule

import leanrl_envs
from leanrl_utils import checks, cli, fail, optimizers, resume, seeds, speed


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
    """not available here: the torch-native envs draw no frames (pqn.py records videos)"""
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
    """the id of the environment: one of leanrl_envs.ENVS"""
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
    unroll: int = 4
    """env steps per rollout call, unrolled into one graph (a divisor of num-steps): more compile longer, call less"""


def check_torch_env(args):
    """One line for an env or a flag the torch-native envs cannot serve, before any work."""
    if args.env_id not in leanrl_envs.ENVS:
        fail(f"--env-id {args.env_id} has no torch-native env: pass one of {', '.join(leanrl_envs.ENVS)} (or use pqn.py)")
    if args.capture_video:
        fail("--capture-video: the torch-native envs draw no frames; record videos with pqn.py (pip install 'leanrl[video]')")


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
    """Q(lambda) returns over a rollout of shape (num_steps, ...envs), the plain script's loop on
    whole rows: G[t] = r[t] + gamma (1 - done[t]) ((1 - l) Q[t] + l G[t + 1]), with Q[t] max Q of
    the next observation (`values[t + 1]`, `next_value` after the last step) and l = q_lambda, or
    0 at the rollout's last step."""

    def returns_fn(rewards, values, next_value, dones):
        shape, rewards, values, dones = rewards.shape, rewards.flatten(1), values.flatten(1), dones.flatten(1)
        next_q = torch.cat([values[1:], next_value.reshape(1, -1)])
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
        return solved.squeeze(2).T.reshape(shape)

    return returns_fn


def make_policy(q_network, params):
    """Acting: for observations [seeds, envs, n_obs], the greedy action of each under its seed's
    network and its max Q (the value the Q(lambda) returns bootstrap from); epsilon-greedy is mixed
    in by the rollout. `params`: the Q-networks' parameters stacked on a leading seed dimension
    (`seeds.stack`), read by the forward derived from `QNetwork` (`seeds.forward`)."""
    forward = seeds.forward(q_network)

    def policy(obs):
        value, greedy = forward(params, obs).max(dim=2)
        return greedy, value

    return policy


def make_env_step(env, num_seeds):
    """The env's step for stacked seeds (state and action with a leading seed dimension): each
    seed's envs step with their own key (torch.func.vmap); a stack of one runs the env's own ops."""
    if num_seeds > 1:
        return torch.func.vmap(env.step)

    def step(state, action):
        state, out = env.step(leanrl_envs.State(*(x[0] for x in state)), action[0])
        return leanrl_envs.State(*(x[None] for x in state)), leanrl_envs.Step(*(x[None] for x in out))

    return step


# What a rollout stores per step and env, beside the observation acted on.
ROWS = ["actions", "values", "rewards", "dones", "episode_returns", "episode_lengths"]


def make_rollout(policy, env_step, unroll):
    """`unroll` env steps as one function of tensors, which torch.compile turns into one graph
    (its loop unrolled): epsilon-greedy acting, the env's step and the rows to store. `explore`
    and `random_actions` are the steps' draws, [unroll, seeds, envs]. Returns the state and the
    observation after the last step, and the steps' obs and ROWS, stacked on a leading step."""

    def rollout(state, obs, explore, random_actions):
        steps = []
        for t in range(unroll):
            greedy, value = policy(obs)
            action = torch.where(explore[t], random_actions[t], greedy)
            state, out = env_step(state, action)
            done = out.terminated | out.truncated  # a time limit ends the return too
            steps.append((obs, action, value, out.reward, done.float(), out.episode_return, out.episode_length.float()))
            obs = out.obs
        return state, obs, [torch.stack(rows) for rows in zip(*steps)]

    return rollout


def draw_exploration(epsilons, shape, n_act):
    """A rollout's epsilon-greedy draws at once, on the device of `epsilons` (each step's, float64
    as the plain script's Python floats): whether each env explores at each step (a float32 uniform
    below that step's epsilon, compared in float32 as the plain script compares) and the random
    action it would take, [num_steps, *shape]. Drawn eagerly, so compiled code acts on the same
    draws as eager code."""
    uniforms = torch.rand(len(epsilons), *shape, device=epsilons.device)
    explore = uniforms < epsilons.float().view(-1, *[1] * len(shape))
    return explore, torch.randint(n_act, (len(epsilons), *shape), device=epsilons.device)


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at step t, a number or a float64 tensor of steps (elementwise, as the plain script's
    Python floats): from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e + 0 * t
    fraction = t / duration
    return start_e + (end_e - start_e) * (fraction.clamp(max=1.0) if torch.is_tensor(fraction) else min(fraction, 1.0))


def evaluate(q_network, args, device):
    """Mean return of the greedy policy over `eval_episodes` episodes on a fresh env."""
    env = leanrl_envs.make(args.env_id, 1, device)
    state, obs = env.reset(seed=args.seed + 10_000)
    returns = []
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            state, out = env.step(state, q_network(obs).argmax(dim=1))
            obs = out.obs
            if (out.terminated | out.truncated).item():
                returns.append(out.episode_return.item())
    return float(np.mean(returns))


def main(args: Args):
    resumed = resume.read(args, __file__)
    check_torch_env(args)
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
    if args.unroll < 1 or args.num_steps % args.unroll:
        divisor = max(d for d in range(1, max(args.unroll, 1) + 1) if args.num_steps % d == 0)
        fail(f"--unroll {args.unroll} does not divide --num-steps {args.num_steps}: pass a divisor of it, e.g. {divisor}")
    minibatch_size = batch_size // args.num_minibatches
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // batch_size
    device, cudagraphs = speed.setup(args)
    # One line before num_seeds x num_envs envs are made: per step of an env, float32 obs (stored
    # and as the rollout call returns them), 6 float32 numbers, an int64 action, the exploration
    # draws (13 bytes) and a row of the returns' triangular solve; 256 bytes per env for its state.
    n_obs = leanrl_envs.ENVS[args.env_id].obs_dim
    checks.rollout(args, 8 * n_obs + 48 + 4 * args.num_steps, device, per_env=256)
    runs = seeds.runs(args, num_iterations * batch_size, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    env = leanrl_envs.make(args.env_id, args.num_envs, device)
    n_act = env.num_actions
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
    policy = make_policy(q_networks[0], dict(q_params.items()))
    rollout = make_rollout(policy, make_env_step(env, num_seeds), args.unroll)
    returns_fn = make_returns(args.gamma, args.q_lambda)

    def by_seed(x):
        """[num_steps, seeds, envs, ...] -> [seeds, num_steps * envs, ...]: each seed's rollout
        flattened as a single run flattens its own."""
        return x.transpose(0, 1).reshape(num_seeds, batch_size, *x.shape[3:])

    rows = (args.num_steps, num_seeds, args.num_envs)
    storage = {"obs": torch.zeros(*rows, n_obs, device=device), "actions": torch.zeros(rows, dtype=torch.long, device=device)}
    storage |= {k: torch.zeros(rows, device=device) for k in ROWS if k != "actions"}

    # --compile: the rollout and the update, each one graph with fullgraph (inductor's C++ wrapper
    # drops the Python glue between its kernels on a CPU). The bootstrap's forward, once per
    # iteration, and the returns' few ops are not worth a compile's seconds. In the rollout,
    # inductor would inline the env step's long chain of ops into each of the step's many outputs,
    # and generate and compile that code again for each: values of more than 4 ops are stored
    # instead, which halves the rollout's compile at the same speed (benchmark/RESULTS.md).
    if args.compile:
        options = {"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu"}
        update = torch.compile(update, fullgraph=True, options=options)
        rollout = torch.compile(rollout, fullgraph=True, options={**options, "realize_opcount_threshold": 4})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, rollout = speed.interruptible(run, update, rollout)
    if cudagraphs:
        update, rollout, returns_fn, policy = map(CudaGraphModule, (update, rollout, returns_fn, policy))

    global_step = updates = 0
    metrics, lr_now = None, args.learning_rate
    duration = args.exploration_fraction * args.total_timesteps
    # Each step's epsilon is the schedule's after counting that step's env steps.
    counts = torch.arange(1, args.num_steps + 1, dtype=torch.float64, device=device) * args.num_envs
    # Env i of seed k starts as env i of a single run of seed + k.
    starts = [env.reset(seed=args.seed + k) for k in range(num_seeds)]
    state = leanrl_envs.State(*(torch.stack(x) for x in zip(*(s for s, _ in starts))))
    obs = torch.stack([o for _, o in starts])
    # The env's whole state is tensors (its reset draws included), saved with the loop's variables.
    loop = lambda: (global_step, updates, tuple(state), obs)
    global_step, updates, state, obs = run.resume({"q_params": q_params, "optimizer": optimizer}, loop, device)
    state = leanrl_envs.State(*state)
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // batch_size + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            if args.anneal_lr:
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
                lr.copy_(lr_now)

            first_step = global_step
            epsilons = linear_schedule(args.start_e, args.end_e, duration, global_step + counts)
            explore, random_actions = draw_exploration(epsilons, (num_seeds, args.num_envs), n_act)
            for start in range(0, args.num_steps, args.unroll):
                part = slice(start, start + args.unroll)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                state, obs, steps = rollout(state, obs, explore[part], random_actions[part])
                for key, rows in zip(["obs", *ROWS], steps):  # copied: a graphed output is overwritten by the next call
                    storage[key][part] = rows
            global_step += batch_size

            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            next_value = policy(obs)[1]
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

            # note: the loop's only host sync is here, once per iteration: the episodes that ended
            # (in the plain script's order: by step, then env), the epsilon and the metrics
            ended = torch.stack([storage[k] for k in ("dones", "episode_returns", "episode_lengths")]).cpu().numpy()
            for t, k, i in zip(*ended[0].nonzero()):
                runs[k].record(first_step + int(t + 1) * args.num_envs, float(ended[1, t, k, i]), int(ended[2, t, k, i]))
            # As CleanRL: the last minibatch's loss and Q-values.
            networks = [{"q_network": net} for net in q_networks]
            charts = {"charts/learning_rate": lr_now, "charts/epsilon": epsilons[-1].item()}
            if not seeds.log(runs, global_step, updates, metrics, METRICS, networks, **charts):
                break
    seeds.finish(
        runs, global_step, updates, [{"q_network": net} for net in q_networks],
        lambda nets, seed_args, name: evaluate(nets["q_network"], seed_args, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

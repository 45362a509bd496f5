"""PQN on Atari through envpool, lean: torch.compile, CUDA graphs and tensordict.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of CleanRL's
`pqn_atari_envpool.py`: Q-learning with the Nature CNN (Mnih et al., 2015) and LayerNorm after
every layer, vectorized envs, epsilon-greedy rollouts, Q(lambda) returns and a few epochs of
minibatch updates per rollout, with no replay buffer and no target network. The games run in
envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey frames stacked by 4, frame
skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped rewards for learning; the
reported returns are whole games, unclipped. It learns as the plain script
`pqn_atari_envpool.py` does; what changes is where the time goes: the rollout is stored in
tensors allocated once, the network runs channels-last (oneDNN's fastest layout on a CPU), the
Q(lambda) returns are one triangular solve, the minibatch step (gather, forward, backward,
clipping, optimizers.RAdam) is one function that compiles to one graph, and nothing syncs the host with
the device between two log points.

    python leanrl/pqn_atari_envpool_torchcompile.py
    python leanrl/pqn_atari_envpool_torchcompile.py --compile
    python leanrl/pqn_atari_envpool_torchcompile.py --compile --cudagraphs
"""

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from tensordict.nn import CudaGraphModule

from leanrl_utils import checks, cli, fail, optimizers, resume, seeds, speed, vector


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
    """episodes (whole games) of the greedy policy to run after training (0: none)"""

    # algorithm
    env_id: str = "Breakout-v5"
    """the id of the environment (an envpool Atari id)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (one wins beside any other process)"""


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """The Nature CNN with LayerNorm after every hidden layer, as in CleanRL's PQN: the
    normalization is what lets PQN learn without a target network (Gallici et al., 2024)."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.LayerNorm([32, 20, 20], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.LayerNorm([64, 9, 9], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.LayerNorm([64, 7, 7], device=device),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.LayerNorm(512, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(512, n_act, device=device)),
        )

    def forward(self, x):
        # The plain network's layers, read from `self.network`, with channels-last activations,
        # which oneDNN's convolutions run fastest on a CPU; a LayerNorm over (C, H, W) normalizes
        # the (H, W, C) rows that memory holds, with its weights read in that order.
        x = x.contiguous(memory_format=torch.channels_last).float().mul_(1 / 255.0)
        for layer in self.network:
            if isinstance(layer, nn.LayerNorm) and x.dim() == 4:
                rows, weight, bias = x.permute(0, 2, 3, 1), layer.weight.permute(1, 2, 0), layer.bias.permute(1, 2, 0)
                x = nn.functional.layer_norm(rows, rows.shape[1:], weight, bias, layer.eps).permute(0, 3, 1, 2)
            else:
                x = layer(x)  # Flatten reads (C, H, W) order whatever the layout
        return x


def make_update(q_network, optimizer, max_grad_norm):
    """One minibatch step on rows `idx` of the flattened rollout as a pure function of tensors,
    so that torch.compile sees all of it as one graph (`fullgraph=True`): the gather and the
    uint8-to-float division, forward, backward (`torch.func`), gradient clipping and optimizers.RAdam.
    Returns the METRICS as one tensor that stays on the device.

    `valid` is 0 at envpool's reset steps (see the rollout in `main`): the means run over the
    other steps only."""

    def td_loss(params, obs, actions, returns, valid):
        old_val = torch.func.functional_call(q_network, params, (obs,)).gather(1, actions.unsqueeze(1)).squeeze(1)
        n_valid = valid.sum().clamp(min=1)
        return ((returns - old_val) ** 2 * valid).sum() / n_valid, (old_val * valid).sum() / n_valid

    def update(obs, actions, returns, valid, idx):
        grads, (loss, q_mean) = torch.func.grad_and_value(td_loss, has_aux=True)(
            optimizer.params, obs[idx], actions[idx], returns[idx], valid[idx]
        )
        # nn.utils.clip_grad_norm_, on the gradients before the step
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        optimizer.step({name: g * clip for name, g in grads.items()})
        return torch.stack([loss, q_mean]).detach()

    return update


METRICS = ["losses/td_loss", "losses/q_values"]


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def draw_exploration(epsilons, num_envs, n_act, device):
    """A rollout's epsilon-greedy draws at once, [num_steps, num_envs]: whether each env explores
    at each step (a uniform below that step's epsilon) and the random action it would take. Two
    ops per rollout, not four per step (as in the CartPole script, where they cost the most)."""
    explore = torch.rand(len(epsilons), num_envs, device=device) < torch.tensor(epsilons, device=device).unsqueeze(1)
    return explore, torch.randint(n_act, (len(epsilons), num_envs), device=device)


def make_policy(q_network):
    """Acting: one epsilon-greedy step for every env, and max Q of each frame stack (the values
    the Q(lambda) returns bootstrap from); `explore` and `random_actions` are the step's row of
    `draw_exploration`."""

    def policy(obs, explore, random_actions):
        value, greedy = q_network(obs).max(dim=1)
        return torch.where(explore, random_actions, greedy), value

    return policy


def make_returns(gamma, q_lambda):
    """Q(lambda) returns over a rollout of shape (num_steps, num_envs), the plain script's loop on
    whole rows: G[t] = r[t] + gamma (1 - terminated[t]) ((1 - l) Q[t] + l G[t + 1]), with Q[t]
    max Q of the next frame stack (`values[t + 1]`, `next_value` after the last step; where an
    episode ended at t, envpool returned its last frame there) and l = q_lambda, or 0 where an
    episode ended at t or the rollout ends (nothing flows back from another episode)."""

    def returns_fn(rewards, values, next_value, terminations, dones):
        next_q = torch.cat([values[1:], next_value.unsqueeze(0)])
        discount = gamma * (1.0 - terminations)
        lam = q_lambda * torch.cat([1.0 - dones[:-1], torch.zeros_like(dones[:1])])
        base = rewards + discount * (1.0 - lam) * next_q
        decay = discount * lam
        # G[t] = base[t] + decay[t] G[t + 1] is (I - U) G = base per env, U upper bidiagonal with
        # decay[t] at (t, t + 1): one batched triangular solve, whose back substitution is that
        # recursion: eager, it beats the recursion as a loop even compiled. Memory: num_steps**2 *
        # num_envs floats.
        upper = torch.diag_embed(-decay.T[:, :-1], offset=1)  # the diagonal is taken as ones
        solved = torch.linalg.solve_triangular(upper, base.T.unsqueeze(2), upper=True, unitriangular=True)
        return solved.squeeze(2).T.contiguous()

    return returns_fn


def evaluate(q_network, args, run_name, device):
    """Mean whole-game return of the greedy policy over `eval_episodes` games. Episodic life stays
    on, so that envpool presses FIRE after each lost life (a greedy policy may never do it); a
    game that never ends is cut by envpool's own limit of 27,000 steps (108,000 frames, 30
    minutes of play)."""
    eval_envs = vector.envpool_envs(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            q_values = q_network(torch.as_tensor(obs, device=device))
            obs, _, _, _, infos = eval_envs.step(q_values.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args, atari=True)
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
    num_iterations = args.total_timesteps // batch_size
    device, cudagraphs = speed.setup(args)
    checks.rollout(args, 4 * 84 * 84 + 8 + 10 * 4, device)  # per step of a game: uint8 frames, int64 action, 10 numbers
    runs = seeds.runs(args, num_iterations * batch_size, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = vector.envpool_envs(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run.name}")
    obs_shape = envs.single_observation_space.shape
    n_act = envs.single_action_space.n

    q_network = QNetwork(n_act, device=device)
    if args.load_model:
        run.load({"q_network": q_network})
    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    lr = torch.tensor(args.learning_rate, device=device)
    # The update is compiled on CUDA only (see below), which is where optimizers.RAdam must be capturable.
    optimizer = optimizers.RAdam(q_network.named_parameters(), lr, capturable=device.type == "cuda")

    # The rollout: the frames go to their device tensor as they come (the policy needs them
    # there anyway); the env's small arrays are staged on the host and copied once per rollout.
    steps_envs = (args.num_steps, args.num_envs)
    stage = {k: np.zeros(steps_envs, np.float32) for k in ("rewards", "terminations", "dones")}
    storage = {k: torch.empty(steps_envs, device=device) for k in stage}
    # Frames stay uint8 (a quarter of the memory); the network divides them by 255.
    storage["obs"] = torch.empty(steps_envs + obs_shape, dtype=torch.uint8, device=device)
    storage["actions"] = torch.empty(steps_envs, dtype=torch.long, device=device)
    storage["values"] = torch.empty(steps_envs, device=device)

    policy = make_policy(q_network)
    returns_fn = make_returns(args.gamma, args.q_lambda)
    update = make_update(q_network, optimizer, args.max_grad_norm)
    # --compile: the update and the policy on CUDA only, where launches dominate; on a CPU
    # oneDNN's convolutions are most of the time and inductor does not lower them. The returns
    # are one triangular solve: nothing to fuse.
    if args.compile and device.type == "cuda":
        update = torch.compile(update, fullgraph=True, options={"guard_filter_fn": speed.value_guards})
        policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    elif args.compile:
        notice = "on a CPU --compile leaves this script eager: oneDNN's convolutions are its floor either way"
        print(f"notice: {notice}", file=sys.stderr)
    if cudagraphs:
        update = CudaGraphModule(update)
        returns_fn = CudaGraphModule(returns_fn)
        policy = CudaGraphModule(policy)

    global_step = updates = 0
    epsilon_value, lr_now = args.start_e, args.learning_rate
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs, device=device)
    # envpool's games cannot be saved: a resumed run starts fresh episodes.
    global_step, updates = run.resume({"q_network": q_network, "optimizer": optimizer}, lambda: (global_step, updates))
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // batch_size + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            if args.anneal_lr:
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
                lr.copy_(lr_now)

            # A done before acting marks a reset step (see the plain script's rollout).
            done_before = stage["dones"][-1].copy() if iteration > 1 else np.zeros(args.num_envs, np.float32)
            actions, values = [], []
            # Each step's epsilon is the schedule's after counting that step's env steps.
            duration = args.exploration_fraction * args.total_timesteps
            epsilons = [
                linear_schedule(args.start_e, args.end_e, duration, global_step + args.num_envs * (t + 1))
                for t in range(args.num_steps)
            ]
            explore, random_actions = draw_exploration(epsilons, args.num_envs, n_act, device)
            epsilon_value = epsilons[-1]
            for step in range(args.num_steps):
                global_step += args.num_envs
                storage["obs"][step] = next_obs
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                action, value = policy(next_obs, explore[step], random_actions[step])
                actions.append(action)
                values.append(value)
                # note: a CPU-GPU sync point on CUDA, which the host env needs anyway
                next_obs_np, reward, termination, truncation, infos = envs.step(action.cpu().numpy())
                stage["rewards"][step] = reward
                stage["terminations"][step] = termination
                stage["dones"][step] = termination | truncation
                next_obs = torch.as_tensor(next_obs_np, device=device)
                seeds.episodes(runs, global_step, infos, args.num_envs)

            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            next_value = policy(next_obs, explore[0], random_actions[0])[1]  # its values only
            torch.stack(actions, out=storage["actions"])
            torch.stack(values, out=storage["values"])
            for key, staged in stage.items():
                storage[key].copy_(torch.from_numpy(staged))
            valid = 1.0 - torch.cat([torch.from_numpy(done_before).to(device).unsqueeze(0), storage["dones"][:-1]])
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            returns = returns_fn(storage["rewards"], storage["values"], next_value, storage["terminations"], storage["dones"])

            batch = (
                storage["obs"].view((batch_size,) + obs_shape),
                storage["actions"].view(batch_size),
                returns.view(batch_size),
                valid.view(batch_size),
            )
            for epoch in range(args.update_epochs):
                for idx in torch.randperm(batch_size, device=device).split(minibatch_size):
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call; only the latest is read.
                    metrics = update(*batch, idx)
                    updates += 1

            # As CleanRL: the last minibatch's loss and Q-values (over its valid steps).
            # note: the loop's only host sync is here, once per iteration
            charts = {"charts/learning_rate": lr_now, "charts/epsilon": epsilon_value}
            if not seeds.log(runs, global_step, updates, metrics, METRICS, [{"q_network": q_network}], **charts):
                break
    envs.close()
    seeds.finish(
        runs, global_step, updates, [{"q_network": q_network}],
        lambda nets, seed_args, name: evaluate(nets["q_network"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

"""PPO on Atari through envpool, lean: torch.compile, CUDA graphs and tensordict.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the Nature CNN (Mnih et al., 2015) and the implementation details of CleanRL's
`ppo_atari_envpool.py` (Huang et al., "The 37 Implementation Details of PPO", ICLR blog track
2022). The games run in envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey
frames stacked by 4, frame skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped
rewards for learning; the reported returns are whole games, unclipped. It learns as the plain
script `ppo_atari_envpool.py` does; what changes is where the time goes: acting runs on a
detached view of the weights without autograd, and the minibatch step (gather, forward,
backward, clipping, optimizers.Adam) is one function that compiles to one graph.

    python leanrl/ppo_atari_envpool_torchcompile.py
    python leanrl/ppo_atari_envpool_torchcompile.py --compile
    python leanrl/ppo_atari_envpool_torchcompile.py --compile --cudagraphs

Data-parallel over processes, GPUs and nodes when torchrun starts it: --num-envs is per process,
each minibatch step averages the gradients over all of them, and rank 0 alone prints and saves.

    torchrun --standalone --nproc_per_node 2 leanrl/ppo_atari_envpool_torchcompile.py --compile

`--num-seeds N` trains seeds `seed` to `seed + N - 1` at once in one process: one envpool of
N x num_envs games, the agents' weights stacked on a leading seed dimension (one seed is a stack
of one), acting and the update vmapped over them.
"""

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tensordict.nn import CudaGraphModule

from leanrl_utils import checks, cli, fail, optimizers, resume, seeds, speed, torchrun, vector


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
    """episodes (whole games) of the deterministic policy to run after training (0: none)"""
    num_seeds: int = 1
    """independent agents trained at once, seeds `seed` to `seed + num-seeds - 1` (`total-timesteps` each)"""

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
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantage normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
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


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN trunk shared by a policy head and a value head."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def forward(self, obs):
        hidden = self.network(obs / 255.0)
        return self.actor(hidden), self.critic(hidden).flatten()


def make_policy(agent, params, num_seeds):
    """Acting: for frames [seeds * envs, 4, 84, 84] (seed k's envs in block k), one forward of each
    seed's trunk and both heads with its own weights, without autograd. `params`: the agents'
    parameters stacked on a leading seed dimension (`seeds.stack`), read through `agent`'s
    structure (`seeds.forward`: vmapped over stacked seeds; one seed runs the module itself)."""
    forward = seeds.forward(agent)

    def policy(obs):
        logits, value = (x.flatten(0, 1) for x in forward(params, obs.view(num_seeds, -1, *obs.shape[1:])))
        # Gumbel-max: argmax(logits + Gumbel noise) is a sample of Categorical(logits), in
        # elementwise ops that compile, where torch.multinomial would break the graph.
        gumbel = -(-torch.rand_like(logits).log()).log()
        action = (logits + gumbel).argmax(1)
        logprob = logits.log_softmax(1).gather(1, action.unsqueeze(1)).squeeze(1)
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
    """One minibatch step on the rows `idx` of the rollout: the gather and the uint8-to-float
    division, forward, backward (torch.func), `clip_grad_norm_`'s arithmetic and `optimizers.Adam`, one
    function that compiles to one graph (`fullgraph=True`; with `loss.backward()` and
    `optim.Adam.step()` it broke into several, dynamo tracing neither). Returns METRICS on the
    device. `valid` is 0 at envpool's reset steps (see the rollout in `main`): every mean runs
    over the other steps only, the advantage normalization included.

    `world_size` > 1 (torchrun): gradients and metrics averaged over the ranks by one `all_reduce`
    in the graph, so every rank takes the same step and reads the same `--target-kl` and
    non-finite checks (each rank's minibatch weighs alike, whatever its count of reset steps;
    advantages normalized per rank, as CleanRL's multi-GPU PPO). `num_seeds`: stacked seeds
    [seeds, ...] (parameters, rollout, `idx`, metrics), the gradient and its clipping vmapped, a
    stack of one the agent's own ops (`seeds.vmap`)."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef

    def loss_fn(params, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_valid):
        logits, newvalue = torch.func.functional_call(agent, params, (mb_obs,))
        logits = logits.log_softmax(1)
        newlogprob = logits.gather(1, mb_actions.unsqueeze(1)).squeeze(1)
        entropy = -(logits.exp() * logits).sum(1)
        n_valid = mb_valid.sum().clamp(min=1)

        logratio = newlogprob - mb_logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio * mb_valid).sum() / n_valid
            approx_kl = (((ratio - 1) - logratio) * mb_valid).sum() / n_valid
            clipfrac = (((ratio - 1.0).abs() > clip_coef).float() * mb_valid).sum() / n_valid

        if args.norm_adv:
            adv_mean = (mb_advantages * mb_valid).sum() / n_valid
            adv_std = (((mb_advantages - adv_mean) ** 2 * mb_valid).sum() / (n_valid - 1).clamp(min=1)).sqrt()
            mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)

        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = (torch.max(pg_loss1, pg_loss2) * mb_valid).sum() / n_valid

        if args.clip_vloss:
            v_loss_unclipped = (newvalue - mb_returns) ** 2
            v_clipped = mb_values + torch.clamp(newvalue - mb_values, -clip_coef, clip_coef)
            v_loss_clipped = (v_clipped - mb_returns) ** 2
            v_loss = 0.5 * (torch.max(v_loss_unclipped, v_loss_clipped) * mb_valid).sum() / n_valid
        else:
            v_loss = 0.5 * ((newvalue - mb_returns) ** 2 * mb_valid).sum() / n_valid

        entropy_loss = (entropy * mb_valid).sum() / n_valid
        loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
        return loss, torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()

    grad_fn = torch.func.grad(loss_fn, has_aux=True)

    def clipped_grads(params, obs, actions, logprobs, advantages, returns, values, valid, idx):
        minibatch = (obs[idx], actions[idx], logprobs[idx], advantages[idx], returns[idx], values[idx], valid[idx])
        grads, metrics = grad_fn(params, *minibatch)
        if world_size > 1:
            grads, metrics = torchrun.all_reduce_mean(grads, metrics, world_size)
        # nn.utils.clip_grad_norm_
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (args.max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
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


def explained_variance(y_pred, y_true, valid):
    """CleanRL's 1 - Var[y_true - y_pred] / Var[y_true] (NaN when Var[y_true] is 0) over the valid
    steps of the last dimension (per seed for [seeds, batch]), with masks: indexing by a boolean
    mask would sync the host with the device."""
    n = valid.sum(-1)

    def var(x):
        return ((x - (x * valid).sum(-1, keepdim=True) / n.unsqueeze(-1)) ** 2 * valid).sum(-1) / n

    var_y = var(y_true)
    return torch.where(var_y == 0, torch.nan, 1 - var(y_true - y_pred) / var_y)


def evaluate(agent, args, run_name, device):
    """Mean whole-game return of the deterministic policy (the most likely action) over
    `eval_episodes` games. Episodic life stays on, so that envpool presses FIRE after each lost
    life (a greedy policy may never do it); a game that never ends is cut by envpool's own limit
    of 27,000 steps (108,000 frames, 30 minutes of play)."""
    eval_envs = vector.envpool_envs(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            logits, _ = agent(torch.as_tensor(obs, device=device))
            obs, _, _, _, infos = eval_envs.step(logits.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    checks.flags(args, atari=True)
    rank, world_size, device = torchrun.init(args)
    _, cudagraphs = speed.setup(args, rank)
    # --num-envs is per rank: a batch is num_envs * num_steps per rank, all ranks' together per update.
    batch_size = args.num_envs * args.num_steps
    global_batch = batch_size * world_size
    if args.total_timesteps < global_batch and not (args.total_timesteps == 0 and args.load_model):
        per = f" * {world_size} ranks" if world_size > 1 else ""
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one batch "
            f"(num_envs * num_steps{per} = {global_batch}): give at least {global_batch}"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} "
            "(num_envs * num_steps): pass a divisor of it"
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
            fail(
                "--target-kl stops each seed's epochs at a different point, which one stacked update cannot: "
                "drop it or use --num-seeds 1"
            )
    # One line before num_seeds x num_envs games are made: per step and sub-env the uint8
    # frames and ten 4-byte numbers, in the rollout and again in the seed-major batch; per
    # seed 4 copies of its weights (with gradients and optimizers.Adam's moments) and a minibatch's
    # activations (72k floats a frame) and their gradients; up to 2 MiB per game.
    weights = sum(p.numel() for p in Agent(18, device="meta").parameters())
    seed_bytes = 4 * 4 * weights + minibatch_size * 2 * 4 * 72_000
    checks.rollout(args, 2 * (4 * 84 * 84 + 4 * 10), device, per_env=2**21, per_seed=seed_bytes)
    runs = seeds.runs(args, num_iterations * global_batch, __file__, resumed, rank=rank)
    run = runs[0]

    # Each rank its own random streams (envs, exploration noise, minibatch order); the initial
    # weights come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if cudagraphs and world_size > 1 and dist.get_backend() != "nccl":
        # gloo runs its collectives on the host, where a CUDA graph cannot capture them.
        cudagraphs = False
        if rank == 0:
            print("notice: --cudagraphs under torchrun needs --backend nccl; running without CUDA graphs", file=sys.stderr)
    if num_seeds > 1 and device.type == "cpu":
        # vmap runs the seeds' convolutions as grouped ones, which oneDNN runs slower per seed
        # than one seed's channels-last convolutions.
        print(
            "notice: on a CPU, --num-seeds runs Atari seeds slower than one at a time (grouped convolutions); "
            "it is meant for a GPU",
            file=sys.stderr,
        )

    # Sub-env k * num_envs + i is env i of seed k. envpool seeds its env j with `seed + j`, so
    # that env gets seed + k * num_envs + i, not the seed + i of a single run of seed + k: the
    # seeds are independent streams, not bit-identical to single runs.
    num_envs = num_seeds * args.num_envs
    envs = vector.envpool_envs(args.env_id, num_envs, args.seed + rank, args.capture_video and rank == 0, f"videos/{run.name}")
    n_act = envs.single_action_space.n

    agents = [Agent(n_act, device=device)]
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        agents.append(Agent(n_act, device=device))
    for agent in agents if args.load_model else []:
        run.load({"agent": agent})
    if world_size > 1:
        torchrun.broadcast(agents[0].parameters())
    # Acting and the update read the same stacked, detached parameters (the agents hold views of
    # them): no autograd bookkeeping per step, and every optimizer step is seen at once.
    params = seeds.stack(agents)
    seed_networks = [{"agent": agent} for agent in agents]
    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # Eager updates step optimizers.Adam with the fused kernel; a compiled update traces its per-tensor form.
    # On CUDA, optimizers.Adam's step counts live on the device (capturable), so a step never syncs.
    lr = torch.tensor(args.learning_rate, device=device)
    optimizer = optimizers.Adam(params.items(), lr, eps=1e-5, fused=not args.compile, capturable=device.type == "cuda")

    policy = make_policy(agents[0], dict(params.items()), num_seeds)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agents[0], optimizer, args, world_size, num_seeds)
    # --compile: the update on every device (its pointwise ops, clipping and optimizers.Adam fuse around the
    # convolutions); the policy only on CUDA, where launches dominate: on a CPU its convolutions
    # are the same either way. GAE stays eager: compiling its sequential loop would unroll it.
    if args.compile:
        update = torch.compile(update, fullgraph=True, options={"guard_filter_fn": speed.value_guards})
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)

    # oneDNN's convolutions are faster channels-last on a CPU (inductor picks that layout itself
    # when compiling), so the update's frames are transposed once per rollout, not per minibatch.
    # Stacked seeds keep theirs: vmap runs their convolutions as grouped ones on its own copy.
    channels_last = device.type == "cpu" and num_seeds == 1

    def by_seed(x):
        """A rollout [num_steps, num_seeds * num_envs, ...] as a batch [num_seeds, batch_size, ...]."""
        return x.unflatten(1, (num_seeds, args.num_envs)).transpose(0, 1).reshape(num_seeds, batch_size, *x.shape[2:])

    global_step = updates = 0
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs, device=device)
    next_done = torch.zeros(num_envs, device=device)
    lost = False
    # envpool's games cannot be saved: a resumed run starts fresh episodes.
    global_step, updates = run.resume({"params": params, "optimizer": optimizer}, lambda: (global_step, updates))
    try:
        for iteration in range(global_step // global_batch + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
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
                    # envpool autoresets on the NEXT step: the step that ends an episode returns
                    # its last frame, and the following step ignores its action, resets that env
                    # and returns reward 0 with the first frame of the next episode. So a done
                    # before acting (done_list) marks a reset step, which the update leaves out.
                    # note: a CPU-GPU sync point on CUDA; envpool returns a fresh array each step,
                    # so on a CPU the frames are kept without a copy.
                    next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                    reward_list.append(reward)
                    next_obs = torch.as_tensor(next_obs_np, device=device)
                    next_done = torch.as_tensor(np.logical_or(terminations, truncations), device=device, dtype=torch.float)
                    if world_size > 1:
                        finished += vector.ended_episodes(global_step, infos)
                    else:
                        seeds.episodes(runs, global_step, infos, args.num_envs)

                obs_b = torch.stack(obs_list)
                valid = 1.0 - torch.stack(done_list)
                dones = torch.stack(done_list[1:] + [next_done])
                values = torch.stack(value_list)
                rewards = torch.as_tensor(np.stack(reward_list), device=device, dtype=torch.float)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                next_value = policy(next_obs)[2].clone()
                advantages, returns = gae(rewards, values, dones, next_value)

            if world_size > 1:
                for step, r, n in torchrun.gather_episodes(finished, rank, world_size):
                    run.record(step, r, n)

            frames = by_seed(obs_b)
            if channels_last:
                frames = frames.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, frames.shape[:2])
            act_b, logprob_b = torch.stack(act_list), torch.stack(logprob_list)
            batch = (frames, *(by_seed(x) for x in (act_b, logprob_b, advantages, returns, values, valid)))
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
                # note: a host sync, once per epoch and only with --target-kl
                if args.target_kl is not None and metrics[0, APPROX_KL].item() > args.target_kl:
                    break

            clipfrac = clipfrac_sum / ((epoch + 1) * args.num_minibatches)
            explained_var = explained_variance(batch[5], batch[4], batch[6])
            stats = torch.cat([metrics[:, :CLIPFRAC], clipfrac[:, None], explained_var[:, None]], 1).T
            # note: the loop's only host sync is here, once per iteration
            charts = {"charts/learning_rate": lr_now}
            if not seeds.log(runs, global_step, updates, stats, STATS, seed_networks, **charts):
                break
    except RuntimeError as e:  # gloo's and nccl's errors (dist.DistError among them)
        if world_size == 1:
            raise
        # Under torchrun a rank that stops (Ctrl-C, a crash) or does not answer within
        # --dist-timeout ends the others' collectives with an error: end as after a bad loss.
        lost = True
        run.stop_reason = (
            f"rank {rank} stopped at step {global_step}: "
            f"another rank is gone or was silent for --dist-timeout ({torchrun.error_line(e)})"
        )
    envs.close()
    fields = torchrun.leave(run, params.values(), world_size, lost) if world_size > 1 else {}
    seeds.finish(
        runs, global_step, updates, seed_networks,
        lambda nets, seed_args, name: evaluate(nets["agent"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs, world_size=world_size, batch_size=global_batch, **fields,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

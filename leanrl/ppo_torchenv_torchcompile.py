"""PPO for discrete actions on torch-native envs, lean: the whole rollout as compiled code.

PPO (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with the details and defaults of
CleanRL's `ppo.py`, learning as the plain script `ppo_torchenv.py` does. The env is a pair of pure
functions on tensors (`leanrl_envs`), so nothing of the loop lives on the host: one call runs
`--unroll` steps of policy (derived from the one module), action draw, env step and storage,
compiled into one graph; GAE with the minibatch orders is one graph, and the minibatch step
(gather, forward, backward, clipping, optimizers.Adam) one more, as in `ppo_torchcompile.py`.
Episodes and losses stay on the device until the one host sync per iteration, at logging.

    python leanrl/ppo_torchenv_torchcompile.py
    python leanrl/ppo_torchenv_torchcompile.py --compile
    python leanrl/ppo_torchenv_torchcompile.py --compile --cudagraphs

Random numbers are counter-based, as the envs' reset draws (`leanrl_envs.uniform`): the uniform
behind an action is a hash of (seed, step, env), a minibatch order one of (seed, iteration,
epoch). They are the same eager, compiled or graphed, there is no generator to carry, save or
restore, and stacked seeds draw apart. `--num-seeds N` trains seeds `seed` to `seed + N - 1` at
once: weights and optimizers.Adam states stacked on a leading seed dimension (one seed is a stack
of one), each seed's envs and draws vmapped over its own key. Seed k makes the run a single run
of seed + k makes: the same initial weights, reset draws, action uniforms and minibatch orders,
and all else within float rounding (a batched matmul sums in another order).
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
    """videos need gymnasium's renderer: the torch-native envs refuse this flag (use ppo.py)"""
    save_model: bool = False
    """whether to save the model into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes of the greedy policy (the most likely action) to run after training (0: none)"""
    num_seeds: int = 1
    """independent agents trained at once, seeds `seed` to `seed + num-seeds - 1` (`total-timesteps` each)"""

    # algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment, one of leanrl_envs.ENVS"""
    total_timesteps: int = 500_000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
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
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
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
    unroll: int = 8
    """env steps per rollout call, unrolled into one graph (a divisor of num-steps): more compile longer, call less"""


def check_torch_env(args):
    """One clear line, before any other check, for an env or flag the torch-native envs cannot serve."""
    if args.env_id not in leanrl_envs.ENVS:
        fail(f"--env-id {args.env_id} has no torch-native env: use one of {', '.join(leanrl_envs.ENVS)}")
    if args.capture_video:
        fail("--capture-video: torch-native envs have no renderer; record with ppo.py (pip install 'leanrl[video]')")


def make_env(args, num_envs, device):
    """The torch-native vector env."""
    return leanrl_envs.make(args.env_id, num_envs, device)


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
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )

    def forward(self, obs):
        return self.actor(obs), self.critic(obs).flatten()


def make_update(agent, optimizer, args, num_seeds=1):
    """One minibatch step on the rows `idx` of the rollout: gather, forward, backward (torch.func),
    `clip_grad_norm_`'s arithmetic and `optimizers.Adam`, one function that compiles to one graph.
    Returns METRICS on the device. Stacked seeds [seeds, ...] (parameters, rollout, `idx`,
    metrics): the gradient and its clipping vmapped, a stack of one the agent's own ops (`seeds.vmap`)."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef
    norm_adv, clip_vloss, max_grad_norm = args.norm_adv, args.clip_vloss, args.max_grad_norm

    def loss_fn(params, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values):
        logits, newvalue = torch.func.functional_call(agent, params, (mb_obs,))
        logits = logits.log_softmax(1)  # Categorical(logits=...) normalizes them so
        newlogprob = logits.gather(1, mb_actions.unsqueeze(1)).squeeze(1)
        entropy = -(logits.exp() * logits).sum(1)

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
    """Generalized advantage estimation over a rollout (num_steps, ...). `dones[t]`: the episode
    ended at step t, so neither the next state's value nor the next advantage flows back into it.
    The recursion A[t] = delta[t] + decay[t] * A[t + 1] runs as a scan in log2(num_steps) rounds
    (Hillis and Steele, 1986) instead of num_steps: a few dozen ops, eager or compiled, where the
    loop's 400 ops cost a millisecond eager and compile into a graph as long as the rollout."""

    def gae(rewards, values, dones, next_value):
        nextnonterminal = 1.0 - dones
        nextvalues = torch.cat([values[1:], next_value.unsqueeze(0)])
        advantages = rewards + gamma * nextvalues * nextnonterminal - values  # the deltas, to start
        decay = gamma * gae_lambda * nextnonterminal
        shift = 1
        # After each round A[t] sums deltas t to t + 2 * shift - 1, and decay[t] is the product of
        # the decays over those steps (where that runs past the end, the sum stops there).
        while shift < len(advantages):
            advantages = torch.cat([advantages[:-shift] + decay[:-shift] * advantages[shift:], advantages[-shift:]])
            decay = torch.cat([decay[:-shift] * decay[shift:], decay[-shift:]])
            shift *= 2
        return advantages, advantages + values

    return gae


# Each seed draws three streams of uniforms, told apart by the key: its envs' resets (the seed),
# its actions (seed + ACTIONS, at the env's step counter) and its minibatch orders (seed + ORDERS,
# at the iteration). Seeds stay below 2**31 and a run's seeds lie fewer than 2**30 apart: no two
# streams of a run meet.
ACTIONS, ORDERS = 1 << 31, 1 << 30


def make_rollout(agent, params, env, num_seeds, steps):
    """`steps` steps of every seed's envs from (obs [seeds, envs, n_obs], state): the policy
    (`seeds.forward` of the module), an action drawn from the softmax of the logits by inverse CDF
    (the first action whose cumulative probability passes a uniform: elementwise ops that compile,
    where torch.multinomial breaks a graph), the env step. Returns the next obs and state, then
    the steps' obs, actions, log-probabilities, values, rewards, dones and the episode returns and
    lengths (meaningful where done), each [steps, seeds, envs]. Each seed's draw and env step are
    vmapped over its own key; a stack of one runs them alone (tracing vmap doubled the compile)."""
    forward = seeds.forward(agent)

    def act_and_step(logits, state):
        """One seed: its envs' normalized logits and env state."""
        cdf = logits.exp().cumsum(1)
        uniform = leanrl_envs.uniform(state.key + ACTIONS, state.counter, len(logits), 1) * cdf[:, -1:]
        action = (cdf <= uniform).sum(1).clamp(max=logits.shape[1] - 1)  # a rounding at the top stays in range
        state, out = env.step(state, action)
        return action, state, out

    def stack_of_one(logits, state):
        action, state, out = act_and_step(logits[0], leanrl_envs.State(*(x[0] for x in state)))
        return action[None], leanrl_envs.State(*(x[None] for x in state)), leanrl_envs.Step(*(x[None] for x in out))

    seeds_act_and_step = torch.func.vmap(act_and_step) if num_seeds > 1 else stack_of_one

    def rollout(obs, state):
        rows = []
        for _ in range(steps):
            logits, value = forward(params, obs)
            logits = logits.log_softmax(-1)
            action, state, out = seeds_act_and_step(logits, state)
            logprob = logits.gather(-1, action.unsqueeze(-1)).squeeze(-1)
            done = out.terminated | out.truncated
            rows.append((obs, action, logprob, value, out.reward, done, out.episode_return, out.episode_length))
            obs = out.obs
        return obs, state, tuple(torch.stack(column) for column in zip(*rows))

    return rollout


def evaluate(agent, args, device):
    """Mean return of the greedy policy (the most likely action) over `eval_episodes` episodes."""
    eval_env = make_env(args, 1, device)
    returns = []
    state, obs = eval_env.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            state, out = eval_env.step(state, agent.actor(obs).argmax(1))
            obs = out.obs
            if out.terminated | out.truncated:
                returns.append(float(out.episode_return))
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    resumed = resume.read(args, __file__)
    check_torch_env(args)
    checks.flags(args)
    device, cudagraphs = speed.setup(args)
    env = make_env(args, args.num_envs, device)
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
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(
            f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: "
            f"use at most {batch_size // 2}, or --no-norm-adv"
        )
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // batch_size
    if args.unroll < 1 or args.num_steps % args.unroll:
        divisor = max(d for d in range(1, max(args.unroll, 1) + 1) if args.num_steps % d == 0)
        fail(f"--unroll {args.unroll} does not divide --num-steps {args.num_steps}: pass a divisor of it, e.g. {divisor}")
    if num_seeds > 1 and args.target_kl is not None:
        fail("--target-kl stops each seed at another epoch, which one stacked update cannot: drop it or use --num-seeds 1")
    # Per step of an env: float32 obs, 8 stored numbers and their batched copies; the env's state.
    checks.rollout(args, 12 * (env.obs_dim + 8), device, per_env=8 * len(env.reset_low) + 16)
    runs = seeds.runs(args, num_iterations * batch_size, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    agents = [Agent(env.obs_dim, env.num_actions, device=device)]
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        agents.append(Agent(env.obs_dim, env.num_actions, device=device))
    for agent in agents if args.load_model else []:
        run.load({"agent": agent})
    params = seeds.stack(agents)

    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # Eager updates step optimizers.Adam with the fused kernel; a compiled update traces its per-tensor form.
    lr = torch.tensor(args.learning_rate, device=device)
    iteration_now = torch.zeros((), dtype=torch.int64, device=device)
    optimizer = optimizers.Adam(params.items(), lr, eps=1e-5, fused=not args.compile, capturable=device.type == "cuda")
    rollout = make_rollout(agents[0], dict(params.items()), env, num_seeds, args.unroll)
    forward = seeds.forward(agents[0])
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agents[0], optimizer, args, num_seeds)

    # Seed k's envs and draws: those of a single run of seed + k.
    resets = [env.reset(seed=args.seed + k) for k in range(num_seeds)]
    state = leanrl_envs.State(*(torch.stack(field) for field in zip(*(s for s, _ in resets))))
    obs = torch.stack([o for _, o in resets])
    keys = state.key
    draw_orders = lambda key, iteration: leanrl_envs.uniform(key + ORDERS, iteration, args.update_epochs, batch_size)

    def advantages_and_orders(obs, rewards, values, dones, iteration):
        """GAE with its bootstrap value, and each seed's minibatch orders for every epoch of the
        iteration (a tensor, so that a new one compiles nothing), [seeds, epochs, batch]."""
        advantages, returns = gae(rewards, values, dones.float(), forward(params, obs)[1])
        orders = torch.func.vmap(draw_orders, in_dims=(0, None))(keys, iteration).argsort(dim=-1, stable=True)
        return advantages, returns, orders

    # --compile: the rollout (--unroll steps of policy, draw and env step in one graph), GAE with
    # the orders, and the update, each one graph; inductor's C++ wrapper drops the Python glue
    # between kernels on a CPU.
    if args.compile:
        # use_decompose_tanh: inductor's C++ code computes tanh as 2 / (1 + exp(-2x)) - 1 (within
        # 2e-7 of torch.tanh): its vectorized tanh cost several times eager's (benchmark/RESULTS.md).
        options = {"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu", "cpp.use_decompose_tanh": True}
        # The envs' hash reads each intermediate twice; inductor inlines such chains into their
        # readers, and tracing their copies took most of the rollout's compile. Storing any
        # intermediate of more than 4 ops cuts that several times over.
        rollout = torch.compile(rollout, fullgraph=True, options={**options, "realize_opcount_threshold": 4})
        advantages_and_orders = torch.compile(advantages_and_orders, fullgraph=True, options=options)
        update = torch.compile(update, fullgraph=True, options=options)
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        rollout, advantages_and_orders, update = speed.interruptible(run, rollout, advantages_and_orders, update)
    if cudagraphs:
        rollout, advantages_and_orders, update = map(CudaGraphModule, (rollout, advantages_and_orders, update))

    def by_seed(x):
        """[num_steps, seeds, envs, ...] -> [seeds, num_steps * envs, ...]: each seed's rollout
        flattened as a single run flattens its own."""
        return x.transpose(0, 1).reshape(num_seeds, batch_size, *x.shape[3:])

    global_step = updates = 0
    objects = {"params": params, "optimizer": optimizer}
    global_step, updates, obs, state = run.resume(objects, lambda: (global_step, updates, obs, tuple(state)), device)
    state = leanrl_envs.State(*state)
    seed_networks = [{"agent": agent} for agent in agents]
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // batch_size + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            lr.copy_(lr_now)
            iteration_now.fill_(iteration)

            chunks = []
            for _ in range(args.num_steps // args.unroll):
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                obs, state, rows = rollout(obs, state)
                chunks.append([x.clone() for x in rows] if cudagraphs else rows)  # graphed outputs: overwritten next call
            (b_obs, actions, logprobs, values, rewards, dones, ep_returns, ep_lengths) = map(torch.cat, zip(*chunks))
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            advantages, returns, orders = advantages_and_orders(obs, rewards, values, dones, iteration_now)

            batch = tuple(by_seed(x) for x in (b_obs, actions, logprobs, advantages, returns, values))
            clipfrac_sum = torch.zeros(num_seeds, device=device)
            for epoch in range(args.update_epochs):
                for idx in orders[:, epoch].split(minibatch_size, dim=1):
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call: the last one is read.
                    metrics = update(*batch, idx)
                    clipfrac_sum += metrics[:, CLIPFRAC]
                    updates += 1
                # note: a host sync, once per epoch and only with --target-kl (one seed)
                if args.target_kl is not None and metrics[0, APPROX_KL].item() > args.target_kl:
                    break
            global_step += batch_size

            y_pred, y_true = batch[5], batch[4]
            var_y = y_true.var(1, unbiased=False)
            explained_var = torch.where(var_y > 0, 1 - (y_true - y_pred).var(1, unbiased=False) / var_y, torch.nan)
            clipfrac = clipfrac_sum / ((epoch + 1) * args.num_minibatches)
            stats = torch.cat([metrics[:, :CLIPFRAC], clipfrac[:, None], explained_var[:, None]], 1).T
            # note: the loop's only host sync, once per iteration: the episodes that ended, then the stats
            ended = torch.stack([dones.float(), ep_returns, ep_lengths.float()]).cpu().numpy()
            start = global_step - batch_size
            for t, k, i in zip(*ended[0].nonzero()):
                runs[k].record(start + (int(t) + 1) * args.num_envs, float(ended[1, t, k, i]), int(ended[2, t, k, i]))
            if not seeds.log(runs, global_step, updates, stats, STATS, seed_networks, **{"charts/learning_rate": lr_now}):
                break
    seeds.finish(
        runs, global_step, updates, seed_networks,
        lambda nets, seed_args, name: evaluate(nets["agent"], seed_args, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

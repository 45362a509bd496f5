"""PPO for discrete actions, lean: torch.compile, CUDA graphs and tensordict.

PPO (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with the details and defaults of
CleanRL's `ppo.py`, learning as the plain script `ppo.py` does. What changes is where the time
goes: on a CPU the rollout loop acts in numpy with no torch call (actor and critic derived from
the one module), the rollout is stored in arrays allocated once, the minibatch step (gather,
forward, backward, clipping, optimizers.Adam) is one function that compiles to one graph, and nothing syncs
the host with the device between two log points but `--target-kl`.

    python leanrl/ppo_torchcompile.py
    python leanrl/ppo_torchcompile.py --compile
    python leanrl/ppo_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains seeds `seed` to `seed + N - 1` at once in one process: their weights and
optimizers.Adam states stacked on a leading seed dimension (one seed is a stack of one), acting and the
update batched over them, each agent on its own slice of one vector env. Seed k is not bit-identical
to a single run of seed + k: the agents share one stream of random numbers for acting and minibatches.
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
    """episodes of the greedy policy (the most likely action) to run after training (0: none)"""
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
    `clip_grad_norm_`'s arithmetic and `optimizers.Adam`, one function that compiles to one graph (with
    `loss.backward()` and `optim.Adam.step()` it broke into three). Returns METRICS on the device.
    `num_seeds`: stacked seeds [seeds, ...] (parameters, rollout, `idx`, metrics), the gradient and
    its clipping vmapped, a stack of one the agent's own ops (`seeds.vmap`)."""
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
    critic (`params` stacked), an action drawn from the softmax of the logits by inverse CDF (the
    first action whose cumulative probability passes a uniform: one draw per env, elementwise ops
    that compile, where torch.multinomial breaks a graph) and its log-probability. Derived from
    `agent`: `host` (a CPU), numpy in and out (`acting.numpy_forward`, uniforms from a generator seeded
    with `seed`), where an op on a few numbers costs under a microsecond and a torch op several;
    else torch (`seeds.forward`), which CUDA compiles and graphs (called through `acting.host_arrays`)."""
    if host:
        forward, rng = acting.numpy_forward(agent, params), np.random.default_rng(seed)

        def host_policy(obs):
            logits, value = forward(obs.reshape(num_seeds, -1, obs.shape[-1]))
            logits -= logits.max(2, keepdims=True)
            cdf = np.exp(logits).cumsum(2)
            total = cdf[..., -1:]
            uniform = rng.random(total.shape, dtype=np.float32) * total
            action = np.minimum((cdf <= uniform).sum(2), logits.shape[2] - 1)  # a rounding at the top stays in range
            logprob = np.take_along_axis(logits, action[..., None], 2)[..., 0] - np.log(total[..., 0])
            return action.ravel(), logprob.ravel(), value.ravel()

        return host_policy

    forward = seeds.forward(agent)

    def policy(obs):
        logits, value = (x.flatten(0, 1) for x in forward(params, obs.view(num_seeds, -1, obs.shape[-1])))
        logits = logits.log_softmax(1)
        cdf = logits.exp().cumsum(1)
        uniform = torch.rand_like(cdf[:, -1:]) * cdf[:, -1:]
        action = (cdf <= uniform).sum(1).clamp(max=logits.shape[1] - 1)
        return action, logits.gather(1, action.unsqueeze(1)).squeeze(1), value

    return policy


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
        # SAME_STEP autoreset: every stored step is a real transition, and GAE cuts the bootstrap
        # at `done` exactly as in the gym 0.26 loop CleanRL was written for.
        envs = vector.SameStepEnvs([make_env(args.env_id, i, capture_video, run_name) for i in range(num_envs)])
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e})")
    action_space, observation_space = envs.single_action_space, envs.single_observation_space
    if not isinstance(action_space, gym.spaces.Discrete):
        fail(
            f"{args.env_id} has a {type(action_space).__name__} action space; "
            "this script handles discrete actions only (e.g. CartPole-v1)"
        )
    if not isinstance(observation_space, gym.spaces.Box):
        fail(
            f"{args.env_id} has a {type(observation_space).__name__} observation space; "
            "this script handles Box observations only"
        )
    return envs


def evaluate(agent, args, run_name, device):
    """Mean return of the greedy policy (the most likely action) over `eval_episodes` episodes."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            logits = agent.actor(torch.as_tensor(obs, device=device, dtype=torch.float).flatten(1))
            obs, _, _, _, infos = eval_envs.step(logits.argmax(1).cpu().numpy())
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
    minibatch_size = batch_size // args.num_minibatches
    if args.norm_adv and minibatch_size < 2:
        fail(
            f"--num-minibatches {args.num_minibatches} makes minibatches of 1, whose advantages cannot be normalized: "
            f"use at most {batch_size // 2}, or --no-norm-adv"
        )
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // batch_size
    if num_seeds > 1 and args.target_kl is not None:
        fail("--target-kl stops each seed at another epoch, which one stacked update cannot: drop it or use --num-seeds 1")
    device, cudagraphs = speed.setup(args)
    # One line before the envs are made: per step of a sub-env, float32 obs (two copies) and 6
    # numbers (two copies), 16 KiB per sub-env for the env itself.
    checks.rollout(args, 8 * (vector.env_sizes(args.env_id)[0] + 6), device, per_env=2**14)
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

    agents = [Agent(n_obs, n_act, device=device)]
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        agents.append(Agent(n_obs, n_act, device=device))
    for agent in agents if args.load_model else []:
        run.load({"agent": agent})
    params = seeds.stack(agents)

    # The learning rate is a tensor annealed in place, so annealing never recompiles the update.
    # Eager updates step optimizers.Adam with the fused kernel; a compiled update traces its per-tensor form.
    lr = torch.tensor(args.learning_rate, device=device)
    optimizer = optimizers.Adam(params.items(), lr, eps=1e-5, fused=not args.compile, capturable=device.type == "cuda")
    policy = make_policy(agents[0], dict(params.items()), num_seeds, device.type == "cpu", seed=args.seed)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agents[0], optimizer, args, num_seeds)

    # The rollout: host arrays, where the envs and acting are (one copy per field per rollout to
    # the device).
    steps_envs = (args.num_steps, sub_envs)
    stage = {"obs": np.zeros((*steps_envs, n_obs), np.float32), "actions": np.zeros(steps_envs, np.int64),
             **{k: np.zeros(steps_envs, np.float32) for k in ("logprobs", "values", "rewards", "dones")}}  # fmt: skip
    storage = {k: torch.from_numpy(v).to(device, copy=True) for k, v in stage.items()}

    # --compile: the update everywhere (inductor's C++ wrapper drops the Python glue between its
    # kernels on a CPU); the policy off a CPU (numpy acts there); GAE stays eager, as compiling its
    # sequential loop would unroll num_steps steps into one graph.
    if args.compile:
        # use_decompose_tanh: inductor's C++ code computes tanh as 2 / (1 + exp(-2x)) - 1 (within
        # 2e-7 of torch.tanh): its vectorized tanh cost several times eager's (benchmark/RESULTS.md).
        options = {"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu", "cpp.use_decompose_tanh": True}
        update = torch.compile(update, fullgraph=True, options=options)
        if device.type != "cpu":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update, policy = CudaGraphModule(update), CudaGraphModule(policy)
    if device.type != "cpu":
        policy = acting.host_arrays(policy, device)

    def by_seed(x):
        """[num_steps, seeds * envs, ...] -> [seeds, num_steps * envs, ...]: each seed's rollout
        flattened as a single run flattens its own."""
        x = x.view(args.num_steps, num_seeds, args.num_envs, *x.shape[2:]).transpose(0, 1)
        return x.reshape(num_seeds, batch_size, *x.shape[3:])

    global_step = updates = 0
    # Env i of seed k gets the env seed a single run of seed + k gives it.
    obs, _ = envs.reset(seed=[args.seed + k + i for k in range(num_seeds) for i in range(args.num_envs)])
    obs = obs.reshape(sub_envs, n_obs).astype(np.float32, copy=False)
    objects = {"params": params, "optimizer": optimizer, "envs": envs, "policy": policy}
    global_step, updates, obs = run.resume(objects, lambda: (global_step, updates, obs), device)
    seed_networks = [{"agent": agent} for agent in agents]
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // batch_size + 1, num_iterations + 1):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            lr.copy_(lr_now)

            for step in range(args.num_steps):
                global_step += args.num_envs
                stage["obs"][step] = obs
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                action, stage["logprobs"][step], stage["values"][step] = policy(obs)
                stage["actions"][step] = action
                next_obs, stage["rewards"][step], terminations, truncations, infos = envs.step(action)
                # SAME_STEP autoreset (see make_envs): next_obs already starts the next episode
                # where the step ended one, and GAE does not bootstrap across it.
                stage["dones"][step] = terminations | truncations
                seeds.episodes(runs, global_step, infos, args.num_envs)
                obs = next_obs.reshape(sub_envs, n_obs).astype(np.float32, copy=False)

            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            next_value = torch.from_numpy(policy(obs)[2]).to(device)  # its values only
            for key, staged in stage.items():
                storage[key].copy_(torch.from_numpy(staged))
            advantages, returns = gae(storage["rewards"], storage["values"], storage["dones"], next_value)

            batch = tuple(by_seed(x) for x in (storage["obs"], storage["actions"], storage["logprobs"], advantages, returns))
            batch = (*batch, by_seed(storage["values"]))
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
    envs.close()
    seeds.finish(
        runs, global_step, updates, seed_networks,
        lambda nets, seed_args, name: evaluate(nets["agent"], seed_args, name, device),
        device=device.type, cudagraphs=cudagraphs,
    )  # fmt: skip


if __name__ == "__main__":
    main(cli(Args))

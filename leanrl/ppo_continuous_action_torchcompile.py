"""PPO for continuous actions, lean: torch.compile, CUDA graphs and tensordict.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the implementation details of CleanRL's `ppo_continuous_action.py` (Huang et al., "The 37
Implementation Details of PPO", ICLR blog track 2022). Same defaults and the same learning as
the plain script `ppo_continuous_action.py`; only the speed differs.

    python leanrl/ppo_continuous_action_torchcompile.py
    python leanrl/ppo_continuous_action_torchcompile.py --compile
    python leanrl/ppo_continuous_action_torchcompile.py --compile --cudagraphs
"""

import importlib.util
import json
import math
import os
import random
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tqdm
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule


@dataclass
class Args:
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
    """Toggles advantages normalization"""
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


def fail(message: str):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_env_id(env_id: str):
    if env_id not in gym.registry:
        fail(f"unknown environment id {env_id!r}: pass --env-id with a registered gymnasium id, e.g. HalfCheetah-v5")


def make_env(env_id, idx, capture_video, run_name, gamma):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        if not isinstance(env.action_space, gym.spaces.Box):
            fail(f"{env_id} has a {type(env.action_space).__name__} action space; this script handles continuous (Box) actions only")
        env = gym.wrappers.FlattenObservation(env)
        # Counted before reward normalization, so that the reported returns are the true ones.
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=gamma)
        env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def make_envs(args, run_name, num_envs):
    """The vector env, or one clear line for an env this script cannot use."""
    check_env_id(args.env_id)
    if args.capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
        # MuJoCo renders off-screen through EGL, which needs no display; MUJOCO_GL=glfw or
        # osmesa set by the user wins.
        os.environ.setdefault("MUJOCO_GL", "egl")
    thunks = [make_env(args.env_id, i, args.capture_video, run_name, args.gamma) for i in range(num_envs)]
    try:
        # SAME_STEP autoreset: the step that ends an episode already returns the first
        # observation of the next one (the final one is in infos["final_obs"]). Every stored
        # step is then a real transition, and GAE cuts the bootstrap at `done` exactly as in
        # the gym 0.26 loop CleanRL was written for. Under the NEXT_STEP default the step after
        # a done would be a no-op reset step that PPO would have to mask out of its losses.
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as e:
        fail(f"{args.env_id} needs a missing dependency ({e}): for MuJoCo envs, pip install 'leanrl[mujoco]'")
    return envs


def obs_normalizers(envs):
    """The NormalizeObservation wrapper of each sub-env: their statistics go in checkpoints."""
    found = []
    for env in envs.envs:
        while not isinstance(env, gym.wrappers.NormalizeObservation):
            env = env.env
        found.append(env)
    return found


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


# log N(x; mu, std) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), written out because
# building a torch.distributions.Normal costs more than the arithmetic at these sizes.
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def make_policy(agent):
    """Acting: one forward of actor and critic, without autograd."""

    def policy(obs):
        action_mean, logstd, value = agent(obs)
        noise = torch.randn_like(action_mean)
        action = action_mean + logstd.exp() * noise
        logprob = (-0.5 * noise.pow(2) - logstd - LOG_SQRT_2PI).sum(1)
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


def make_update(agent, lr, args, betas=(0.9, 0.999), eps=1e-5):
    """One minibatch step as a pure function of tensors, so that torch.compile sees all of it as
    one graph (`fullgraph=True`): the minibatch gather, forward, backward (`torch.func.grad`),
    gradient clipping and Adam. The same step written with `loss.backward()` and
    `optim.Adam.step()` breaks into three graphs with eager glue between them (dynamo does not
    trace `zero_grad` nor `Tensor.backward`), and costs about 3x more per call on a CPU.

    The arithmetic is torch's `clip_grad_norm_` followed by `Adam` (tests check it against
    them); the Adam state lives in this closure and `lr` is a tensor updated in place."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef
    norm_adv, clip_vloss, max_grad_norm = args.norm_adv, args.clip_vloss, args.max_grad_norm
    beta1, beta2 = betas
    params = dict(agent.named_parameters())
    exp_avg = {k: torch.zeros_like(p) for k, p in params.items()}
    exp_avg_sq = {k: torch.zeros_like(p) for k, p in params.items()}
    step = torch.zeros((), device=lr.device)

    def loss_fn(params, mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values):
        action_mean, logstd, newvalue = torch.func.functional_call(agent, params, (mb_obs,))
        newlogprob = (-0.5 * ((mb_actions - action_mean) / logstd.exp()).pow(2) - logstd - LOG_SQRT_2PI).sum(1)
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
        stats = torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, loss]).detach()
        return loss, stats

    grad_fn = torch.func.grad(loss_fn, has_aux=True)

    def update(obs, actions, logprobs, advantages, returns, values, idx):
        minibatch = (obs[idx], actions[idx], logprobs[idx], advantages[idx], returns[idx], values[idx])
        grads, stats = grad_fn({k: p.detach() for k, p in params.items()}, *minibatch)

        # nn.utils.clip_grad_norm_
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        # optim.Adam
        step.add_(1)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        with torch.no_grad():
            for k, p in params.items():
                g = grads[k] * clip
                exp_avg[k].lerp_(g, 1 - beta1)
                exp_avg_sq[k].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (exp_avg_sq[k] / bias_correction2).sqrt_().add_(eps)
                p.sub_(lr * (exp_avg[k] / bias_correction1) / denom)
        return torch.cat([stats, grad_norm.unsqueeze(0)])

    return update


METRICS = ["value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "loss", "grad_norm"]


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, agent_state, envs, args):
    norms = obs_normalizers(envs)
    checkpoint = {
        "model": {k: v.detach().cpu() for k, v in agent_state.items()},
        "obs_rms": [{"mean": n.obs_rms.mean, "var": n.obs_rms.var, "count": n.obs_rms.count} for n in norms],
        "args": vars(args),
    }
    return atomic_save(checkpoint, path)


def load_checkpoint(path, agent, envs):
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path!r}: pass --load-model with a file written by --save-model")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    agent.load_state_dict(checkpoint["model"])
    for i, norm in enumerate(obs_normalizers(envs)):
        stats = checkpoint["obs_rms"][min(i, len(checkpoint["obs_rms"]) - 1)]
        norm.obs_rms.mean, norm.obs_rms.var, norm.obs_rms.count = stats["mean"], stats["var"], stats["count"]


def evaluate(agent, envs, args, run_name, device):
    """Mean return of the deterministic policy (the action mean) over `eval_episodes` episodes,
    with the observation statistics frozen at their training values."""
    eval_envs = make_envs(args, run_name + "-eval", 1)
    for src, dst in zip(obs_normalizers(envs)[:1], obs_normalizers(eval_envs)):
        dst.obs_rms = src.obs_rms
        dst.update_running_mean = False
    returns = []
    obs, _ = eval_envs.reset(seed=args.seed + 10_000)
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            action = agent.actor_mean(torch.as_tensor(obs, device=device, dtype=torch.float))
            obs, _, _, _, infos = eval_envs.step(action.cpu().numpy())
            if "final_info" in infos:
                final = infos["final_info"]
                returns.extend(final["episode"]["r"][final["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    batch_size = args.num_envs * args.num_steps
    if args.num_minibatches < 1 or batch_size % args.num_minibatches != 0:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps)")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_envs(args, run_name, args.num_envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    agent = Agent(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, agent, envs)
    # Acting uses a detached view of the same parameters: no autograd bookkeeping per step, and
    # every optimizer step is visible to it at once (the storages are shared).
    agent_inference = Agent(n_obs, n_act, device="meta")
    from_module(agent).data.to_module(agent_inference)

    # The learning rate is a tensor updated in place, so annealing never recompiles the update.
    lr = torch.tensor(args.learning_rate, device=device)

    policy = make_policy(agent_inference)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agent, lr, args)
    # What --compile compiles, measured on a 2-core CPU with torch 2.13, one thread (see README):
    # - update: one graph (gather, forward, backward, clipping, Adam) of 0.70 ms per minibatch
    #   compiled; written with loss.backward() and optim.Adam it broke into three graphs and took
    #   about 3x as long. Compiled on every device;
    # - policy: 0.15 ms eager, 0.20 ms compiled for one observation on a CPU (guards cost more
    #   than fusion saves), so it is compiled on CUDA only, where launches dominate;
    # - gae: a sequential loop of num_steps steps (28 ms per 2048 here); compiling it would unroll
    #   all of them into one graph, so it stays eager.
    if args.compile:
        update = torch.compile(update, fullgraph=True)
        if device.type == "cuda":
            policy = torch.compile(policy)
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates, iteration = 0, 0, 0
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = None
    interrupted = False
    stop_reason = None

    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs, device=device, dtype=torch.float)
    next_done = torch.zeros(args.num_envs, device=device)
    pbar = tqdm.tqdm(total=num_iterations * batch_size, disable=num_iterations == 0, file=sys.stderr)
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                lr.copy_(frac * args.learning_rate)

            obs_list, done_list, act_list, logprob_list, value_list, reward_list = [], [], [], [], [], []
            with torch.no_grad():
                for _ in range(args.num_steps):
                    global_step += args.num_envs
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    action, logprob, value = policy(next_obs)
                    obs_list.append(next_obs)
                    done_list.append(next_done)
                    act_list.append(action)
                    logprob_list.append(logprob)
                    value_list.append(value)
                    # note: a CPU-GPU sync point on CUDA; a no-copy view on a CPU
                    next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                    reward_list.append(reward)
                    next_obs = torch.as_tensor(next_obs_np, device=device, dtype=torch.float)
                    next_done = torch.as_tensor(np.logical_or(terminations, truncations), device=device, dtype=torch.float)
                    if "final_info" in infos:
                        final = infos["final_info"]
                        recent_returns.extend(final["episode"]["r"][final["_episode"]].tolist())

                obs_b = torch.stack(obs_list)
                dones = torch.stack(done_list[1:] + [next_done])
                values = torch.stack(value_list)
                rewards = torch.as_tensor(np.stack(reward_list), device=device, dtype=torch.float)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                next_value = policy(next_obs)[2].clone()
                advantages, returns = gae(rewards, values, dones, next_value)

            flat = (
                obs_b.reshape(batch_size, n_obs),
                torch.stack(act_list).reshape(batch_size, n_act),
                torch.stack(logprob_list).reshape(batch_size),
                advantages.reshape(batch_size),
                returns.reshape(batch_size),
                values.reshape(batch_size),
            )
            if args.save_model:
                last_good = {k: v.clone() for k, v in agent.state_dict().items()}
            stats = torch.zeros(len(METRICS), device=device)
            for epoch in range(args.update_epochs):
                order = torch.randperm(batch_size, device=device).split(minibatch_size)
                epoch_stats = torch.zeros(len(METRICS), device=device)
                for idx in order:
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    epoch_stats += update(*flat, idx)
                    updates += 1
                stats += epoch_stats
                # note: a host sync, paid once per epoch and only when --target-kl is set
                if args.target_kl is not None and epoch_stats[METRICS.index("approx_kl")] / len(order) > args.target_kl:
                    break

            # Logging, once per iteration: the host syncs of this loop are all here.
            stats = dict(zip(METRICS, (stats / (len(order) * (epoch + 1))).tolist()))
            if not math.isfinite(stats["loss"]):
                stop_reason = f"non-finite loss {stats['loss']} at step {global_step} (iteration {iteration})"
                break
            if warmup_s is None:
                warmup_s = time.perf_counter() - start_time
                warm_step, warm_time = global_step, time.perf_counter()
            sps = (global_step - warm_step) / max(time.perf_counter() - warm_time, 1e-9) if global_step > warm_step else float("nan")
            mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
            pbar.update(batch_size)
            pbar.set_description(f"sps={sps:6.0f} return={mean_return:8.2f}")
            if recent_returns:
                curve.append((global_step, round(time.perf_counter() - start_time, 3), round(mean_return, 3)))
            if wandb is not None:
                y_pred, y_true = values.flatten(), returns.flatten()
                var_y = y_true.var()
                explained_var = (1 - (y_true - y_pred).var() / var_y).item() if var_y > 0 else float("nan")
                log = {f"losses/{k}": v for k, v in stats.items() if k not in ("grad_norm", "loss")}
                log.update({"charts/learning_rate": lr.item(), "losses/explained_variance": explained_var, "charts/SPS": sps})
                if recent_returns:
                    log["charts/episodic_return"] = mean_return
                wandb.log(log, step=global_step)
    except KeyboardInterrupt:
        interrupted = True
        print(f"notice: interrupted at step {global_step}; saving what there is", file=sys.stderr)
    finally:
        pbar.close()

    end_time = time.perf_counter()
    saved = None
    if args.save_model:
        # The state after the last finite update, if the run stopped on a non-finite loss.
        saved = save_checkpoint(checkpoint_path, last_good if stop_reason else agent.state_dict(), envs, args)
        print(f"notice: model saved to {saved}", file=sys.stderr)
    eval_return = None
    if args.eval_episodes > 0 and stop_reason is None:
        eval_return = evaluate(agent, envs, args, run_name, device)
    envs.close()

    summary = {
        "script": os.path.basename(__file__),
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": args.compile,
        "cudagraphs": cudagraphs,
        "device": device.type,
        "total_steps": global_step,
        "wall_s": round(end_time - start_time, 3),
        "sps": round((global_step - warm_step) / (end_time - warm_time), 1) if global_step > warm_step else None,
        "warmup_s": round(warmup_s, 3) if warmup_s is not None else None,
        "episodic_return": float(np.mean(recent_returns)) if recent_returns else None,
        "updates": updates,
        "eval_return": eval_return,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "interrupted": interrupted,
        "checkpoint": saved,
        "curve": curve[:: max(1, len(curve) // 200)],
    }
    if wandb is not None:
        wandb.finish()
    print(json.dumps(summary), flush=True)
    if stop_reason:
        fail(stop_reason)


def parse_args() -> Args:
    """tyro's command line, where a boolean is a flag (`--compile`, `--no-autotune`), also taking
    the spelling `--autotune false` or `--autotune=False`."""
    flags = {"--" + name.replace("_", "-") for name, kind in Args.__annotations__.items() if kind is bool}
    argv = []
    for arg in sys.argv[1:]:
        flag, eq, value = arg.partition("=")
        if not eq and argv and argv[-1] in flags and arg.lower() in ("true", "false"):
            flag, value = argv.pop(), arg
        if flag in flags and value.lower() in ("true", "false"):
            arg = flag if value.lower() == "true" else "--no-" + flag[2:]
        argv.append(arg)
    return tyro.cli(Args, args=argv)


if __name__ == "__main__":
    main(parse_args())

"""PPO for continuous actions, plain PyTorch in the CleanRL style: the baseline.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the implementation details of CleanRL's `ppo_continuous_action.py` (Huang et al., "The 37
Implementation Details of PPO", ICLR blog track 2022). Same defaults and the same learning as
the lean script `ppo_continuous_action_torchcompile.py`, which is the same algorithm made
fast; this file is what the speed-ups are measured against.

    python leanrl/ppo_continuous_action.py
    python leanrl/ppo_continuous_action.py --env-id InvertedPendulum-v5
    python leanrl/ppo_continuous_action.py --cuda false
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
import torch.optim as optim
import tqdm
import tyro
from torch.distributions.normal import Normal


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

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = torch.exp(action_logstd)
        # Unvalidated, so that a diverged update reaches the non-finite-loss check as NaN instead
        # of raising here.
        probs = Normal(action_mean, action_std, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


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
            action = agent.actor_mean(torch.Tensor(obs).to(device))
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

    envs = make_envs(args, run_name, args.num_envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    agent = Agent(n_obs, n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, agent, envs)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    checkpoint_path = f"runs/{run_name}/{args.exp_name}.pt"
    recent_returns = deque(maxlen=10)
    curve = []  # (env steps, seconds, mean return) at each log point, for the benchmark's plots
    global_step, updates = 0, 0
    start_time = time.perf_counter()
    warmup_s, warm_step, warm_time = None, 0, start_time
    last_good = None
    interrupted = False
    stop_reason = None

    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)
    pbar = tqdm.tqdm(total=num_iterations * batch_size, disable=num_iterations == 0, file=sys.stderr)
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            for step in range(0, args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done

                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                # SAME_STEP autoreset (see make_envs): next_obs already starts the next episode
                # where next_done is set, and GAE below does not bootstrap across it.
                next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                next_done = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).to(device).view(-1)
                next_obs, next_done = torch.Tensor(next_obs).to(device), torch.Tensor(next_done).to(device)

                if "final_info" in infos:
                    final = infos["final_info"]
                    for episodic_return in final["episode"]["r"][final["_episode"]]:
                        recent_returns.append(float(episodic_return))
                        if wandb is not None:
                            wandb.log({"charts/episodic_return": episodic_return}, step=global_step)

            # bootstrap value if not done
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards).to(device)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                returns = advantages + values

            b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1,) + envs.single_action_space.shape)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            if args.save_model:
                last_good = {k: v.clone() for k, v in agent.state_dict().items()}
            b_inds = np.arange(batch_size)
            clipfracs = []
            for epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    end = start + minibatch_size
                    mb_inds = b_inds[start:end]

                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
                        old_approx_kl = (-logratio).mean()
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                    # Value loss
                    newvalue = newvalue.view(-1)
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(
                            newvalue - b_values[mb_inds],
                            -args.clip_coef,
                            args.clip_coef,
                        )
                        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                        v_loss = 0.5 * v_loss_max.mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    updates += 1

                if args.target_kl is not None and approx_kl > args.target_kl:
                    break

            if not math.isfinite(loss.item()):
                stop_reason = f"non-finite loss {loss.item()} at step {global_step} (iteration {iteration})"
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
                y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
                var_y = np.var(y_true)
                explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
                wandb.log(
                    {
                        "charts/learning_rate": optimizer.param_groups[0]["lr"],
                        "losses/value_loss": v_loss.item(),
                        "losses/policy_loss": pg_loss.item(),
                        "losses/entropy": entropy_loss.item(),
                        "losses/old_approx_kl": old_approx_kl.item(),
                        "losses/approx_kl": approx_kl.item(),
                        "losses/clipfrac": np.mean(clipfracs),
                        "losses/explained_variance": explained_var,
                        "charts/SPS": sps,
                    },
                    step=global_step,
                )
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
        "compile": False,
        "cudagraphs": False,
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

"""PPO on Atari through envpool, plain PyTorch in the CleanRL style: the baseline.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the Nature CNN (Mnih et al., 2015) and the implementation details of CleanRL's
`ppo_atari_envpool.py` (Huang et al., "The 37 Implementation Details of PPO", ICLR blog track
2022). The games run in envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey
frames stacked by 4, frame skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped
rewards for learning; the reported returns are whole games, unclipped. Same defaults and the
same learning as the lean script `ppo_atari_envpool_torchcompile.py`, which is the same
algorithm made fast; this file is what the speed-ups are measured against.

    python leanrl/ppo_atari_envpool.py
    python leanrl/ppo_atari_envpool.py --env-id Pong-v5
    python leanrl/ppo_atari_envpool.py --cuda false
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
from torch.distributions.categorical import Categorical


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
    """whether to save the model into `runs/{run_name}`"""
    load_model: str | None = None
    """path of a checkpoint to start from (with `--total-timesteps 0`: evaluate it only)"""
    eval_episodes: int = 0
    """episodes (whole games) of the deterministic policy to run after training (0: none)"""

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
    """Toggles advantages normalization"""
    clip_coef: float = 0.1
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


def fail(message: str):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class RecordEpisodeStatistics(gym.vector.VectorWrapper):
    """Returns and lengths of whole games, summed over all lives, from the unclipped rewards.

    With episodic life, envpool ends an episode at every lost life, but a game is over only when
    `infos["terminated"]` says so (no lives left) or the step limit truncates it. The finished
    games are reported as gymnasium's vector wrapper does: `infos["episode"]["r"]` where
    `infos["_episode"]`. Steps count every call, envpool's reset steps included, as in CleanRL.
    """

    def __init__(self, env):
        super().__init__(env)
        self.episode_returns = np.zeros(self.num_envs, dtype=np.float64)
        self.episode_lengths = np.zeros(self.num_envs, dtype=np.int64)

    def reset(self, **kwargs):
        obs, infos = self.env.reset(**kwargs)
        self.episode_returns[:] = 0
        self.episode_lengths[:] = 0
        return obs, infos

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        # infos["reward"] is the game's own reward, before envpool's clipping to its sign.
        self.episode_returns += infos["reward"]
        self.episode_lengths += 1
        game_over = infos["terminated"].astype(bool) | truncations
        infos["episode"] = {"r": self.episode_returns.copy(), "l": self.episode_lengths.copy()}
        infos["_episode"] = game_over
        self.episode_returns[game_over] = 0
        self.episode_lengths[game_over] = 0
        return obs, rewards, terminations, truncations, infos


class RecordGameVideo(gym.vector.VectorWrapper):
    """Videos of env 0's whole games, on the schedule of gymnasium's RecordVideo (games 0, 1, 8,
    27, ..., 1000, 2000, ...). envpool renders env 0's full RGB screen (210x160) on request, which
    costs one extra copy per step only while a game is being recorded."""

    def __init__(self, env, video_folder, fps=15):
        # Imported here: gymnasium's save_video module raises at import without moviepy, which
        # only --capture-video needs.
        from gymnasium.utils.save_video import capped_cubic_video_schedule

        super().__init__(env)
        self.schedule = capped_cubic_video_schedule
        self.video_folder, self.fps = video_folder, fps
        os.makedirs(video_folder, exist_ok=True)
        self.game, self.frames = 0, []

    def _capture(self):
        if self.schedule(self.game):
            self.frames.append(self.env.render()[0])

    def _write(self):
        from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

        if len(self.frames) > 1:
            clip = ImageSequenceClip(self.frames, fps=self.fps)
            clip.write_videofile(os.path.join(self.video_folder, f"rl-video-game-{self.game}.mp4"), logger=None)
        self.frames = []

    def reset(self, **kwargs):
        obs, infos = self.env.reset(**kwargs)
        self.frames = []
        self._capture()
        return obs, infos

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        self._capture()
        if infos["terminated"][0] or truncations[0]:
            self._write()
            self.game += 1
        return obs, rewards, terminations, truncations, infos

    def close(self, **kwargs):
        self._write()
        return self.env.close(**kwargs)


def make_env(env_id, num_envs, seed, capture_video=False, video_folder=None):
    """An envpool batch of `num_envs` Atari games, or one clear line for what is missing."""
    try:
        import envpool
    except ImportError:
        fail("this script needs envpool for its Atari games: pip install 'leanrl[atari]'")
    if env_id not in envpool.list_all_envs() or not hasattr(envpool.make_spec(env_id).config, "episodic_life"):
        fail(f"unknown Atari id {env_id!r}: pass --env-id with an envpool Atari game, e.g. Breakout-v5 or Pong-v5")
    if capture_video and importlib.util.find_spec("moviepy") is None:
        fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
    envs = envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        episodic_life=True,
        reward_clip=True,
        seed=seed,
        **({"render_mode": "rgb_array"} if capture_video else {}),
    )
    if capture_video:
        envs = RecordGameVideo(envs, video_folder)
    return RecordEpisodeStatistics(envs)


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

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        # Unvalidated, so that a diverged update reaches the non-finite-loss check as NaN instead
        # of raising here.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, agent_state, args):
    checkpoint = {"model": {k: v.detach().cpu() for k, v in agent_state.items()}, "args": vars(args)}
    return atomic_save(checkpoint, path)


def load_checkpoint(path, agent):
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path!r}: pass --load-model with a file written by --save-model")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    agent.load_state_dict(checkpoint["model"])


def evaluate(agent, args, run_name, device):
    """Mean whole-game return of the deterministic policy (the most likely action) over
    `eval_episodes` games. Episodic life stays on, so that envpool presses FIRE after each lost
    life (a greedy policy may never do it); a game that never ends is cut by envpool's own limit
    of 27,000 steps (108,000 frames, 30 minutes of play)."""
    eval_envs = make_env(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            logits = agent.actor(agent.network(torch.as_tensor(obs, device=device) / 255.0))
            obs, _, _, _, infos = eval_envs.step(logits.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


def main(args: Args):
    batch_size = args.num_envs * args.num_steps
    if args.num_envs < 1 or args.num_steps < 1:
        fail(f"--num-envs {args.num_envs} and --num-steps {args.num_steps} must both be at least 1")
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

    envs = make_env(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run_name}")
    obs_shape = envs.single_observation_space.shape

    agent = Agent(envs.single_action_space.n, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, agent)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    wandb = None
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    # Frames stay uint8 (a quarter of the memory); the network divides them by 255.
    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
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

    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs).to(device)
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

                # envpool autoresets on the NEXT step: the step that ends an episode returns its
                # last frame, and the following step ignores its action, resets that env and
                # returns reward 0 with the first frame of the next episode. So dones[t] = 1
                # marks a reset step t, which the losses below leave out (see `valid`).
                next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                next_done = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).to(device).view(-1)
                next_obs, next_done = torch.as_tensor(next_obs).to(device), torch.Tensor(next_done).to(device)

                for episodic_return, length in zip(infos["episode"]["r"][infos["_episode"]], infos["episode"]["l"][infos["_episode"]]):
                    recent_returns.append(float(episodic_return))
                    if wandb is not None:
                        wandb.log({"charts/episodic_return": episodic_return, "charts/episodic_length": length}, step=global_step)

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

            b_obs = obs.reshape((-1,) + obs_shape)
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)
            # A reset step is no transition of the game (its action did nothing, its frame is the
            # previous episode's last): every mean in the losses runs over the other steps only.
            # GAE already stops at the done before it, so its garbage flows nowhere else.
            b_valid = 1.0 - dones.reshape(-1)

            if args.save_model:
                last_good = {k: v.clone() for k, v in agent.state_dict().items()}
            b_inds = np.arange(batch_size)
            clipfracs = []
            for epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    end = start + minibatch_size
                    mb_inds = b_inds[start:end]
                    mb_valid = b_valid[mb_inds]
                    n_valid = mb_valid.sum().clamp(min=1)

                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
                        old_approx_kl = (-logratio * mb_valid).sum() / n_valid
                        approx_kl = (((ratio - 1) - logratio) * mb_valid).sum() / n_valid
                        clipfracs += [((((ratio - 1.0).abs() > args.clip_coef).float() * mb_valid).sum() / n_valid).item()]

                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        adv_mean = (mb_advantages * mb_valid).sum() / n_valid
                        adv_std = (((mb_advantages - adv_mean) ** 2 * mb_valid).sum() / (n_valid - 1).clamp(min=1)).sqrt()
                        mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)

                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = (torch.max(pg_loss1, pg_loss2) * mb_valid).sum() / n_valid

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
                        v_loss = 0.5 * (v_loss_max * mb_valid).sum() / n_valid
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2 * mb_valid).sum() / n_valid

                    entropy_loss = (entropy * mb_valid).sum() / n_valid
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
                valid = b_valid.bool()
                y_pred, y_true = b_values[valid].cpu().numpy(), b_returns[valid].cpu().numpy()
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
        saved = save_checkpoint(checkpoint_path, last_good if stop_reason else agent.state_dict(), args)
        print(f"notice: model saved to {saved}", file=sys.stderr)
    eval_return = None
    if args.eval_episodes > 0 and stop_reason is None:
        eval_return = evaluate(agent, args, run_name, device)
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
    """tyro's command line, where a boolean is a flag (`--compile`, `--no-cuda`), also taking
    the spelling `--cuda false` or `--cuda=False`."""
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

"""PPO on Atari through envpool, lean: torch.compile, CUDA graphs and tensordict.

Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347) with
the Nature CNN (Mnih et al., 2015) and the implementation details of CleanRL's
`ppo_atari_envpool.py` (Huang et al., "The 37 Implementation Details of PPO", ICLR blog track
2022). The games run in envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey
frames stacked by 4, frame skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped
rewards for learning; the reported returns are whole games, unclipped. Same defaults and the
same learning as the plain script `ppo_atari_envpool.py`; only the speed differs.

    python leanrl/ppo_atari_envpool_torchcompile.py
    python leanrl/ppo_atari_envpool_torchcompile.py --compile
    python leanrl/ppo_atari_envpool_torchcompile.py --compile --cudagraphs
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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""


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

    def forward(self, obs):
        hidden = self.network(obs / 255.0)
        return self.actor(hidden), self.critic(hidden).flatten()


def make_policy(agent):
    """Acting: one forward of the shared trunk and both heads, without autograd."""

    def policy(obs):
        logits, value = agent(obs)
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


def make_update(agent, lr, args, betas=(0.9, 0.999), eps=1e-5):
    """One minibatch step as a pure function of tensors, so that torch.compile sees all of it as
    one graph (`fullgraph=True`): the minibatch gather and the uint8-to-float division, forward,
    backward (`torch.func.grad`), gradient clipping and Adam. Written with `loss.backward()` and
    `optim.Adam.step()`, the step breaks into several graphs with eager glue between them
    (dynamo traces neither `zero_grad` nor `Tensor.backward`).

    The arithmetic is torch's `clip_grad_norm_` followed by `Adam` (tests check it against
    them); the Adam state lives in this closure and `lr` is a tensor updated in place.

    `valid` is 0 at envpool's reset steps (see the rollout in `main`): every mean runs over the
    other steps only, the advantage normalization included."""
    clip_coef, ent_coef, vf_coef = args.clip_coef, args.ent_coef, args.vf_coef
    norm_adv, clip_vloss, max_grad_norm = args.norm_adv, args.clip_vloss, args.max_grad_norm
    beta1, beta2 = betas
    params = dict(agent.named_parameters())
    exp_avg = {k: torch.zeros_like(p) for k, p in params.items()}
    exp_avg_sq = {k: torch.zeros_like(p) for k, p in params.items()}
    step = torch.zeros((), device=lr.device)

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

        if norm_adv:
            adv_mean = (mb_advantages * mb_valid).sum() / n_valid
            adv_std = (((mb_advantages - adv_mean) ** 2 * mb_valid).sum() / (n_valid - 1).clamp(min=1)).sqrt()
            mb_advantages = (mb_advantages - adv_mean) / (adv_std + 1e-8)

        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = (torch.max(pg_loss1, pg_loss2) * mb_valid).sum() / n_valid

        if clip_vloss:
            v_loss_unclipped = (newvalue - mb_returns) ** 2
            v_clipped = mb_values + torch.clamp(newvalue - mb_values, -clip_coef, clip_coef)
            v_loss_clipped = (v_clipped - mb_returns) ** 2
            v_loss = 0.5 * (torch.max(v_loss_unclipped, v_loss_clipped) * mb_valid).sum() / n_valid
        else:
            v_loss = 0.5 * ((newvalue - mb_returns) ** 2 * mb_valid).sum() / n_valid

        entropy_loss = (entropy * mb_valid).sum() / n_valid
        loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
        stats = torch.stack([v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, loss]).detach()
        return loss, stats

    grad_fn = torch.func.grad(loss_fn, has_aux=True)

    def update(obs, actions, logprobs, advantages, returns, values, valid, idx):
        minibatch = (obs[idx], actions[idx], logprobs[idx], advantages[idx], returns[idx], values[idx], valid[idx])
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
    cudagraphs = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)

    envs = make_env(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run_name}")
    obs_shape = envs.single_observation_space.shape
    n_act = envs.single_action_space.n

    agent = Agent(n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, agent)
    # Acting uses a detached view of the same parameters: no autograd bookkeeping per step, and
    # every optimizer step is visible to it at once (the storages are shared).
    agent_inference = Agent(n_act, device="meta")
    from_module(agent).data.to_module(agent_inference)

    # The learning rate is a tensor updated in place, so annealing never recompiles the update.
    lr = torch.tensor(args.learning_rate, device=device)

    policy = make_policy(agent_inference)
    gae = make_gae(args.gamma, args.gae_lambda)
    update = make_update(agent, lr, args)
    # What --compile compiles, measured on this 2-core CPU with torch 2.13, one thread, medians
    # (see README, PPO on Atari):
    # - update: 163 ms eager, 125 ms compiled per minibatch of 256, both on channels-last frames
    #   (see below): the gather, the uint8-to-float division, the losses, the backward's pointwise
    #   ops, clipping and Adam fuse into a few C++ kernels around oneDNN's convolutions, which
    #   are most of what is left. Compiled on every device;
    # - policy: 2.8 ms eager, 2.9 ms compiled for the 8 frames of one step (the same oneDNN
    #   convolutions, plus guards), so it is compiled on CUDA only, where launches dominate;
    # - gae: a sequential loop of num_steps steps; compiling it would unroll it, so it stays eager.
    if args.compile:
        update = torch.compile(update, fullgraph=True)
        if device.type == "cuda":
            policy = torch.compile(policy)
    if cudagraphs:
        update = CudaGraphModule(update)
        policy = CudaGraphModule(policy)

    # oneDNN's convolutions are faster channels-last on a CPU (inductor picks that layout itself
    # when compiling), so the update's frames are transposed once per rollout, not in every
    # minibatch: 235 -> 163 ms per minibatch eager, 181 -> 125 ms compiled.
    frame_format = torch.channels_last if device.type == "cpu" else torch.contiguous_format

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

    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs, device=device)
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
                    recent_returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())

                obs_b = torch.stack(obs_list)
                valid = 1.0 - torch.stack(done_list)
                dones = torch.stack(done_list[1:] + [next_done])
                values = torch.stack(value_list)
                rewards = torch.as_tensor(np.stack(reward_list), device=device, dtype=torch.float)
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                next_value = policy(next_obs)[2].clone()
                advantages, returns = gae(rewards, values, dones, next_value)

            flat = (
                obs_b.reshape((batch_size,) + obs_shape).contiguous(memory_format=frame_format),
                torch.stack(act_list).reshape(batch_size),
                torch.stack(logprob_list).reshape(batch_size),
                advantages.reshape(batch_size),
                returns.reshape(batch_size),
                values.reshape(batch_size),
                valid.reshape(batch_size),
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
                keep = flat[-1].bool()
                y_pred, y_true = flat[5][keep], flat[4][keep]
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

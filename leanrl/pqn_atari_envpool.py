"""PQN on Atari through envpool, plain PyTorch in the CleanRL style: the baseline.

Parallelised Q-Network (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning",
https://arxiv.org/abs/2407.04811) with the details and defaults of CleanRL's
`pqn_atari_envpool.py`: Q-learning with the Nature CNN (Mnih et al., 2015) and LayerNorm after
every layer, vectorized envs, epsilon-greedy rollouts, Q(lambda) returns and a few epochs of
minibatch updates per rollout, with no replay buffer and no target network. The games run in
envpool (Weng et al., 2022) with its Atari preprocessing: 84x84 grey frames stacked by 4, frame
skip 4, up to 30 no-ops and FIRE at reset, episodic life and clipped rewards for learning; the
reported returns are whole games, unclipped. The lean script `pqn_atari_envpool_torchcompile.py`
learns the same way, faster; this file is what its speed-ups are measured against.

    python leanrl/pqn_atari_envpool.py
    python leanrl/pqn_atari_envpool.py --env-id Pong-v5
"""

import importlib.util
import json
import math
import os
import random
import resource
import signal
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


ALGORITHM = "pqn_atari_envpool"


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


def make_envs(env_id, num_envs, seed, capture_video=False, video_folder=None):
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


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


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
        return self.network(x / 255.0)


def evaluate(q_network, args, run_name, device):
    """Mean whole-game return of the greedy policy over `eval_episodes` games. Episodic life stays
    on, so that envpool presses FIRE after each lost life (a greedy policy may never do it); a
    game that never ends is cut by envpool's own limit of 27,000 steps (108,000 frames, 30
    minutes of play)."""
    eval_envs = make_envs(args.env_id, 1, args.seed + 10_000, args.capture_video, f"videos/{run_name}-eval")
    returns = []
    obs, _ = eval_envs.reset()
    with torch.no_grad():
        while len(returns) < args.eval_episodes:
            q_values = q_network(torch.as_tensor(obs, device=device))
            obs, _, _, _, infos = eval_envs.step(q_values.argmax(1).cpu().numpy())
            returns.extend(infos["episode"]["r"][infos["_episode"]].tolist())
    eval_envs.close()
    return float(np.mean(returns[: args.eval_episodes]))


# ---------------------------------------------------------------- RUN
# The same block in every LeanRL script: argument rules, the run's folder and metrics, signals,
# checkpoints and the summary line. Nothing in it is specific to one algorithm.

# One rule per flag, the same in every script that has the flag.
COUNTS = ("num_seeds", "threads", "num_envs", "num_steps", "num_minibatches", "update_epochs", "batch_size", "buffer_size",
          "train_frequency", "target_network_frequency", "policy_frequency")
RULES = {
    "seed": (lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    **{k: (lambda v: v >= 0, "0 or more") for k in ("total_timesteps", "learning_starts", "eval_episodes")},
    **{k: (lambda v: v >= 1, "1 or more") for k in COUNTS},
    **{k: (lambda v: math.isfinite(v) and v > 0, "a finite number > 0") for k in ("learning_rate", "q_lr", "policy_lr", "max_grad_norm")},
    **{k: (lambda v: 0 < v <= 1, "a number in (0, 1]") for k in ("gamma", "tau")},
    **{k: (lambda v: 0 <= v <= 1, "a number in [0, 1]") for k in ("gae_lambda", "start_e", "end_e", "exploration_fraction")},
    **{k: (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
       for k in ("clip_coef", "ent_coef", "vf_coef", "alpha", "policy_noise", "noise_clip", "exploration_noise")},
    "target_kl": (lambda v: v is None or (math.isfinite(v) and v > 0), "a finite number > 0"),
}


def fail(message):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a stderr cannot split it
    sys.exit(2)


def check_args(args):
    for name, value in vars(args).items():
        if name in RULES and not RULES[name][0](value):
            fail(f"--{name.replace('_', '-')} {value} is out of range: use {RULES[name][1]}")
    if args.total_timesteps == 0 and not args.load_model:
        fail("--total-timesteps 0 trains nothing: give a budget, or --load-model to evaluate a checkpoint")


def check_memory(nbytes, device, what):
    """One line, before any work, for a buffer that will not fit in the device's free memory."""
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if nbytes > free:
        fail(f"{what} needs {nbytes / 2**30:.1f} GiB and {device.type} has {free / 2**30:.1f} GiB free: make it smaller")


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def load_checkpoint(path, networks, env_id):
    """Load a checkpoint of either script of the pair into `networks` (name -> module). Tensors
    and plain types only (weights_only=True): a checkpoint cannot run code."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for a file that is no checkpoint
        fail(f"cannot load {path!r} ({type(e).__name__}): pass a file written by --save-model of {ALGORITHM}")
    saved = checkpoint.get("algorithm") if isinstance(checkpoint, dict) else None
    if saved != ALGORITHM:
        fail(f"{path!r} is not a {ALGORITHM} checkpoint ({saved or 'unknown'}): pass one saved by {ALGORITHM}")
    try:
        for name, network in networks.items():
            network.load_state_dict(checkpoint["model"][name])
    except (KeyError, RuntimeError):
        hint = f"pass --env-id {checkpoint['env_id']}" if checkpoint["env_id"] != env_id else "use the sizes it was trained with"
        fail(f"{path!r} holds {ALGORITHM} networks for {checkpoint['env_id']} of other sizes: {hint}")


class Run:
    """Around the training loop: the folder runs/<run_name> (TensorBoard events when tensorboard
    is installed, curve.csv, the checkpoint), wandb with --track, the progress bar, steps/s after
    warm-up, SIGTERM handled as Ctrl-C, and the one-line JSON summary. Under torchrun only rank 0
    writes, prints, tracks, saves and evaluates.

    --num-seeds: one Run per seed, each with its own folder, checkpoint and wandb run (one group);
    the first is the `lead` of the others: it alone handles SIGTERM, shows the bar and prints the
    summary, all three for every seed, and finishes last."""

    def __init__(self, args, total_steps, warmup_updates=3, rank=0, lead=None):
        self.args, self.warmup_updates, self.main = args, warmup_updates, rank == 0
        self.lead, self.seeds, self.eval_return = lead or self, [self], None
        if lead:
            lead.seeds.append(self)
        self.time = lead.time if lead else int(time.time())
        self.name = f"{args.env_id}__{args.exp_name}__{args.seed}__{self.time}"
        self.dir = f"runs/{self.name}"
        self.wandb = self.writer = self.last_good = self.stop_reason = self.warmup_s = self.last_sps = None
        self.interrupted, self.returns, self.points = False, deque(maxlen=10), []
        self.step = self.updates = self.warm_step = 0
        self.total_steps, self.bar = total_steps, None
        self.start = self.warm_time = time.perf_counter()
        if not lead:
            signal.signal(signal.SIGTERM, self.on_sigterm)
            sys.excepthook = self.on_uncaught
        if not self.main:
            self.curve = open(os.devnull, "w")
            return
        if args.track:
            try:
                import wandb
            except ImportError:
                fail("--track needs wandb: pip install wandb (or the extra leanrl[track])")
            self.wandb = wandb
        try:
            os.makedirs(self.dir, exist_ok=True)
            self.curve = open(f"{self.dir}/curve.csv", "w")
        except OSError as e:
            fail(f"cannot write {self.dir} ({e.strerror}): run from a folder you can write to")
        self.curve.write("step,seconds,episodic_return\n")
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter

            self.writer, self.summary = SummaryWriter(self.dir), Summary
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
        except ImportError:
            if not lead:
                print("notice: tensorboard is not installed; metrics go to --track only (pip install tensorboard)", file=sys.stderr)
        if self.wandb:
            # Several runs live at once only with reinit="create_new" (wandb 0.19.10 or later).
            seeds = {"group": self.lead.name, "reinit": "create_new"} if getattr(args, "num_seeds", 1) > 1 else {}
            self.wandb = self.wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=self.name, save_code=True, **seeds)

    def on_sigterm(self, signum, frame):
        """Schedulers stop jobs with SIGTERM: end the run as Ctrl-C does, saving first."""
        self.interrupted = signal.SIGTERM
        raise KeyboardInterrupt

    def on_uncaught(self, kind, value, traceback):
        """Ctrl-C or SIGTERM outside the training loop (while envs and networks are made): the
        summary and exit status of an interrupted run, not a traceback. One that lands inside an
        import may come as the cause of another error: Python 3.11 wraps what a `__set_name__`
        raises in a RuntimeError, and building a torch optimizer imports torch._dynamo, which
        runs many."""
        interrupt = value
        while interrupt is not None and not isinstance(interrupt, KeyboardInterrupt):
            interrupt = interrupt.__cause__
        if interrupt is None:
            return sys.__excepthook__(kind, value, traceback)
        self.interrupted = self.interrupted or signal.SIGINT
        try:
            self.finish(self.step, self.updates, {}, None)
        except SystemExit as e:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code)

    def scalars(self, step, values):
        """One point of the charts at `step`, written at the next log point (`write`)."""
        self.points.append((step, values))

    def write(self):
        """The points since the last log point, handed to TensorBoard and wandb at once.
        TensorBoard's writer thread takes the GIL for each event it is handed: one at a time (a
        finished episode every few steps in lean PQN) cost 8% of its steps/s, in one go 3%."""
        # Ctrl-C and SIGTERM wait until the writers are done: a KeyboardInterrupt inside
        # TensorBoard's writer can leave it so that close() hangs (tensorboard 2.21).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for step, values in self.points:
                if self.writer:
                    # One event holds all the values: add_scalar writes one per value, and each
                    # costs about 40 us on a CPU (10 metrics at every log point, 2 per episode).
                    summary = self.summary(value=[self.summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
                    self.writer.file_writer.add_summary(summary, step)
                if self.wandb:
                    self.wandb.log(values, step=step)
            self.points.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def episodes(self, step, infos):
        """CleanRL's charts, one point per finished episode."""
        for _, r, n in self.finished(step, infos):
            self.record(step, r, n)

    @staticmethod
    def finished(step, infos):
        """The episodes that ended in `infos`, as (step, return, length), from gymnasium's episode
        statistics (in infos["final_info"] under SAME_STEP autoreset)."""
        info = infos.get("final_info", infos)
        if "episode" not in info:
            return []
        done = info["_episode"]
        return [(step, float(r), int(n)) for r, n in zip(info["episode"]["r"][done], info["episode"]["l"][done])]

    def record(self, step, r, n):
        self.returns.append(r)
        self.scalars(step, {"charts/episodic_return": r, "charts/episodic_length": n})

    def seed_returns(self):
        """Each seed's mean return over its last 10 episodes (None before its first), in seed order."""
        return [float(np.mean(run.returns)) if run.returns else None for run in self.seeds]

    def sps(self):
        if self.warmup_s is None or self.step <= self.warm_step:
            return None
        return (self.step - self.warm_step) / (time.perf_counter() - self.warm_time)

    def log(self, step, updates, metrics, networks):
        """A log point: steps/s (from the first log point with `warmup_updates` updates done, when
        every compiled callable has run), bar, curve, metrics, and the weights as last good if
        they are finite (with --save-model)."""
        self.bar = self.bar or tqdm.tqdm(total=self.total_steps * len(self.seeds), file=sys.stderr, disable=not self.main or self.lead is not self)
        self.bar.update((step - self.step) * len(self.seeds))
        self.step, self.updates, now = step, updates, time.perf_counter()
        if self.warmup_s is None and updates >= self.warmup_updates:
            self.warmup_s, self.warm_step, self.warm_time = now - self.start, step, now
        # The summary's steps/s is the last log point's: closing envs and saving are not training.
        sps = self.last_sps = self.sps()
        mean_return = np.mean(self.returns) if self.returns else float("nan")
        means = [m for m in self.seed_returns() if m is not None]
        self.bar.set_description(f"sps={(sps or float('nan')) * len(self.seeds):6.0f} return={np.mean(means) if means else float('nan'):8.2f}")
        if self.returns:
            self.curve.write(f"{step},{now - self.start:.3f},{mean_return:.3f}\n")
        self.scalars(step, {**metrics, "charts/SPS": sps or 0.0})
        self.write()
        if self.args.save_model:
            state = {name: {k: v.detach().clone() for k, v in net.state_dict().items()} for name, net in networks.items()}
            if torch.stack([v.isfinite().all() for sd in state.values() for v in sd.values()]).all():
                self.last_good = state

    def finish(self, step, updates, networks, evaluate, **fields):
        """Save, evaluate, close and print the summary. Exit 1 after a non-finite loss, 130 after
        Ctrl-C, 143 after SIGTERM; a checkpoint is only ever saved from finite weights."""
        self.step, self.updates = step, updates
        end_sps, wall_s = self.last_sps, time.perf_counter() - self.start
        # A second Ctrl-C or SIGTERM must not break the save or the summary (evaluation aside).
        handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.bar:
            self.bar.close()
        if self.interrupted and self.main and self.lead is self:
            print(f"notice: interrupted at step {self.step}; saving what there is", file=sys.stderr)
        checkpoint, state = None, self.last_good
        if self.args.save_model and self.main and networks:
            current = {name: net.state_dict() for name, net in networks.items()}
            if self.stop_reason is None and all(v.isfinite().all() for sd in current.values() for v in sd.values()):
                state = current
            if state is None:
                print("notice: the weights were never finite at a log point; no checkpoint saved", file=sys.stderr)
            else:
                # A copy: a seed's weights are a view of all seeds' storage, which torch.save writes whole.
                model = {name: {k: v.detach().to("cpu", copy=True) for k, v in sd.items()} for name, sd in state.items()}
                saved = {"algorithm": ALGORITHM, "env_id": self.args.env_id, "args": vars(self.args), "model": model}
                checkpoint = atomic_save(saved, f"{self.dir}/{self.args.exp_name}.pt")
                print(f"notice: model saved to {checkpoint}", file=sys.stderr)
        eval_return = None
        if self.args.eval_episodes > 0 and self.main and self.stop_reason is None and not (self.interrupted or self.lead.interrupted):
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
            try:
                eval_return = evaluate()
            except KeyboardInterrupt:
                self.interrupted = self.interrupted or signal.SIGINT
                self.lead.interrupted = self.lead.interrupted or self.interrupted
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.curve.close()
        self.write()
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()
        self.eval_return = eval_return
        if self.lead is not self:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
            return
        returns, evals = self.seed_returns(), [run.eval_return for run in self.seeds]
        found = [m for m in returns if m is not None]
        per_seed = {"episodic_returns": [None if m is None else round(m, 3) for m in returns],
                    "eval_returns": [None if m is None else round(m, 3) for m in evals]}
        summary = {
            "script": os.path.basename(__file__), "env_id": self.args.env_id, "seed": self.args.seed, "num_seeds": len(self.seeds),
            "compile": getattr(self.args, "compile", False), "cudagraphs": False, **fields,
            "total_steps": self.step, "updates": self.updates, "wall_s": wall_s, "sps": end_sps and end_sps * len(self.seeds),
            "warmup_s": self.warmup_s, "episodic_return": np.mean(found) if found else None,
            **(per_seed if len(self.seeds) > 1 else {}),
            "eval_return": np.mean(evals) if None not in evals else None, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "interrupted": bool(self.interrupted), "checkpoint": checkpoint, "run_dir": self.dir,
        }
        # Strict JSON: non-finite numbers become null.
        summary = {k: (round(float(v), 3) if math.isfinite(v) else None) if isinstance(v, (float, np.floating)) else v for k, v in summary.items()}
        if self.main:
            print(json.dumps(summary), flush=True)
        if self.stop_reason:
            print(f"error: {self.stop_reason}", file=sys.stderr)
            sys.exit(1)
        if self.interrupted:
            sys.exit(143 if self.interrupted == signal.SIGTERM else 130)


def main(args: Args):
    check_args(args)
    batch_size = args.num_envs * args.num_steps
    if args.total_timesteps < batch_size and not (args.total_timesteps == 0 and args.load_model):
        fail(f"--total-timesteps {args.total_timesteps} is less than one batch (num_envs * num_steps = {batch_size}): give at least {batch_size}")
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch_size} (num_envs * num_steps): pass a divisor of it")
    if not 0 <= args.q_lambda <= 1:
        fail(f"--q-lambda {args.q_lambda} is out of range: use a number in [0, 1]")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    run = Run(args, num_iterations * batch_size)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = make_envs(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run.name}")
    obs_shape = envs.single_observation_space.shape
    n_act = envs.single_action_space.n

    q_network = QNetwork(n_act, device=device)
    if args.load_model:
        load_checkpoint(args.load_model, {"q_network": q_network}, args.env_id)
    optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate)

    # Frames stay uint8 (a quarter of the memory); the network divides them by 255.
    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    terminations = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    valid = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = updates = 0
    epsilon, lr_now = args.start_e, args.learning_rate
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
                optimizer.param_groups[0]["lr"] = lr_now

            for step in range(0, args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                # envpool autoresets on the NEXT step: the step that ends an episode returns its
                # last frame, and the following step ignores its action, resets that env and
                # returns reward 0 with the first frame of the next episode. Such a reset step is
                # no transition of the game: the loss leaves it out (valid 0).
                valid[step] = 1.0 - next_done

                epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
                random_actions = torch.randint(0, n_act, (args.num_envs,)).to(device)
                with torch.no_grad():
                    q_values = q_network(next_obs)
                    max_actions = torch.argmax(q_values, dim=1)
                    values[step] = q_values[torch.arange(args.num_envs), max_actions]
                explore = torch.rand((args.num_envs,)).to(device) < epsilon
                action = torch.where(explore, random_actions, max_actions)
                actions[step] = action

                next_obs, reward, termination, truncation, infos = envs.step(action.cpu().numpy())
                next_done = torch.Tensor(np.logical_or(termination, truncation)).to(device)
                rewards[step] = torch.tensor(reward).to(device).view(-1)
                terminations[step] = torch.Tensor(termination).to(device)
                dones[step] = next_done
                next_obs = torch.as_tensor(next_obs).to(device)
                run.episodes(global_step, infos)

            # Q(lambda) returns. Two corrections to CleanRL's loop: at an episode's end (a lost
            # life) the lambda-weighted return of the next step (another episode's) is cut off as
            # well as the bootstrap, and a time-limit truncation bootstraps from max Q of the last
            # frame (values[t + 1]: envpool returns it at the step that ends the episode) where
            # CleanRL treats it as a termination.
            with torch.no_grad():
                next_value = q_network(next_obs).max(dim=1).values
                returns = torch.zeros_like(rewards).to(device)
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        next_q, next_return = next_value, next_value
                    else:
                        next_q, next_return = values[t + 1], returns[t + 1]
                    next_return = torch.where(dones[t].bool(), next_q, next_return)
                    returns[t] = rewards[t] + args.gamma * (1.0 - terminations[t]) * (
                        args.q_lambda * next_return + (1 - args.q_lambda) * next_q
                    )

            b_obs = obs.reshape((-1,) + obs_shape)
            b_actions = actions.reshape(-1)
            b_returns = returns.reshape(-1)
            b_valid = valid.reshape(-1)

            b_inds = np.arange(batch_size)
            for epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    end = start + minibatch_size
                    mb_inds = b_inds[start:end]
                    mb_valid = b_valid[mb_inds]
                    n_valid = mb_valid.sum().clamp(min=1)

                    old_val = q_network(b_obs[mb_inds]).gather(1, b_actions[mb_inds].unsqueeze(1)).squeeze(1)
                    # F.mse_loss over the valid steps only
                    loss = ((b_returns[mb_inds] - old_val) ** 2 * mb_valid).sum() / n_valid

                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
                    optimizer.step()
                    updates += 1

            # As CleanRL: the last minibatch's loss and Q-values (over its valid steps).
            stats = {"losses/td_loss": loss.item(), "losses/q_values": ((old_val * mb_valid).sum() / n_valid).item()}
            if not math.isfinite(stats["losses/td_loss"]):
                run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
                break
            metrics = {"charts/learning_rate": lr_now, **stats, "charts/epsilon": epsilon}
            run.log(global_step, updates, metrics, {"q_network": q_network})
    except KeyboardInterrupt:
        run.interrupted = run.interrupted or signal.SIGINT
    envs.close()
    run.finish(global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, run.name, device), device=device.type)


if __name__ == "__main__":
    main(tyro.cli(Args))

"""DQN on Atari through envpool, plain PyTorch in the CleanRL style: the baseline.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the details
and defaults of CleanRL's `dqn_atari.py`: the Nature CNN, a replay buffer of a million
transitions, a target network copied every 1,000 steps and epsilon-greedy exploration decaying
over the first 10% of the budget. The games run in envpool (Weng et al., 2022) with its Atari
preprocessing: 84x84 grey frames stacked by 4, frame skip 4, up to 30 no-ops and FIRE at reset,
episodic life and clipped rewards for learning; the reported returns are whole games, unclipped.
The replay buffer stores each frame once (a million stacks of 4 would take 56 GB as obs and
next_obs; a million frames take 7 GB) and rebuilds the stacks when it samples. The lean script
`dqn_atari_envpool_torchcompile.py` learns the same way, faster; this file is what its speed-ups
are measured against.

    python leanrl/dqn_atari_envpool.py
    python leanrl/dqn_atari_envpool.py --env-id Pong-v5
"""

import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from leanrl_utils import Run, checks, cli, fail, resume, vector


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
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 1000
    """the timesteps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 80_000
    """timestep to start learning"""
    train_frequency: int = 4
    """the frequency of training"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed from step - n to step (n: num_envs)."""
    return step // every - (step - n) // every


class QNetwork(nn.Module):
    """The Nature CNN (Mnih et al., 2015) on frames scaled to [0, 1]."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4, device=device),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2, device=device),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1, device=device),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512, device=device),
            nn.ReLU(),
            nn.Linear(512, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x / 255.0)


# Per transition: its newest 84x84 frame, an int64 action, float32 reward and done, two flags.
ROW_BYTES = 84 * 84 + 8 + 4 + 4 + 2


class ReplayBuffer:
    """Transitions of envpool's stacked Atari frames, each frame stored once, in numpy on the host.

    Row t of env i holds the step that acted on observation t: the newest frame of its stack,
    the action, reward and done flag, and whether the stack began a game (`first`). Envpool
    pushes one frame per step on its stack of 4, and at a game's reset fills all 4 with the
    first frame; so the stack of row t is rows t-3 .. t, except that a row with `first` set
    replaces the rows before it. The next observation of row t is row t + 1's stack. The
    rows of all envs are interleaved: one ring row holds one vector step.

    Never sampled: envpool's reset steps (`skip`: the step after an episode's end ignores its
    action and returns the next episode's first frames, no transition of the game), the newest
    row (its next frame is not held yet) and, once the ring wraps, the 3 oldest rows (their
    stacks reach rows already overwritten)."""

    def __init__(self, buffer_size, num_envs):
        self.buffer_size = buffer_size // num_envs  # rows of the ring, one vector step each
        checks.memory(self.buffer_size * num_envs * ROW_BYTES, torch.device("cpu"), f"--buffer-size {buffer_size}")
        self.frames = np.zeros((self.buffer_size, num_envs, 84, 84), dtype=np.uint8)
        self.first = np.zeros((self.buffer_size, num_envs), dtype=bool)
        self.skip = np.zeros((self.buffer_size, num_envs), dtype=bool)
        self.actions = np.zeros((self.buffer_size, num_envs), dtype=np.int64)
        self.rewards = np.zeros((self.buffer_size, num_envs), dtype=np.float32)
        self.dones = np.zeros((self.buffer_size, num_envs), dtype=np.float32)
        self.num_envs, self.pos, self.size = num_envs, 0, 0

    def add(self, obs, actions, rewards, dones, skip):
        """One vector step: `obs` the stacks [num_envs, 4, 84, 84] the step acted on."""
        self.frames[self.pos] = obs[:, -1]
        # A stack whose 4 frames are equal began here (or its older frames equal this one anyway).
        self.first[self.pos] = (obs[:, :-1] == obs[:, -1:]).all(axis=(1, 2, 3))
        self.skip[self.pos] = skip
        self.actions[self.pos] = actions
        self.rewards[self.pos] = rewards
        self.dones[self.pos] = dones
        self.pos = (self.pos + 1) % self.buffer_size
        self.size = min(self.size + 1, self.buffer_size)

    def stacks(self, rows, envs):
        """The 4-frame stacks that rows `rows` of envs `envs` observed, [len(rows), 4, 84, 84]."""
        held = [rows]
        for _ in range(3):
            newer = held[0]
            held.insert(0, np.where(self.first[newer, envs], newer, (newer - 1) % self.buffer_size))
        return np.stack([self.frames[r, envs] for r in held], axis=1)

    def sample(self, batch_size, device):
        oldest = self.pos if self.size == self.buffer_size else 0
        low = 3 if self.size == self.buffer_size else 0
        ages = np.random.randint(0, self.size - 1 - low, size=batch_size) + low
        envs = np.random.randint(0, self.num_envs, size=batch_size)
        rows = (oldest + ages) % self.buffer_size
        while (bad := self.skip[rows, envs]).any():  # draw again, so the batch is uniform over transitions
            ages[bad] = np.random.randint(0, self.size - 1 - low, size=bad.sum()) + low
            envs[bad] = np.random.randint(0, self.num_envs, size=bad.sum())
            rows = (oldest + ages) % self.buffer_size
        obs, next_obs = self.stacks(rows, envs), self.stacks((rows + 1) % self.buffer_size, envs)
        data = (obs, self.actions[rows, envs, None], next_obs, self.dones[rows, envs, None], self.rewards[rows, envs, None])
        return tuple(torch.as_tensor(x, device=device) for x in data)


def evaluate(q_network, args, run_name, device):
    """Mean whole-game return of the greedy policy over `eval_episodes` games. Episodic life stays
    on, so that envpool presses FIRE after each lost life (a greedy policy may never do it); a
    game that never ends is cut by envpool's own limit of 27,000 steps."""
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
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}: make the buffer hold a batch")
    if args.buffer_size < 8 * args.num_envs:
        fail(f"--buffer-size {args.buffer_size} holds no whole frame stack of each env: give at least {8 * args.num_envs}")
    if args.learning_starts < args.num_envs:
        fail(f"--learning-starts {args.learning_starts} comes before any whole transition: give at least {args.num_envs}")
    num_iterations = args.total_timesteps // args.num_envs
    rb = ReplayBuffer(args.buffer_size, args.num_envs)  # refuses a buffer that does not fit, before any work
    run = Run(args, num_iterations * args.num_envs, __file__, resumed)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    envs = vector.envpool_envs(args.env_id, args.num_envs, args.seed, args.capture_video, f"videos/{run.name}")
    n_act = int(envs.single_action_space.n)

    q_network = QNetwork(n_act, device=device)
    if args.load_model:
        run.load({"q_network": q_network})
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(n_act, device=device)
    target_network.load_state_dict(q_network.state_dict())

    global_step = updates = 0
    loss = old_val = None
    obs, _ = envs.reset()
    reset_step = np.zeros(args.num_envs, dtype=bool)
    # envpool's games cannot be saved: a resumed run starts fresh games, so the last transition
    # held (whose next frames would be the new game's) is never sampled.
    objects = {"q_network": q_network, "target_network": target_network, "optimizer": optimizer, "rb": rb}
    global_step, updates, loss, old_val = run.resume(objects, lambda: (global_step, updates, loss, old_val), device)
    if resumed:
        rb.skip[(rb.pos - 1) % rb.buffer_size] = True
    for iteration in range(global_step // args.num_envs, num_iterations):
        if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
            break
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
        # One coin per env, so that several envs explore as one env would.
        explore = np.random.random(args.num_envs) < epsilon
        actions = np.random.randint(n_act, size=args.num_envs)
        if not explore.all():
            q_values = q_network(torch.as_tensor(obs, device=device))
            actions = np.where(explore, actions, torch.argmax(q_values, dim=1).cpu().numpy())

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        global_step += args.num_envs
        run.episodes(global_step, infos)

        # envpool autoresets on the NEXT step: the step that ends an episode returns its last
        # frame (so a truncation bootstraps from it: the done flag is the termination only),
        # and the following step ignores its action and returns the next episode's first
        # frame. That reset step is no transition of the game: the buffer never samples it.
        rb.add(obs, actions, rewards, terminations, reset_step)
        reset_step = terminations | truncations
        obs = next_obs

        if global_step > args.learning_starts:
            for _ in range(multiples_passed(global_step, args.num_envs, args.train_frequency)):
                data_obs, data_actions, data_next_obs, data_dones, data_rewards = rb.sample(args.batch_size, device)
                with torch.no_grad():
                    target_max, _ = target_network(data_next_obs).max(dim=1)
                    td_target = data_rewards.flatten() + args.gamma * target_max * (1 - data_dones.flatten())
                old_val = q_network(data_obs).gather(1, data_actions).squeeze(1)
                loss = F.mse_loss(td_target, old_val)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1

            if multiples_passed(global_step, args.num_envs, args.target_network_frequency):
                for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                    target_network_param.data.copy_(
                        args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data
                    )

        if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
            stats = {"losses/td_loss": loss.item(), "losses/q_values": old_val.mean().item()} if loss is not None else {}
            if stats and not math.isfinite(stats["losses/td_loss"]):
                run.stop_reason = f"non-finite td_loss {stats['losses/td_loss']} at step {global_step}"
                break
            run.log(global_step, updates, {**stats, "charts/epsilon": epsilon}, {"q_network": q_network})
    envs.close()
    run.finish(
        global_step, updates, {"q_network": q_network}, lambda: evaluate(q_network, args, run.name, device), device=device.type
    )


if __name__ == "__main__":
    main(cli(Args))

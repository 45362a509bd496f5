"""DQN on Atari through envpool, lean: torch.compile, CUDA graphs and tensordict.

Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236) with the Nature
CNN on envpool's Atari games (Weng et al., 2022), learning as the plain `dqn_atari_envpool.py`
(CleanRL's `dqn_atari.py`) does, faster: the replay buffer stores each frame once on the training
device and the update rebuilds the frame stacks it samples, in the one graph that compiles with
the loss, backward and optimizers.Adam; exploration is drawn in blocks; acting runs only on steps where
some env acts greedily; nothing syncs the host with the device between two log points but the
greedy actions the env needs.

    python leanrl/dqn_atari_envpool_torchcompile.py
    python leanrl/dqn_atari_envpool_torchcompile.py --compile
    python leanrl/dqn_atari_envpool_torchcompile.py --compile --cudagraphs

`--num-seeds N` trains seeds seed ... seed+N-1 at once, stacked on a leading dimension (one seed is
a stack of one) and sharing one random stream, so seed k is not bit-identical to a run of seed+k.
"""

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from tensordict.nn import CudaGraphModule

from leanrl_utils import acting, checks, cli, fail, optimizers, resume, seeds, speed, vector
from leanrl_utils.buffers import ReplayBuffer


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
    num_seeds: int = 1
    """independent agents trained at once, seeds `seed` to `seed + num-seeds - 1` (`total-timesteps` each)"""

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

    # speed
    compile: bool = False
    """whether to use torch.compile on the hot callables"""
    cudagraphs: bool = False
    """whether to replay the hot callables as CUDA graphs (needs a CUDA device)"""
    threads: int = 1
    """intra-op threads on a CPU (one wins beside any other process)"""


# Losses and the progress bar are logged every LOG_EVERY environment steps, as in CleanRL.
LOG_EVERY = 100


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


def frame_stacks(frames, first, rows, cols):
    """The 4-frame stacks that rows `rows` of columns `cols` observed (any shape, [..., 4, 84, 84]):
    each older frame is the row before, unless the newer row began a game."""
    held = [rows]
    for _ in range(3):
        newer = held[0]
        held.insert(0, torch.where(first[newer, cols], newer, (newer - 1) % len(frames)))
    return torch.stack([frames[r, cols] for r in held], dim=-3)


def make_update(q_network, target_params, optimizer, storage, gamma, num_seeds):
    """One gradient step of every seed, one graph, on the transitions at rows and columns `idx`
    ([2, seeds * batch], block k seed k's) of the frame storage: it rebuilds each obs and next_obs
    stack from the stored frames (`frame_stacks`), then the TD loss, its gradient (torch.func; the
    summed losses, so each seed steps on its own) and optimizers.Adam. Returns [len(METRICS), seeds] on the device."""
    forward = seeds.forward(q_network)
    frames, first = storage["frames"], storage["first"]
    buffer_rows = len(frames)

    def td_loss(params, obs, actions, td_target):
        old_val = forward(params, obs).gather(2, actions.unsqueeze(2)).squeeze(2)
        losses = (td_target - old_val).square().mean(dim=1)
        return losses.sum(), (losses, old_val)

    def update(idx):
        rows, cols = idx.view(2, num_seeds, -1).unbind(0)
        obs, next_obs = frame_stacks(frames, first, rows, cols), frame_stacks(frames, first, (rows + 1) % buffer_rows, cols)
        with torch.no_grad():
            target_max = forward(target_params, next_obs).max(dim=2).values
            td_target = storage["rewards"][rows, cols] + gamma * target_max * (1 - storage["dones"][rows, cols])
        grad_and_loss = torch.func.grad_and_value(td_loss, has_aux=True)
        grads, (_, (losses, old_val)) = grad_and_loss(optimizer.params, obs, storage["actions"][rows, cols], td_target)
        optimizer.step(grads)
        return torch.stack([losses, old_val.mean(dim=1)]).detach()

    return update


METRICS = ["losses/td_loss", "losses/q_values"]


# Per transition: its newest 84x84 frame, an int64 action, float32 reward and done, two flags.
ROW_BYTES = 84 * 84 + 8 + 4 + 4 + 2


class FrameReplay(ReplayBuffer):
    """The plain script's frame buffer (see its ReplayBuffer) on the training device: row t of
    column j (env i of seed k: j = k * num_envs + i) holds the newest frame of the stack that
    step t acted on, `first` where that stack began a game, and the step's action, reward and
    done; the update rebuilds the stacks (`make_update`). The host keeps `skip` (envpool's reset
    steps) and draws the rows, so that the batch is uniform over the transitions held."""

    def __init__(self, buffer_size, num_envs, num_seeds, stage_rows, device):
        cols = num_seeds * num_envs
        fields = {
            "frames": ((cols, 84, 84), torch.uint8),
            "first": ((cols,), torch.bool),
            "actions": ((cols,), torch.int64),
            "rewards": ((cols,), torch.float32),
            "dones": ((cols,), torch.float32),
        }
        super().__init__(buffer_size // num_envs, fields, stage_rows, device)
        self.skip = np.zeros((self.buffer_size, cols), dtype=bool)
        self.num_envs, self.num_seeds = num_envs, num_seeds

    def add(self, obs, actions, rewards, dones, skip):
        """One vector step: `obs` the stacks [seeds * envs, 4, 84, 84] the step acted on."""
        self.skip[(self.pos + self.pending) % self.buffer_size] = skip
        first = (obs[:, :-1] == obs[:, -1:]).all(axis=(1, 2, 3))
        super().add(frames=obs[:, -1], first=first, actions=actions, rewards=rewards, dones=dones)

    def sample(self, batch_size):
        """Rows and columns of `batch_size` transitions per seed, [2, seeds * batch_size] (seed k's
        in block k), drawn on the host as the plain script draws them, then sent to the device."""
        self.flush()
        wrapped = self.size == self.buffer_size
        oldest, low = (self.pos, 3) if wrapped else (0, 0)
        n = self.num_seeds * batch_size
        seed_cols = self.num_envs * torch.arange(self.num_seeds).repeat_interleave(batch_size)
        ages = torch.randint(self.size - 1 - low, (n,)) + low
        envs = torch.randint(self.num_envs, (n,))
        rows, skip = (oldest + ages) % self.buffer_size, torch.from_numpy(self.skip)
        while (bad := skip[rows, seed_cols + envs]).any():
            ages[bad] = torch.randint(self.size - 1 - low, (int(bad.sum()),)) + low
            envs[bad] = torch.randint(self.num_envs, (int(bad.sum()),))
            rows = (oldest + ages) % self.buffer_size
        return torch.stack([rows, seed_cols + envs]).to(self.device)


def draw_exploration(epsilons, num_envs, n_act, device):
    """Epsilon-greedy's draws for a block of steps, [num_steps, num_envs]: whether each env explores
    and the random action it would take. Two ops per block, not two per step."""
    explore = torch.rand(len(epsilons), num_envs, device=device) < torch.tensor(epsilons, device=device).unsqueeze(1)
    return explore, torch.randint(n_act, (len(epsilons), num_envs), device=device)


def make_policy(q_network, params, num_seeds):
    """The greedy action for frame stacks [seeds * envs, 4, 84, 84] (seed k's envs in block k) under
    each seed's network, derived from `q_network` (`seeds.forward`; convolutions have no numpy form)."""
    forward = seeds.forward(q_network)
    return lambda obs: forward(params, obs.view(num_seeds, -1, *obs.shape[1:])).argmax(dim=2).flatten()


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon at step t: from start_e to end_e linearly over `duration` steps, then flat."""
    if duration <= 0:
        return end_e
    return start_e + (end_e - start_e) * min(t / duration, 1.0)


def multiples_passed(step: int, n: int, every: int) -> int:
    """How many multiples of `every` the step counter passed from step - n to step (n: num_envs)."""
    return step // every - (step - n) // every


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
    num_seeds, num_iterations = args.num_seeds, args.total_timesteps // args.num_envs
    device, cudagraphs = speed.setup(args)
    # One line before any game is made: the buffer holds every seed's frames.
    per_seed = f"--num-seeds {num_seeds} with " if num_seeds > 1 else ""
    nbytes = num_seeds * (args.buffer_size // args.num_envs) * args.num_envs * ROW_BYTES
    checks.memory(nbytes, device, f"{per_seed}--buffer-size {args.buffer_size}")
    runs = seeds.runs(args, num_iterations * args.num_envs, __file__, resumed)
    run = runs[0]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # Sub-env k * num_envs + i is env i of seed k; envpool seeds it with seed + k * num_envs + i.
    envs = vector.envpool_envs(args.env_id, num_seeds * args.num_envs, args.seed, args.capture_video, f"videos/{run.name}")
    n_act = int(envs.single_action_space.n)

    q_networks = [QNetwork(n_act, device=device)]
    QNetwork(n_act, device=device)  # the plain script's target network: its draws keep the two scripts' streams together
    for k in range(1, num_seeds):
        torch.manual_seed(args.seed + k)  # seed k starts from the weights a single run of seed + k starts from
        q_networks.append(QNetwork(n_act, device=device))
    for q_network in q_networks if args.load_model else []:
        run.load({"q_network": q_network})
    q_params = seeds.stack(q_networks)
    networks = [{"q_network": net} for net in q_networks]  # what each seed's Run logs and saves
    target_params = q_params.clone()

    # Blocks of train_frequency steps (whole vector steps) go to the device at once.
    stage_steps = max(1, -(-args.train_frequency // args.num_envs))
    rb = FrameReplay(args.buffer_size, args.num_envs, num_seeds, stage_steps, device)

    # On CUDA, optimizers.Adam's step counts live on the device (capturable), so the update never syncs.
    optimizer = optimizers.Adam(q_params.items(), args.learning_rate, capturable=device.type == "cuda")
    update = make_update(q_networks[0], dict(target_params.items()), optimizer, rb.storage, args.gamma, num_seeds)
    policy = make_policy(q_networks[0], dict(q_params.items()), num_seeds)
    # --compile: the update, one graph (the stacks' gathers, loss, backward and optimizers.Adam around the
    # convolutions, which inductor leaves to cuDNN or oneDNN); the policy on CUDA only: on a CPU its
    # convolutions are nearly all of its time.
    if args.compile:
        update = torch.compile(update, options={"guard_filter_fn": speed.value_guards, "cpp_wrapper": device.type == "cpu"})
        if device.type == "cuda":
            policy = torch.compile(policy, options={"guard_filter_fn": speed.value_guards})
        # A stop signal ends their cold compile at once; the loop goes on eagerly to its checkpoint.
        update, policy = speed.interruptible(run, update, policy)
    if cudagraphs:
        update, policy = CudaGraphModule(update), CudaGraphModule(policy)
    policy = acting.host_arrays(policy, device)

    global_step = updates = 0
    metrics, epsilon = None, args.start_e
    draw_steps = 256  # exploration is drawn for this many vector steps at once
    obs, _ = envs.reset()
    reset_step = np.zeros(num_seeds * args.num_envs, dtype=bool)
    explore = random_actions = epsilons = None
    # envpool's games cannot be saved: a resumed run starts fresh games, so the last transition
    # held (whose next frames would be the new game's) is never sampled.
    objects = {"q_params": q_params, "target_params": target_params, "optimizer": optimizer, "rb": rb}
    loop = lambda: (global_step, updates, metrics, epsilon, explore, random_actions, epsilons)
    global_step, updates, metrics, epsilon, explore, random_actions, epsilons = run.resume(objects, loop, device)
    if resumed:
        rb.skip[(rb.pos - 1) % rb.buffer_size] = True
    # Gradients come from torch.func inside the update, which this context does not reach.
    with torch.no_grad():
        for iteration in range(global_step // args.num_envs, num_iterations):
            if run.checkpoint(iteration):  # a stop signal, or --checkpoint-every: resume.pt
                break
            step = iteration % draw_steps
            if step == 0:
                # Drawn on the host, where the env is: a step where every env explores skips the network.
                duration = args.exploration_fraction * args.total_timesteps
                block = range(global_step, global_step + args.num_envs * draw_steps, args.num_envs)
                epsilons = [linear_schedule(args.start_e, args.end_e, duration, t) for t in block]
                draws = draw_exploration(epsilons, num_seeds * args.num_envs, n_act, "cpu")
                explore, random_actions = (x.numpy() for x in draws)
            epsilon, actions = epsilons[step], random_actions[step]
            if not explore[step].all():
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                actions = np.where(explore[step], actions, policy(obs))
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            global_step += args.num_envs
            seeds.episodes(runs, global_step, infos, args.num_envs)

            # envpool's reset steps are never sampled (see the plain script's loop); the done
            # flag is the termination only: a truncation bootstraps from the last frame.
            rb.add(obs, actions, rewards, terminations, reset_step)
            reset_step = terminations | truncations
            obs = next_obs

            if global_step > args.learning_starts:
                for _ in range(multiples_passed(global_step, args.num_envs, args.train_frequency)):
                    idx = rb.sample(args.batch_size)
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    # The graphed output is overwritten by the next call; only the latest is read.
                    metrics = update(idx)
                    updates += 1
                if multiples_passed(global_step, args.num_envs, args.target_network_frequency):
                    target_params.lerp_(q_params, args.tau)

            if multiples_passed(global_step, args.num_envs, LOG_EVERY) or iteration == num_iterations - 1:
                # note: a host sync, at the log points only
                if not seeds.log(runs, global_step, updates, metrics, METRICS, networks, **{"charts/epsilon": epsilon}):
                    break
    envs.close()
    evaluate_seed = lambda nets, seed_args, name: evaluate(nets["q_network"], seed_args, name, device)
    seeds.finish(runs, global_step, updates, networks, evaluate_seed, device=device.type, cudagraphs=cudagraphs)


if __name__ == "__main__":
    main(cli(Args))

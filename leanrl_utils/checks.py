"""The flags parsed (`cli`), and bad input refused before any work in one `error:` line naming the flag
and what would work: the rules, the budget, the env, memory, open files."""

import math
import os
import signal
import sys
import time

import psutil
import torch
import tyro

try:  # POSIX only (Windows has no file limit to check)
    import resource
except ImportError:
    resource = None

# One rule per flag, the same in every script that has the flag.
COUNTS = (
    "num_seeds", "threads", "num_envs", "num_steps", "num_minibatches", "update_epochs", "batch_size",
    "buffer_size", "train_frequency", "target_network_frequency", "policy_frequency",
)  # fmt: skip
RULES = {
    **{k: (lambda v: v >= 0, "0 or more") for k in ("total_timesteps", "learning_starts", "eval_episodes")},
    **{k: (lambda v: v >= 1, "1 or more") for k in COUNTS},
    **{
        k: (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
        for k in ("learning_rate", "q_lr", "policy_lr", "max_grad_norm", "dist_timeout")
    },
    **{k: (lambda v: 0 < v <= 1, "a number in (0, 1]") for k in ("gamma", "tau")},
    **{
        k: (lambda v: 0 <= v <= 1, "a number in [0, 1]")
        for k in ("gae_lambda", "q_lambda", "start_e", "end_e", "exploration_fraction")
    },
    **{
        k: (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
        for k in ("clip_coef", "ent_coef", "vf_coef", "alpha", "policy_noise", "noise_clip", "exploration_noise")
    },
    "target_kl": (lambda v: v is None or (math.isfinite(v) and v > 0), "a finite number > 0"),
    "checkpoint_every": (lambda v: math.isfinite(v) and v >= 0, "a finite number of seconds >= 0 (0: off)"),
}

# How long a silent rank waits for LOCAL_RANK 0 to fail the same input (see `fail`).
RANK_0_GRACE_S = 20
# Files a seed's run folder holds open (curve.csv, TensorBoard's events, wandb's), with room to spare.
FILES_PER_SEED = 4


def fail(message, every_rank=False):
    """One line on stderr, exit status 2. Under torchrun LOCAL_RANK 0 speaks (unless `every_rank`: a
    failure of this rank's own) and the others wait for torchrun to end them."""
    speaks = every_rank or os.environ.get("WORLD_SIZE", "1") == "1" or os.environ.get("LOCAL_RANK", "0") == "0"
    if speaks:
        sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a stderr cannot split it
        sys.exit(2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun ends every rank once one exits
    time.sleep(RANK_0_GRACE_S)
    sys.exit(2)


def cli(args_type):
    """tyro's flags; Ctrl-C from here until a Run exists is one line and exit 130, not a traceback."""

    def before_the_run(signum, frame):
        if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun, one line for all ranks
            sys.stderr.write("notice: interrupted before the run started; nothing to save\n")
        os._exit(130)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell ignores it
        signal.signal(signal.SIGINT, before_the_run)
    return tyro.cli(args_type)


def flags(args, atari=False):
    """The flags' rules, the budget and the env (`atari`: an envpool game), before any work."""
    from leanrl_utils.vector import check_env

    for name, value in vars(args).items():
        if name in RULES and not RULES[name][0](value):
            fail(f"--{name.replace('_', '-')} {value} is out of range: use {RULES[name][1]}")
    if args.total_timesteps == 0 and not (args.load_model and args.eval_episodes > 0):
        fail(
            "--total-timesteps 0 trains nothing and only evaluates: pass --load-model PATH and --eval-episodes N, or a budget"
        )
    budget(args)
    num_seeds = getattr(args, "num_seeds", 1)
    # Every seed a run derives stays in envpool's int32 range: one per process (torchrun: seed +
    # rank), per env of every seed, and evaluation's seed + 10000.
    world_size = os.environ.get("WORLD_SIZE", "1")
    world_size = int(world_size) if world_size.isdigit() else 1
    num_envs = getattr(args, "num_envs", 1)
    limit = 2**31 - world_size - num_seeds * num_envs - 10_000
    seeds = f"--num-seeds {num_seeds} x " if hasattr(args, "num_seeds") else ""
    if limit <= 0:
        fail(f"{seeds}--num-envs {num_envs} envs would take seeds past 2**31: use fewer")
    if not 0 <= args.seed < limit:
        fail(
            f"--seed {args.seed} is out of range: seed + {world_size} processes + {seeds}--num-envs {num_envs} + 10000 "
            f"(evaluation) must stay below 2**31: use a seed in [0, {limit})"
        )
    name = args.exp_name
    if not name or name.startswith(".") or "/" in name or "\\" in name or not name.isprintable():
        fail(f"--exp-name {name!r} is not a plain file name: use letters, digits, '-' or '_' (no separator, no leading dot)")
    check_env(args.env_id, atari, example=getattr(type(args), "env_id", None))


def budget(args):
    """A budget that ends before --learning-starts (a smoke run) trains nothing: said, and True."""
    if not hasattr(args, "learning_starts") or args.total_timesteps == 0:
        return False
    n, starts = args.num_envs, args.learning_starts
    if args.total_timesteps // n * n > starts:  # the loop's last step is the budget's last whole step of every env
        return False
    print(
        f"notice: --total-timesteps {args.total_timesteps} ends before learning starts (--learning-starts {starts}): "
        f"no update will run (give at least {(starts // n + 1) * n} steps to train)",
        file=sys.stderr,
    )
    return True


def open_files(num_seeds):
    """More seeds than the process may hold files open for, before any folder is made."""
    if resource is None or num_seeds == 1:
        return
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    process = psutil.Process()
    needed = FILES_PER_SEED * num_seeds + (process.num_fds() if hasattr(process, "num_fds") else 0) + 64
    if limit != resource.RLIM_INFINITY and needed > limit:
        fail(
            f"--num-seeds {num_seeds} needs about {needed} open files ({FILES_PER_SEED} per seed) and this process "
            f"may open {limit}: use fewer seeds, or raise the limit (ulimit -n)"
        )


def rollout(args, row_bytes, device=None, per_env=0, per_seed=0):
    """Rollout storage that will not fit: `row_bytes` a step of an env, `per_env`, `per_seed` more."""
    device = device or torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    num_seeds = getattr(args, "num_seeds", 1)
    nbytes = num_seeds * (args.num_envs * (args.num_steps * row_bytes + per_env) + per_seed)
    seeds = f" x --num-seeds {num_seeds}" if num_seeds > 1 else ""
    memory(nbytes, device, f"the rollout of --num-steps {args.num_steps} x --num-envs {args.num_envs}{seeds}")


def memory(nbytes, device, what):
    """A buffer that will not fit in the device's free memory, before any work."""
    device = torch.device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if nbytes > free:
        fail(f"{what} needs {nbytes / 2**30:.1f} GiB and {device.type} has {free / 2**30:.1f} GiB free: make it smaller")

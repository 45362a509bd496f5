"""What every LeanRL script needs and no researcher wants to read twice, as CleanRL's scripts import
`cleanrl_utils`: argument rules, the run's folder and metrics, the progress bar, signals,
checkpoints, the summary line, the speed toggles' plumbing, the functional optimizers, seed
stacking, the forms of a network derived from its `nn.Module`, env wrappers and torchrun helpers.
A script copied out of the repository runs wherever this module is installed (`pip install leanrl`).
"""

import functools
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections import deque
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import torch
import torch.nn as nn
import tqdm
from tensordict import from_module
from torch.optim.adam import adam
from torch.optim.radam import radam

try:  # POSIX only: peak memory comes from psutil elsewhere (Windows)
    import resource
except ImportError:
    resource = None


def interrupted_before_the_run(kind, value, traceback, previous=sys.excepthook):
    """Ctrl-C after this module is imported and before a Run exists (parsing or checking flags,
    making a probe env): one line and exit status 130, not a traceback. A Run installs its own
    hook; Ctrl-C while the script imports torch, before this module, still gets Python's."""
    interrupt = value
    while interrupt is not None and not isinstance(interrupt, KeyboardInterrupt):
        interrupt = interrupt.__cause__
    if interrupt is None:
        return previous(kind, value, traceback)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun, one line for all ranks
        sys.stderr.write("notice: interrupted before the run started; nothing to save\n")
        sys.stderr.flush()
    os._exit(130)


sys.excepthook = interrupted_before_the_run

# ---------------------------------------------------------------- ARGUMENTS

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


@dataclass
class Resumable:
    """The flags of preemption-safe runs, shared by every script's Args (`class Args(Resumable)`)."""

    resume: str | None = None
    """a run folder (or its resume.pt) to continue where it stopped, with the same flags"""
    checkpoint_every: float = 0.0
    """seconds between resumable checkpoints (runs/{run_name}/resume.pt; 0: only when stopped)"""


# How long a silent rank waits for LOCAL_RANK 0 to fail the same input (see `fail`).
RANK_0_GRACE_S = 20


def fail(message, every_rank=False):
    """Bad input ends the run with one line on stderr and exit status 2, never a traceback. Under
    torchrun only LOCAL_RANK 0 says why (every rank fails the same input), unless `every_rank`: a
    failure of this rank's own; a silent rank waits for torchrun to end it once rank 0 has spoken
    and exited. A run folder made for a run refused before its first log point goes too."""
    speaks = every_rank or os.environ.get("WORLD_SIZE", "1") == "1" or os.environ.get("LOCAL_RANK", "0") == "0"
    if speaks:
        sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a stderr cannot split it
    for run in list(FRESH_RUNS):
        run.discard()
    if not speaks:  # torchrun ends every rank once one exits: rank 0 must get its line out first
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(RANK_0_GRACE_S)
    sys.exit(2)


# Files a seed's run folder holds open (curve.csv, TensorBoard's events, wandb's), with room to spare.
FILES_PER_SEED = 4


def check_args(args, atari=False):
    """The flags' rules, the budget and the env (`atari`: an envpool game), before any work."""
    if getattr(args, "resume", None):  # flags not given take the checkpoint's values, before any rule
        resolve_resume(args, sys._getframe(1).f_globals.get("__file__", ""))
    for name, value in vars(args).items():
        if name in RULES and not RULES[name][0](value):
            fail(f"--{name.replace('_', '-')} {value} is out of range: use {RULES[name][1]}")
    if args.total_timesteps == 0 and not (args.load_model and args.eval_episodes > 0):
        fail(
            "--total-timesteps 0 trains nothing and only evaluates: pass --load-model PATH and --eval-episodes N, or a budget"
        )
    check_budget(args)
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


def check_open_files(num_seeds):
    """One line, before any folder is made, for more seeds than the process may hold files open."""
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


def check_budget(args):
    """Off-policy scripts learn from the first step past --learning-starts: a budget that ends
    before it would save an untrained model."""
    if not hasattr(args, "learning_starts") or args.total_timesteps == 0:
        return
    n, starts = args.num_envs, args.learning_starts
    if args.total_timesteps // n * n <= starts:  # the loop's last step is the budget's last whole step of every env
        fail(
            f"--total-timesteps {args.total_timesteps} ends before learning starts (--learning-starts {starts}), "
            f"so nothing would be trained: give at least {(starts // n + 1) * n} or a smaller --learning-starts"
        )


def check_env(env_id, atari=False, example=None):
    """One line, before the run's folder exists, for an --env-id that cannot be made here: an
    envpool Atari game is looked up in envpool's list, a gymnasium env is made once (`env_sizes`)."""
    if atari:
        try:
            import envpool
        except ImportError:
            fail("this script needs envpool for its Atari games: pip install 'leanrl[atari]'")
        if env_id not in envpool.list_all_envs() or not hasattr(envpool.make_spec(env_id).config, "episodic_life"):
            fail(f"unknown Atari id {env_id!r}: pass --env-id with an envpool Atari game, e.g. Breakout-v5 or Pong-v5")
        return
    if env_id not in gym.registry:
        fail(
            f"unknown environment id {env_id!r}: pass --env-id with a registered gymnasium id, e.g. {example or 'CartPole-v1'}"
        )
    env_sizes(env_id)


@functools.cache
def env_sizes(env_id):
    """The flat sizes of a gymnasium env's observation and action (a discrete action: 1), from one
    env made here; an env that cannot be made (a missing package, a retired version) is one line."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises many types: ImportError, DependencyNotInstalled, Error
        line = (str(e).strip().splitlines() or [""])[0][:200]
        spec = gym.spec(env_id)  # a retired version: name the newest
        newest = gym.envs.registration.find_highest_version(spec.namespace, spec.name)
        other = f", e.g. {spec.id.removesuffix(f'-v{spec.version}')}-v{newest}" if newest != spec.version else ""
        why = f"{type(e).__name__}: {line}"
        fail(f"--env-id {env_id} cannot be made here ({why}): install what it needs, or pass another id{other}")
    sizes = gym.spaces.flatdim(env.observation_space), math.prod(env.action_space.shape or ())
    env.close()
    return sizes


def check_rollout(args, row_bytes, device=None, per_env=0, per_seed=0):
    """One line, before any env or tensor is made, for rollout storage that will not fit, as
    check_memory does for the replay buffers: `row_bytes` per step of each env, `per_env` per env
    (the env itself), `per_seed` per seed of --num-seeds; on --cuda's device unless `device`."""
    device = device or torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    num_seeds = getattr(args, "num_seeds", 1)
    nbytes = num_seeds * (args.num_envs * (args.num_steps * row_bytes + per_env) + per_seed)
    seeds = f" x --num-seeds {num_seeds}" if num_seeds > 1 else ""
    check_memory(nbytes, device, f"the rollout of --num-steps {args.num_steps} x --num-envs {args.num_envs}{seeds}")


def check_memory(nbytes, device, what):
    """One line, before any work, for a buffer that will not fit in the device's free memory."""
    device = torch.device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if nbytes > free:
        fail(f"{what} needs {nbytes / 2**30:.1f} GiB and {device.type} has {free / 2**30:.1f} GiB free: make it smaller")


def peak_rss_mb():
    """The process's peak resident memory in MiB."""
    if resource is not None:  # ru_maxrss: KiB on Linux, bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    info = psutil.Process().memory_info()
    return getattr(info, "peak_wset", info.rss) / 2**20  # peak_wset: Windows


@contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait until the block is done, where the platform can hold them (POSIX)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def speed_toggles(args, rank=0):
    """The device, and whether CUDA graphs are on. On a CPU, one intra-op thread unless --threads
    says more: OpenMP's spinning threads stall small ops beside any other process (measurements
    in benchmark/RESULTS.md)."""
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cpu" and hasattr(args, "threads"):
        torch.set_num_threads(args.threads)
    cudagraphs = getattr(args, "cudagraphs", False) and device.type == "cuda"
    if getattr(args, "cudagraphs", False) and not cudagraphs and rank == 0:
        print("notice: --cudagraphs needs a CUDA device; running without CUDA graphs", file=sys.stderr)
    return device, cudagraphs


# torch.compile's guard_filter_fn: keep the guards that tell one value from another (tensors,
# constants, identities, types, grad mode, the function's closures), so that an update built anew
# compiles anew; drop those that check modules and library functions, which the scripts never
# change and which cost a tenth of a small compiled update's call.
VALUE_GUARDS = {"TENSOR_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH", "ID_MATCH", "TYPE_MATCH", "GRAD_MODE"}


def value_guards(entries):
    return [e.guard_type in VALUE_GUARDS or (e.guard_type == "CLOSURE_MATCH" and not e.is_global) for e in entries]


# ---------------------------------------------------------------- CHECKPOINTS


def atomic_save(obj, path):
    """Write then rename: a crash mid-save leaves the previous file whole, never a broken one, and a
    failed save (a full disk, an interrupt) leaves no `.tmp` behind."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # a full disk or quota may only show here (NFS: at close)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise
    return path


def algorithm_of(script):
    """The pair a script belongs to: its file name without `_torchcompile` and `.py`."""
    return Path(script).stem.removesuffix("_torchcompile")


def load_checkpoint(path, networks, env_id, algorithm):
    """Load a checkpoint of either script of the pair into `networks` (name -> module). Tensors
    and plain types only (weights_only=True): a checkpoint cannot run code."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for a file that is no checkpoint
        fail(f"cannot load {path!r} ({type(e).__name__}): pass a file written by --save-model of {algorithm}")
    saved = checkpoint.get("algorithm") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, str) or saved != algorithm:
        saved = saved if isinstance(saved, str) and saved else "unknown"
        fail(f"{path!r} is not a {algorithm} checkpoint ({saved}): pass one saved by {algorithm}")
    model, saved_env = checkpoint.get("model"), checkpoint.get("env_id")
    states = model.values() if isinstance(model, dict) else [None]
    if not isinstance(saved_env, str) or not all(
        isinstance(sd, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items())
        for sd in states
    ):
        fail(
            f"{path!r} is a malformed {algorithm} checkpoint (no env_id, or weights not tensors): pass one --save-model wrote"
        )
    for name, sd in model.items():
        if not all(v.isfinite().all() for v in sd.values()):
            fail(f"{path!r} holds non-finite weights (NaN or Inf) in {name}: pass a checkpoint of a run that stayed finite")
    try:
        for name, network in networks.items():
            network.load_state_dict(model[name])
    except (KeyError, RuntimeError, ValueError, IndexError):
        hint = f"pass --env-id {saved_env}" if saved_env != env_id else "use the sizes it was trained with"
        fail(f"{path!r} holds {algorithm} networks for {saved_env} of other sizes: {hint}")


# ---------------------------------------------------------------- RESUME

# Flags a resumed run may change (speed, tracking, outputs; --total-timesteps extends the run); flags not
# given take the run's values.
FREE_ON_RESUME = {
    "resume", "checkpoint_every", "total_timesteps", "track", "wandb_project_name", "wandb_entity", "capture_video",
    "save_model", "load_model", "eval_episodes", "compile", "cudagraphs", "threads", "cuda", "backend", "dist_timeout",
}  # fmt: skip
RESUMING = {}  # id(args) -> the checkpoint that check_args read for it, until its Run takes it
SKIP = object()


def to_plain(x):
    """`x` in the types a weights_only checkpoint holds (tensors, plain types), or SKIP."""
    if isinstance(x, np.generic):  # before float: np.float64 is one
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            return SKIP
        kind = x.dtype.str  # uint32 and others torch cannot hold travel as int64
        return {"__ndarray__": torch.from_numpy(x.astype(np.int64) if x.dtype.kind == "u" else x.copy()), "dtype": kind}
    if isinstance(x, np.random.Generator):
        return {"__generator__": x.bit_generator.state}
    if isinstance(x, (tuple, list, deque)):
        items = [to_plain(v) for v in x]
        kind = "__deque__" if isinstance(x, deque) else "__list__" if isinstance(x, list) else "__tuple__"
        return SKIP if any(v is SKIP for v in items) else {kind: items, "maxlen": getattr(x, "maxlen", None)}
    if isinstance(x, dict):
        items = {k: to_plain(v) for k, v in x.items()}
        return SKIP if any(v is SKIP or not isinstance(k, (str, int)) for k, v in items.items()) else {"__dict__": items}
    return SKIP


def from_plain(x, device=None):
    """The inverse of `to_plain`; tensors go to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device) if device is not None else x
    if not isinstance(x, dict):
        return x
    if "__ndarray__" in x:
        return x["__ndarray__"].numpy().astype(np.dtype(x["dtype"]))
    if "__generator__" in x:
        generator = np.random.Generator(getattr(np.random, x["__generator__"]["bit_generator"])())
        generator.bit_generator.state = x["__generator__"]
        return generator
    if "__dict__" in x:
        return {k: from_plain(v, device) for k, v in x["__dict__"].items()}
    kind, items = next(iter(x.items()))
    items = [from_plain(v, device) for v in items]
    return {"__tuple__": tuple, "__list__": list}.get(kind, lambda v: deque(v, maxlen=x["maxlen"]))(items)


def object_state(obj):
    """What a run needs of `obj` to continue exactly: a module's or optimizer's state_dict, a
    TensorDict's tensors, a gymnasium env's layers (their plain attributes and random generators;
    MuJoCo's integration state), or the plain attributes of any other object (a replay buffer's
    filled rows only)."""
    if isinstance(obj, torch.Tensor):  # a value updated in place (SAC's alpha)
        return {"tensor": obj.detach().cpu().clone()}
    if hasattr(obj, "flatten_keys"):  # a TensorDict of stacked parameters
        return {"tensors": {k: v.detach().cpu().clone() for k, v in obj.flatten_keys(".").items()}}
    if isinstance(obj, np.random.Generator):
        return {"generator": obj.bit_generator.state}
    if callable(obj) and not isinstance(obj, nn.Module):  # a function: the generators it closes over
        return {"closure": [g.bit_generator.state for g in closure_generators(obj)]}
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, Adam)):
        return {"state_dict": obj.state_dict()}
    if isinstance(obj, (gym.Env, gym.vector.VectorEnv)):
        return {"layers": [layer_state(layer) for layer in env_layers(obj)]}
    if hasattr(obj, "flush"):
        obj.flush()  # staged rows go to the storage first
    size, rows = getattr(obj, "size", None), getattr(obj, "buffer_size", None)
    state = {}
    for name, value in vars(obj).items():
        if isinstance(value, dict) and name == "stage":
            continue
        if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            value = {k: v[:size] if rows and len(v) == rows else v for k, v in value.items()}
        elif rows and isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim and len(value) == rows:
            value = value[:size]  # only the filled rows
        plain = to_plain(value)
        if plain is not SKIP:
            state[name] = plain
    return {"attributes": state}


def load_object_state(obj, state):
    if "tensor" in state:
        obj.detach().copy_(state["tensor"])
    elif "generator" in state:
        obj.bit_generator.state = state["generator"]
    elif "closure" in state:
        for generator, saved in zip(closure_generators(obj), state["closure"], strict=True):
            generator.bit_generator.state = saved
    elif "state_dict" in state:
        obj.load_state_dict(state["state_dict"])
    elif "tensors" in state:
        for k, v in obj.flatten_keys(".").items():
            v.detach().copy_(state["tensors"][k])
    elif "layers" in state:
        for layer, saved in zip(env_layers(obj), state["layers"]):
            load_layer_state(layer, saved)
    else:
        for name, saved in state["attributes"].items():
            value, current = from_plain(saved), getattr(obj, name)
            if isinstance(current, dict) and isinstance(value, dict):
                for k, v in value.items():
                    current[k][: len(v)].copy_(v.to(current[k].device)) if isinstance(v, torch.Tensor) else None
            elif isinstance(current, (np.ndarray, torch.Tensor)) and current.ndim and len(value) <= len(current):
                # In place: views of it (a seed's part, a compiled graph's input) see the saved values.
                current[: len(value)] = value if isinstance(current, np.ndarray) else value.to(current.device)
            else:
                setattr(obj, name, value if not isinstance(current, torch.Tensor) else value.to(current.device))


def closure_generators(fn):
    """The numpy generators a function (a policy's noise) closes over."""
    cells = getattr(getattr(fn, "_torchdynamo_orig_callable", fn), "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, np.random.Generator)]


def env_layers(env):
    """A (vector) env's layers, outside in: each wrapper, then the sub-envs' layers."""
    layers = []
    while env is not None:
        layers.append(env)
        for sub in getattr(env, "envs", None) or []:
            layers.extend(env_layers(sub))
        env = getattr(env, "env", None)
    return layers


def layer_state(layer):
    state = {k: p for k, v in vars(layer).items() if k not in ("env", "envs") and (p := to_plain(v)) is not SKIP}
    for k, v in vars(layer).items():
        if isinstance(v, gym.spaces.Space) and v._np_random is not None:  # a space's own generator (its sample())
            state[f"__space__{k}"] = to_plain(v._np_random)
        elif k not in state and type(v).__name__ == "RunningMeanStd":  # observation and reward normalization
            state[f"__stats__{k}"] = {name: to_plain(x) for name, x in vars(v).items()}
    if hasattr(layer, "data") and hasattr(layer, "model") and type(layer.data).__name__ == "MjData":
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        buf = np.empty(mujoco.mj_stateSize(layer.model, spec))
        mujoco.mj_getState(layer.model, layer.data, buf, spec)
        state["__mujoco__"] = torch.from_numpy(buf)
    return state


def load_layer_state(layer, state):
    for k, v in state.items():
        if k == "__mujoco__":
            import mujoco

            mujoco.mj_setState(layer.model, layer.data, v.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)
            mujoco.mj_forward(layer.model, layer.data)
        elif k.startswith("__space__"):
            getattr(layer, k.removeprefix("__space__"))._np_random = from_plain(v)
        elif k.startswith("__stats__"):
            for name, x in v.items():
                setattr(getattr(layer, k.removeprefix("__stats__")), name, from_plain(x))
        else:
            setattr(layer, k, from_plain(v))


def random_state():
    state = {"torch": torch.get_rng_state(), "numpy": to_plain(np.random.get_state()), "python": to_plain(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(from_plain(state["numpy"]))
    random.setstate(from_plain(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_resume(args, script):
    """--resume: read the checkpoint, check that it is this script's and that no flag contradicts it,
    and give every flag left at its default the checkpoint's value (a flag given as its default
    value counts as not given)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("--resume under torchrun is not supported yet (each rank's envs and streams): resume a single process")
    path = Path(args.resume)
    path = path / "resume.pt" if path.is_dir() else path
    if not path.is_file():
        fail(f"--resume {args.resume}: no checkpoint there; pass a run folder (runs/<run_name>) holding resume.pt")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        saved_args, saved_script = checkpoint["args"], checkpoint["script"]
    except Exception as e:  # torch.load raises many types for a file that is no checkpoint
        fail(f"--resume {args.resume}: cannot read its checkpoint ({type(e).__name__}); it is corrupt or not one")
    name = os.path.basename(script)
    if saved_script != name:
        fail(f"--resume {args.resume} is a checkpoint of {saved_script}, not of {name}: resume it with that script")
    defaults = type(args)()
    for key, saved in saved_args.items():
        given = getattr(args, key, saved)
        if key in ("resume", "load_model"):
            continue
        if given == getattr(defaults, key, given):
            setattr(args, key, saved)
        elif given != saved and key not in FREE_ON_RESUME:
            flag = f"--{key.replace('_', '-')}"
            fail(
                f"{flag} {given} contradicts the checkpoint ({flag} {saved}): resume with the flags of the run, or start anew"
            )
    if checkpoint["finished"] and args.total_timesteps <= saved_args["total_timesteps"]:
        fail(
            f"--resume {args.resume}: that run already finished its {saved_args['total_timesteps']} steps; "
            "pass a larger --total-timesteps to extend it"
        )
    RESUMING[id(args)] = checkpoint | {"dir": str(path.parent)}


# ---------------------------------------------------------------- RUN

# Runs whose folder this process made and that have not reached a log point: a refusal (`fail`)
# removes their folders.
FRESH_RUNS = set()


class Run:
    """Around the training loop: runs/<run_name> (TensorBoard events, curve.csv, the checkpoint),
    wandb with --track, the progress bar, steps/s after warm-up, SIGTERM as Ctrl-C, and the one-line
    JSON summary; under torchrun only rank 0 writes. `script`: the script's `__file__`. With
    --num-seeds, one Run per seed (`seed_runs`); the first, the `lead`, alone handles SIGTERM, shows
    the bar and prints the summary for every seed, and finishes last."""

    def __init__(self, args, total_steps, script, warmup_updates=3, rank=0, lead=None):
        self.args, self.warmup_updates, self.main = args, warmup_updates, rank == 0
        self.script, self.algorithm = os.path.basename(script), algorithm_of(script)
        self.lead, self.seeds, self.eval_return = lead or self, [self], None
        if lead:
            lead.seeds.append(self)
        # --resume: this seed's part of the checkpoint that check_args read (see resolve_resume).
        self.resumed = lead.resumed if lead else RESUMING.pop(id(args), None)
        saved = self.resumed["seeds"][len(self.lead.seeds) - 1] if self.resumed else {}
        self.time = lead.time if lead else self.resumed["time"] if self.resumed else int(time.time())
        self.name = f"{args.env_id}__{args.exp_name}__{args.seed}__{self.time}"
        # A resumed run writes on in its folder, wherever it is (each seed's beside the lead's).
        if self.resumed:
            self.name = saved.get("name", self.name)
            self.dir = self.resumed["dir"] if not lead else os.path.join(os.path.dirname(self.resumed["dir"]), self.name)
        else:
            self.dir = f"runs/{self.name}"
        self.wandb = self.writer = self.last_good = self.stop_reason = self.save_error = self.warmup_s = self.last_sps = None
        self.interrupted, self.returns, self.points = False, deque(maxlen=10), []
        self.step, self.updates, self.warm_step = saved.get("step", 0), saved.get("updates", 0), 0
        self.returns.extend(saved.get("returns", []))
        self.total_steps, self.bar, self.offset_s = total_steps, None, self.resumed["wall_s"] if self.resumed else 0.0
        self.start = self.warm_time = time.perf_counter()
        self.stop_signal, self.in_loop, self.objects, self.loop = None, False, {}, None
        # Under torchrun a stop waits for no iteration's end (the ranks' ends differ) and nothing is saved to resume.
        self.resumable = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if not lead:
            signal.signal(signal.SIGTERM, self.on_sigterm)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell ignores it
                signal.signal(signal.SIGINT, self.on_sigterm)
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
            # Line-buffered: each log point's row is in the file at once, whatever kills the run later.
            if self.resumed:
                os.makedirs(self.dir, exist_ok=True)
                self.curve = open(f"{self.dir}/curve.csv", "a", buffering=1)
                self.curve.truncate(saved["curve_bytes"])  # points written after the checkpoint come again
                for name in os.listdir(self.dir):
                    if name.startswith("events.out.tfevents"):
                        with open(f"{self.dir}/{name}", "r+b") as events:
                            events.truncate(saved["events"].get(name, 0))
            else:
                self.make_dir()
                self.curve = open(f"{self.dir}/curve.csv", "w", buffering=1)
                self.curve.write("step,seconds,episodic_return\n")
        except OSError as e:
            fail(f"cannot write {self.dir} ({e.strerror}): run from a folder you can write to")
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter

            self.writer, self.summary = SummaryWriter(os.path.abspath(self.dir)), Summary  # its thread may outlive a chdir
            table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
            if not self.resumed:
                self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        except ImportError:
            if not lead:
                notice = "tensorboard is not installed; metrics go to --track only (pip install tensorboard)"
                print(f"notice: {notice}", file=sys.stderr)
        if self.wandb:
            # Several runs live at once only with reinit="create_new" (wandb 0.19.10 or later).
            seeds = {"group": self.lead.name, "reinit": "create_new"} if getattr(args, "num_seeds", 1) > 1 else {}
            seeds.update({"id": saved["wandb_id"], "resume": "allow"} if saved.get("wandb_id") else {})
            project, entity, config = args.wandb_project_name, args.wandb_entity, vars(args)
            self.wandb = self.wandb.init(
                project=project, entity=entity, config=config, name=self.name, save_code=True, **seeds
            )

    def make_dir(self):
        """runs/<name>, made exclusively: a run started in the same second with the same env, exp
        name and seed (a sweep varying another flag) gets <name>__2, then __3, ..."""
        base = self.name
        for k in itertools.count(2):
            try:
                os.makedirs(self.dir)
                break
            except FileExistsError:
                self.name = f"{base}__{k}"
                self.dir = f"runs/{self.name}"
        self.made = os.path.abspath("runs"), os.path.abspath(self.dir)
        FRESH_RUNS.add(self)

    def discard(self):
        """The folder of a run refused before its first log point, if it holds only what Run wrote
        there, and the parents under runs/ that it leaves empty."""
        FRESH_RUNS.discard(self)
        if getattr(self, "curve", None):
            self.curve.close()
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish(exit_code=2)
        root, folder = self.made
        with suppress(OSError):
            if all(p.name == "curve.csv" or p.name.startswith("events.out.tfevents.") for p in Path(folder).iterdir()):
                shutil.rmtree(folder)
                while len(folder) > len(root):
                    folder = os.path.dirname(folder)
                    os.rmdir(folder)

    def load(self, networks):
        """--load-model into `networks` (name -> module)."""
        load_checkpoint(self.args.load_model, networks, self.args.env_id, self.algorithm)

    def on_sigterm(self, signum, frame):
        """Ctrl-C, and SIGTERM by which schedulers stop jobs, end the run, saving first. In the
        training loop both wait for the end of the iteration, where the state is whole
        (`iterations`); a second one does not wait. Once raised, a further Ctrl-C waits for the
        save: under torchrun each rank gets the terminal's Ctrl-C and then torchrun's own."""
        if self.in_loop and not self.stop_signal and self.resumable:
            self.stop_signal = signum
            return
        self.interrupted = signum
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def resume(self, objects, loop, device="cpu"):
        """What `save_resume` saves: `objects` (name -> module, optimizer, replay buffer, envs, ...;
        False: none) and `loop()`, the loop's variables. With --resume, loads them all and the random
        streams, and returns the saved loop variables (tensors on `device`); else returns `loop()`."""
        self.objects, self.loop = {name: obj for name, obj in objects.items() if obj is not False}, loop
        if not self.resumed:
            return loop()
        try:
            for name, obj in self.objects.items():
                load_object_state(obj, self.resumed["objects"][name])
        except (KeyError, RuntimeError, ValueError, IndexError) as e:
            fail(f"--resume {self.args.resume}: its state does not fit this run ({type(e).__name__}); start anew")
        set_random_state(self.resumed["random"])
        if self.main:
            print(f"notice: resuming {self.dir} after step {self.step}", file=sys.stderr)
        return tuple(from_plain(v, device) for v in self.resumed["loop"]["__tuple__"])

    def iterations(self, start, stop):
        """The training loop's iterations, start .. stop - 1. Ctrl-C and SIGTERM stop it between two
        iterations, after saving what `resume` names; with --checkpoint-every it also saves every
        that many seconds, and at the end."""
        every, due = getattr(self.args, "checkpoint_every", 0), time.perf_counter()
        self.in_loop = True
        try:
            for i in range(start, stop):
                if self.stop_signal:
                    self.interrupted = self.stop_signal
                    self.save_resume(i, stop)
                    raise KeyboardInterrupt
                if every and time.perf_counter() - due >= every:
                    self.save_resume(i, stop)
                    due = time.perf_counter()
                yield i
            if every or self.stop_signal or os.path.exists(f"{self.dir}/resume.pt"):  # marks the run finished
                self.save_resume(stop, stop)
            if self.stop_signal:
                self.interrupted = self.stop_signal
                raise KeyboardInterrupt
        finally:
            self.in_loop = False

    def save_resume(self, iteration, stop):
        """runs/<run_name>/resume.pt, atomically: everything `--resume` needs to continue at `iteration`."""
        if not self.main or self.loop is None or not self.resumable:
            return
        seeds = []
        for run in self.seeds:
            run.write()
            run.curve.flush()
            if run.writer:
                run.writer.flush()
            events = {f: os.path.getsize(f"{run.dir}/{f}") for f in os.listdir(run.dir) if f.startswith("events.out.tfevents")}
            wandb_id = run.wandb.id if run.wandb else None
            seeds.append(
                {"name": run.name, "step": run.step, "updates": run.updates, "returns": list(run.returns)}
                | {"curve_bytes": run.curve.tell(), "events": events, "wandb_id": wandb_id}
            )
        state = {
            "script": self.script, "algorithm": self.algorithm, "args": vars(self.args), "time": self.time,
            "iteration": iteration, "finished": iteration >= stop, "wall_s": self.offset_s + time.perf_counter() - self.start,
            "seeds": seeds, "objects": {name: object_state(obj) for name, obj in self.objects.items()},
            "loop": to_plain(tuple(self.loop())), "random": random_state(),
        }  # fmt: skip
        with signals_held():
            atomic_save(state, f"{self.dir}/resume.pt")

    def interrupt(self):
        """Ctrl-C (or SIGTERM) in the training loop: every seed ends as interrupted."""
        for run in self.seeds:
            run.interrupted = self.interrupted or signal.SIGINT

    def on_uncaught(self, kind, value, traceback):
        """Ctrl-C or SIGTERM outside the training loop: the summary and exit status of an
        interrupted run, not a traceback. One inside an import may come as the cause of another
        error (Python 3.11 wraps what a `__set_name__` raises in a RuntimeError)."""
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
        """The points since the last log point, to TensorBoard and wandb at once (the writer thread
        takes the GIL for each event). Signals wait: a KeyboardInterrupt inside TensorBoard's
        writer can leave its close() hanging (tensorboard 2.21)."""
        with signals_held():
            for step, values in self.points:
                if self.writer:
                    # One event holds all the values: add_scalar writes one per value, at ~40 us each.
                    summary = self.summary(value=[self.summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
                    self.writer.file_writer.add_summary(summary, step)
                if self.wandb:
                    self.wandb.log(values, step=step)
            self.points.clear()

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
        """A log point: steps/s (from the first one with `warmup_updates` updates done, when every
        compiled callable has run), bar, curve, metrics, and with --save-model the weights if finite."""
        FRESH_RUNS.discard(self)
        if self.bar is None:
            hidden = not self.main or self.lead is not self
            initial = self.step * len(self.seeds)
            self.bar = tqdm.tqdm(total=self.total_steps * len(self.seeds), initial=initial, file=sys.stderr, disable=hidden)
        self.bar.update((step - self.step) * len(self.seeds))
        self.step, self.updates, now = step, updates, time.perf_counter()
        if self.warmup_s is None and updates >= self.warmup_updates:
            self.warmup_s, self.warm_step, self.warm_time = now - self.start, step, now
        # The summary's steps/s is the last log point's: closing envs and saving are not training.
        sps = self.last_sps = self.sps()
        mean_return = np.mean(self.returns) if self.returns else float("nan")
        means = [m for m in self.seed_returns() if m is not None]
        shown = np.mean(means) if means else float("nan")
        self.bar.set_description(f"sps={(sps or float('nan')) * len(self.seeds):6.0f} return={shown:8.2f}")
        if self.returns:
            self.curve.write(f"{step},{now - self.start + self.offset_s:.3f},{mean_return:.3f}\n")
        self.scalars(step, {**metrics, "charts/SPS": sps or 0.0})
        self.write()
        if self.args.save_model:
            state = {name: {k: v.detach().clone() for k, v in net.state_dict().items()} for name, net in networks.items()}
            if torch.stack([v.isfinite().all() for sd in state.values() for v in sd.values()]).all():
                self.last_good = state

    def finish(self, step, updates, networks, evaluate, **fields):
        """Save, evaluate, close and print the summary. Exit 1 after a non-finite loss or a failed
        save, 130 after Ctrl-C, 143 after SIGTERM; a checkpoint is only ever saved from finite weights."""
        self.step, self.updates = step, updates
        end_sps, wall_s = self.last_sps, time.perf_counter() - self.start + self.offset_s
        FRESH_RUNS.discard(self)

        def note_signal(signum, frame):
            """Ctrl-C or SIGTERM must not break the save or the summary: noted (no evaluation
            follows; the summary and the exit status tell it), not raised."""
            self.interrupted = self.interrupted or signal.Signals(signum)
            self.lead.interrupted = self.lead.interrupted or self.interrupted

        handlers = signal.signal(signal.SIGINT, note_signal), signal.signal(signal.SIGTERM, note_signal)
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
                saved = {"algorithm": self.algorithm, "env_id": self.args.env_id, "args": vars(self.args), "model": model}
                try:
                    checkpoint = atomic_save(saved, f"{self.dir}/{self.args.exp_name}.pt")
                    print(f"notice: model saved to {checkpoint}", file=sys.stderr)
                except OSError as e:  # a full disk, a quota, a folder made read-only
                    self.save_error = f"cannot save {self.dir}/{self.args.exp_name}.pt ({e.strerror or e}): nothing saved"
        eval_return, stopped = None, self.stop_reason or self.interrupted or self.lead.interrupted
        if self.args.eval_episodes > 0 and self.main and not stopped:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
            try:
                eval_return = evaluate()
            except KeyboardInterrupt:
                self.interrupted = self.interrupted or signal.SIGINT
                self.lead.interrupted = self.lead.interrupted or self.interrupted
            signal.signal(signal.SIGINT, note_signal)
            signal.signal(signal.SIGTERM, note_signal)
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
        save_errors = [run.save_error for run in self.seeds if run.save_error]
        found = [m for m in returns if m is not None]
        rounded = {"episodic_returns": returns, "eval_returns": evals}
        per_seed = {k: [round(m, 3) if m is not None and math.isfinite(m) else None for m in v] for k, v in rounded.items()}
        summary = {
            "script": self.script, "env_id": self.args.env_id, "seed": self.args.seed, "num_seeds": len(self.seeds),
            "compile": getattr(self.args, "compile", False), "cudagraphs": False, **fields,
            "total_steps": self.step, "updates": self.updates, "wall_s": wall_s, "sps": end_sps and end_sps * len(self.seeds),
            "warmup_s": self.warmup_s, "episodic_return": np.mean(found) if found else None,
            **(per_seed if len(self.seeds) > 1 else {}),
            "eval_return": np.mean(evals) if None not in evals else None, "peak_rss_mb": peak_rss_mb(),
            "interrupted": bool(self.interrupted), "checkpoint": checkpoint, "run_dir": self.dir,
            **({"save_failed": True} if save_errors else {}),
        }  # fmt: skip
        # Strict JSON: non-finite numbers become null.
        summary = {
            k: (round(float(v), 3) if math.isfinite(v) else None) if isinstance(v, (float, np.floating)) else v
            for k, v in summary.items()
        }
        if self.main:
            print(json.dumps(summary), flush=True)
        if self.stop_reason:
            print(f"error: {self.stop_reason}", file=sys.stderr)
        if save_errors:
            more = f" (and {len(save_errors) - 1} more seeds)" if len(save_errors) > 1 else ""
            print(f"error: {save_errors[0]}{more}", file=sys.stderr)
        failed = self.stop_reason or save_errors
        code = 1 if failed else (143 if self.interrupted == signal.SIGTERM else 130) if self.interrupted else 0
        if fields.get("world_size", 1) > 1:
            # Everything is saved, closed and printed. A gloo rank that reaches interpreter
            # teardown can abort there (SIGABRT, "terminate called without an active exception"),
            # from gloo's threads: leave before it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if code:
            sys.exit(code)


def seed_runs(args, total_steps, script, rank=0):
    """One Run per seed of --num-seeds (seeds seed ... seed + num_seeds - 1), the first the lead."""
    num_seeds = getattr(args, "num_seeds", 1)
    check_open_files(num_seeds)
    lead = Run(args, total_steps, script, rank=rank)
    return [lead] + [Run(replace(args, seed=args.seed + k), total_steps, script, lead=lead) for k in range(1, num_seeds)]


def seed_slice(infos, k, num_envs):
    """Seed k's share of a vector env's infos: the values of its sub-envs, k * num_envs onwards."""
    part = slice(k * num_envs, (k + 1) * num_envs)
    return {key: seed_slice(value, k, num_envs) if isinstance(value, dict) else value[part] for key, value in infos.items()}


def log_episodes(runs, step, infos, num_envs):
    """Each seed's finished episodes (sub-env k * num_envs + i is env i of seed k)."""
    info = infos.get("final_info", infos)
    if len(runs) == 1:
        runs[0].episodes(step, info)
    elif "_episode" in info and info["_episode"].any():
        for k, run in enumerate(runs):
            run.episodes(step, seed_slice(info, k, num_envs))


def log_seeds(runs, step, updates, metrics, names, networks, **charts):
    """A log point of every seed. `metrics`: a [len(names), seeds] tensor (or None before the first
    update), `networks`: each seed's name -> module. A non-finite loss stops the run: it returns
    False with every seed's stop reason set. note: a host sync."""
    seed_stats = [{}] * len(runs)
    if metrics is not None:
        seed_stats = [dict(zip(names, values)) for values in metrics.reshape(len(names), len(runs)).T.tolist()]
    for k, stats in enumerate(seed_stats):
        # explained variance is NaN by design when a batch's returns are constant (as in CleanRL)
        losses = [name for name in names if name.startswith("losses/") and name != "losses/explained_variance"]
        bad = next((name for name in losses if not math.isfinite(stats.get(name, 0.0))), None)
        if bad:
            which = f" (seed {runs[k].args.seed})" if len(runs) > 1 else ""
            for run in runs:
                run.stop_reason = f"non-finite {bad.removeprefix('losses/')} {stats[bad]} at step {step}{which}"
            return False
    for run, stats, nets in zip(runs, seed_stats, networks):
        run.log(step, updates, {**stats, **charts}, nets)
    return True


def finish_seeds(runs, step, updates, networks, evaluate, **fields):
    """Finish every seed's run, the lead last (its summary reports every seed). `evaluate(nets,
    args, run_name)` evaluates one seed's networks."""
    for run, nets in reversed(list(zip(runs, networks))):
        run.finish(step, updates, nets, lambda run=run, nets=nets: evaluate(nets, run.args, run.name), **fields)


# ---------------------------------------------------------------- OPTIMIZERS


class Adam:
    """torch.optim.Adam's step as a call on tensors: torch's functional `adam` (the code that
    `optim.Adam.step()` runs) on state kept here. In a compiled update it traces into the one
    graph, where `optimizer.step()` would break it (and, on CUDA, compile once per optimizer).

    `params`: (name, parameter) pairs; their detached views are updated in place, so the modules
    see each step. `lr` may be a 0-d tensor annealed in place. `fused`: one kernel for all the
    tensors, for eager updates. `capturable` (CUDA): the step counts stay on the device, so a
    step never syncs and can be captured in a CUDA graph."""

    def __init__(self, params, lr, eps=1e-8, fused=False, capturable=False):
        self.params = {name: p.detach() for name, p in params}
        self.exp_avgs = [torch.zeros_like(p) for p in self.params.values()]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params.values()]
        self.steps = [torch.zeros((), device=p.device) for p in self.params.values()]
        self.lr, self.eps, self.fused, self.capturable = lr, eps, fused, capturable

    def state_dict(self):
        return {"exp_avgs": self.exp_avgs, "exp_avg_sqs": self.exp_avg_sqs, "steps": self.steps}

    def load_state_dict(self, state):
        for key, tensors in state.items():
            for mine, saved in zip(getattr(self, key), tensors):
                mine.copy_(saved)

    @torch.no_grad()
    def step(self, grads):
        # torch.func may return a gradient in the layout its backward made (transposed for a
        # weight used as `w.mT`); the fused kernel reads it as if laid out like the weight.
        grads = [grads[name].contiguous() for name in self.params]
        adam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
            foreach=False, fused=self.fused or None, capturable=self.capturable,
            amsgrad=False, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False,
        )  # fmt: skip


class RAdam(Adam):
    """torch.optim.RAdam's step in the shape of `Adam`. `capturable`: the rectification's branch on
    the step count becomes a `torch.where`, needed under torch.compile (a branch on a tensor breaks
    the graph) and on CUDA (no sync); torch refuses it for an eager step on a CPU."""

    @torch.no_grad()
    def step(self, grads):
        grads = [grads[name].contiguous() for name in self.params]
        radam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, self.steps,
            foreach=False, capturable=self.capturable, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=self.eps,
        )  # fmt: skip


class ReplayBuffer:
    """Replay on the training device: transitions (`fields`: name -> (shape of a row, dtype)) in
    tensors allocated once (`empty`: pages are touched only as the buffer fills), gathered inside
    the update,
    staged in host arrays and copied in blocks (when the stage is full, and before each update): on
    a CPU a torch call costs more than the copy it makes; on CUDA each copy is a transfer."""

    def __init__(self, buffer_size, fields, stage_rows, device):
        row_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())
        check_memory(buffer_size * row_bytes, device, f"--buffer-size {buffer_size}")
        self.storage, self.stage = {}, {}
        for k, (shape, dtype) in fields.items():
            self.storage[k] = torch.empty(buffer_size, *shape, dtype=dtype, device=device)
            self.stage[k] = np.zeros((stage_rows, *shape), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        self.buffer_size, self.stage_rows, self.device = buffer_size, stage_rows, device
        self.pos = self.size = self.pending = 0

    def add(self, **rows):
        """Stage `rows` (name -> [n, *row shape], or one row without its leading 1)."""
        key, value = next(iter(rows.items()))
        n = value.size // self.stage[key][0].size
        for key, value in rows.items():
            self.stage[key][self.pending : self.pending + n] = value
        self.pending += n
        if self.pending + n > self.stage_rows:
            self.flush()

    def flush(self):
        """Copy the staged steps into the device storage, in at most two slices per field."""
        n, pos = self.pending, self.pos
        if n == 0:
            return
        first = min(n, self.buffer_size - pos)
        for key, staged in self.stage.items():
            dest = self.storage[key]
            dest[pos : pos + first].copy_(torch.from_numpy(staged[:first]))
            if first < n:
                dest[: n - first].copy_(torch.from_numpy(staged[first:n]))
        self.pos, self.size, self.pending = (pos + n) % self.buffer_size, min(self.size + n, self.buffer_size), 0

    def sample(self, batch_size):
        """Indices of a uniform batch, drawn on the device (no host sync; a graphed update's input)."""
        self.flush()
        return torch.randint(self.size, (batch_size,), device=self.device)


# ---------------------------------------------------------------- NETWORKS: SEEDS AND HOST ACTING


def stack_seeds(networks):
    """The networks' parameters stacked on a leading seed dimension (flat names -> tensors); each
    network's parameters become views of its slice, so it acts, evaluates and saves with its seed's
    current weights. One network is a stack of one."""
    stacked = torch.stack([from_module(net).data for net in networks]).contiguous()
    for k, net in enumerate(networks):
        stacked[k].to_module(net)
    return stacked.flatten_keys(".")


def seeds_forward(module, shared=()):
    """`module`'s forward for stacked seeds, read from the module itself: (params [seeds, ...] as
    from `stack_seeds`, *inputs [seeds, rows, ...]) -> outputs [seeds, rows, ...], each seed's rows
    through its own weights (torch.func.vmap of functional_call). `shared`: the positions of inputs
    that every seed takes whole (e.g. twin critics on one batch). A stack of one runs the module's
    own ops, so one seed computes exactly what the module computes, at its speed."""

    def call(p, *inputs):
        return torch.func.functional_call(module, p, inputs)

    def forward(params, *inputs):
        if next(iter(params.values())).shape[0] > 1:
            in_dims = tuple(None if i in shared else 0 for i in range(len(inputs)))
            return torch.func.vmap(call, in_dims=(0, *in_dims))(dict(params), *inputs)
        one = {name: p.squeeze(0) for name, p in params.items()}  # squeeze: the gradient keeps its layout
        out = call(one, *(x if i in shared else x[0] for i, x in enumerate(inputs)))
        return tuple(y.unsqueeze(0) for y in out) if isinstance(out, tuple) else out.unsqueeze(0)

    return forward


def _numpy_layer(layer, name, p):
    """One layer as a numpy function on [seeds, rows, features], on views of its stacked weights."""
    if isinstance(layer, nn.Linear):
        weight_t = p[f"{name}.weight"].numpy().swapaxes(1, 2)
        bias = p[f"{name}.bias"].numpy()[:, None] if layer.bias is not None else np.float32(0)

        def linear(x):
            x = x @ weight_t
            x += bias
            return x

        return linear
    if isinstance(layer, nn.LayerNorm) and len(layer.normalized_shape) == 1:
        # Each row's mean and variance as a matmul with a column of 1/n: numpy's row reductions
        # cost several us each for a few rows.
        mean = np.full((layer.normalized_shape[0], 1), 1.0 / layer.normalized_shape[0], np.float32)
        affine = layer.elementwise_affine
        scale, shift = (p[f"{name}.{k}"].numpy()[:, None] if affine else np.float32(k == "weight") for k in ("weight", "bias"))

        def layer_norm(x):  # in place, as every layer after the first (see numpy_forward)
            x -= x @ mean
            std = (x * x) @ mean
            std += layer.eps
            np.sqrt(std, out=std)
            x /= std
            x *= scale
            x += shift
            return x

        return layer_norm
    activations = {
        nn.ReLU: lambda x: np.maximum(x, 0, out=x),  # in place: x is never the caller's (see forward)
        nn.Tanh: lambda x: np.tanh(x, out=x),
        nn.Sigmoid: lambda x: 1 / (1 + np.exp(-x)),
        nn.Identity: lambda x: x,
        nn.SiLU: lambda x: x / (1 + np.exp(-x)),
    }
    if type(layer) in activations:
        return activations[type(layer)]
    if isinstance(layer, nn.LeakyReLU):
        return lambda x: np.where(x > 0, x, x * layer.negative_slope)
    if isinstance(layer, nn.ELU):
        return lambda x: np.where(x > 0, x, layer.alpha * np.expm1(np.minimum(x, 0)))
    return None


def numpy_forward(module, params, prefix=""):
    """`module`'s forward in numpy for stacked seeds, x [seeds, rows, features] -> [seeds, rows, out],
    read from the module: its leaf layers in registration order, each on views of `params` (flat
    names -> stacked CPU tensors, the module's names under `prefix`; `Tensor.numpy()` shares their
    memory, so every optimizer step is seen at once). For a few rows a numpy op costs under a
    microsecond and a torch op several. Never a silent mismatch: a layer it has no form for, or a
    forward that is more than its layers in order (checked on a probe), ends the run in one line."""
    layers, first_is_linear = [], None
    for name, layer in module.named_modules():
        if next(layer.children(), None) is not None:
            continue
        fn = _numpy_layer(layer, prefix + name, params)
        if fn is None:
            known = "Linear, LayerNorm, ReLU, Tanh, Sigmoid, SiLU, ELU, LeakyReLU"
            kind = f"{prefix + name} ({type(layer).__name__}) of {type(module).__name__}"
            fail(f"numpy acting cannot follow layer {kind}: use {known}, or give it a numpy form in leanrl_utils")
        first_is_linear = isinstance(layer, nn.Linear) if first_is_linear is None else first_is_linear
        layers.append(fn)

    def forward(x):
        x = x if first_is_linear else x.copy()  # the layers work in place after a Linear's new array
        for fn in layers:
            x = fn(x)
        return x

    # The probe: seed 0 of the derived forward against the module with seed 0's weights.
    seed0 = {name[len(prefix) :]: t[0] for name, t in params.items() if name.startswith(prefix)}
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        fail(f"numpy acting needs a Linear layer in {type(module).__name__}: add one")
    probe = torch.randn(8, first.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.func.functional_call(module, seed0, (probe,)).numpy()
    n_seeds = next(iter(params.values())).shape[0]
    got = forward(np.broadcast_to(probe.numpy(), (n_seeds, *probe.shape)).copy())[0]
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        name = type(module).__name__
        fail(
            f"numpy acting does not match {name}.forward, which is more than its layers in order: "
            "make it a chain of its layers"
        )
    return forward


def host_arrays(policy, device):
    """A device policy as the loop calls it: host observations in, host arrays out."""

    def call(obs):
        # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
        out = policy(torch.from_numpy(obs).to(device))
        return out.cpu().numpy() if isinstance(out, torch.Tensor) else [x.cpu().numpy() for x in out]

    return call


# ---------------------------------------------------------------- ENVS


class SameStepEnvs(gym.vector.SyncVectorEnv):
    """gymnasium's SyncVectorEnv under SAME_STEP autoreset with a shorter step: the same arrays, and
    infos holding only the episode ends (final_obs, final_info), without the generic batching that
    costs more than a small env's step."""

    def __init__(self, env_fns):
        super().__init__(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def step(self, actions):
        observations, infos = [], {}
        rewards = np.zeros(self.num_envs)
        terminations, truncations = np.zeros(self.num_envs, bool), np.zeros(self.num_envs, bool)
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            obs, rewards[i], terminations[i], truncations[i], info = env.step(action)
            if terminations[i] or truncations[i]:
                infos = self._add_info(infos, {"final_obs": obs, "final_info": info}, i)
                obs, _ = env.reset()
            observations.append(obs)
        return np.stack(observations), rewards, terminations, truncations, infos


def real_next_obs(next_obs, infos):
    """The observation each env reached: where an episode just ended, `next_obs` already starts the
    next one and the true last one is in infos."""
    if "final_obs" not in infos:
        return next_obs
    real = next_obs.copy()
    for i in np.flatnonzero(infos["_final_obs"]):
        real[i] = infos["final_obs"][i]
    return real


class RecordEpisodeStatistics(gym.vector.VectorWrapper):
    """envpool Atari: returns and lengths of whole games over all lives, from unclipped rewards (a
    game ends when `infos["terminated"]` says no lives are left, or at the step limit), reported as
    gymnasium's vector wrapper does. Steps count every call, reset steps included, as in CleanRL."""

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
    """envpool Atari: videos of env 0's whole games on gymnasium's RecordVideo schedule (games 0, 1,
    8, 27, ..., 1000, 2000, ...); a rendered frame costs a copy only while a game is recorded."""

    def __init__(self, env, video_folder, fps=15):
        # Imported here: gymnasium's save_video module raises at import without moviepy.
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


def envpool_envs(env_id, num_envs, seed, capture_video=False, video_folder=None):
    """An envpool batch of `num_envs` Atari games with CleanRL's settings, or one clear line for
    what is missing."""
    import importlib.util

    check_env(env_id, atari=True)
    import envpool

    if capture_video and importlib.util.find_spec("moviepy") is None:
        fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
    render = {"render_mode": "rgb_array"} if capture_video else {}
    envs = envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=seed, **render
    )
    if capture_video:
        envs = RecordGameVideo(envs, video_folder)
    return RecordEpisodeStatistics(envs)


# ---------------------------------------------------------------- TORCHRUN


def init_distributed(args):
    """This process's (rank, world size, device). Under torchrun it joins the process group (gloo on
    a CPU, nccl on CUDA unless --backend says otherwise; each rank on the GPU of its LOCAL_RANK).
    Every collective waits at most --dist-timeout: a rank that stops never hangs the others."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and args.cuda
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = args.backend or ("nccl" if cuda else "gloo")
    if args.backend is not None or world_size > 1:
        if backend not in ("gloo", "nccl"):
            fail(f"--backend {backend} is not supported: use gloo (CPU or CUDA) or nccl (CUDA)")
        if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
            fail(f"this torch build has no {backend} backend: use --backend {'gloo' if backend == 'nccl' else 'nccl'}")
        if backend == "nccl" and not cuda:
            fail("--backend nccl needs a CUDA device (and no --no-cuda): use --backend gloo on a CPU")
    if world_size == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:
        if backend == "nccl" and local_rank >= torch.cuda.device_count():
            fail(
                f"rank {rank} has no GPU of its own ({torch.cuda.device_count()} visible; nccl needs one per process): "
                "start at most that many per node, or pass --backend gloo",
                every_rank=True,
            )
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.dist_timeout))
    except Exception as e:  # the store, the backend and the rendezvous raise many types
        fail(
            f"rank {rank} could not join the {world_size} processes ({error_line(e)}): "
            "check that every node runs the same torchrun command and reaches --rdzv-endpoint"
        )
    return rank, world_size, device


def error_line(e):
    """A torch.distributed error in one short line (gloo's and c10d's open with a C++ location)."""
    line = (str(e).strip().splitlines() or [""])[0]
    if line.startswith("[") and "] " in line:
        line = line[line.index("] ") + 2 :]
    return f"{type(e).__name__}: {line[:160]}"


def broadcast_parameters(params):
    """Rank 0's parameters to every rank, as one flat buffer."""
    import torch.distributed as dist

    params = [p.detach() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    for p, new in zip(params, flat.split([p.numel() for p in params])):
        p.copy_(new.view_as(p))


def all_reduce_mean(grads, metrics, world_size):
    """The mean over the ranks of the gradients (name -> tensor) and the metrics: one flat buffer,
    one `all_reduce` per step."""
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads.values()] + [metrics])
    dist.all_reduce(flat)
    flat = flat / world_size
    *parts, metrics = flat.split([g.numel() for g in grads.values()] + [metrics.numel()])
    return {name: part.view(g.shape) for (name, g), part in zip(grads.items(), parts)}, metrics


def gather_episodes(episodes, rank, world_size):
    """Every rank's finished episodes, (step, return, length), on rank 0 in step order (an empty
    list elsewhere). note: a host sync, once per iteration."""
    import torch.distributed as dist

    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(episodes, gathered, dst=0)
    return sorted(e for rank_episodes in gathered for e in rank_episodes) if rank == 0 else []


def finish_distributed(run, params, world_size, lost):
    """The end of a torchrun run: ranks whose parameters drifted apart (checksums) exit 1, since
    rank 0's checkpoint must be every rank's model; then leave the group. After Ctrl-C or a lost
    rank no collective is tried."""
    import torch.distributed as dist

    fields = {}
    if not run.interrupted and not lost:
        flat = torch.cat([p.detach().reshape(-1) for p in params]).double()
        # A position-weighted sum: a change in any one parameter, or two swapped, changes it.
        checksum = (flat * torch.arange(1, flat.numel() + 1, device=flat.device, dtype=flat.dtype)).sum().reshape(1)
        checksums = [torch.empty_like(checksum) for _ in range(world_size)]
        dist.all_gather(checksums, checksum)
        checksums = [float(c) for c in checksums]
        fields["rank_checksums"] = [repr(c) for c in checksums]
        if len(set(checksums)) > 1 and run.stop_reason is None:
            run.stop_reason = (
                f"the ranks' parameters differ at the end (checksums {checksums}): "
                "the gradient all-reduce did not keep them identical"
            )
    dist.destroy_process_group()
    return fields

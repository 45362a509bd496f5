"""--save-model / --load-model checkpoints, read by either script of a pair: written atomically, loaded
`weights_only`, refused in one line when of another algorithm, size or env, malformed or non-finite."""

import os
from contextlib import suppress
from pathlib import Path

import torch

from leanrl_utils.checks import fail


def atomic_save(obj, path):
    """Write then rename: a crash leaves the previous file whole, a failure no `.tmp`."""
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


def why(e):
    """A failed write's cause in a few words (an OSError's, or the type and first line)."""
    return getattr(e, "strerror", None) or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def algorithm_of(script):
    """The pair a script belongs to: its file name without `_torchcompile` and `.py`."""
    return Path(script).stem.removesuffix("_torchcompile")


def finite(state):
    """Whether every tensor of `state` (name -> state_dict) is finite."""
    return all(v.isfinite().all() for sd in state.values() for v in sd.values())


def save(path, state, algorithm, args):
    """`state` (name -> state_dict) as a checkpoint of `algorithm`, copied to the CPU (a seed's
    weights view all seeds' storage, which torch.save would write whole)."""
    model = {name: {k: v.detach().to("cpu", copy=True) for k, v in sd.items()} for name, sd in state.items()}
    return atomic_save({"algorithm": algorithm, "env_id": args.env_id, "args": vars(args), "model": model}, path)


def load(path, networks, env_id, algorithm):
    """A checkpoint of either script of the pair into `networks` (name -> module)."""
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
        if not finite({name: sd}):
            fail(f"{path!r} holds non-finite weights (NaN or Inf) in {name}: pass a checkpoint of a run that stayed finite")
    try:
        for name, network in networks.items():
            network.load_state_dict(model[name])
    except (KeyError, RuntimeError, ValueError, IndexError):
        hint = f"pass --env-id {saved_env}" if saved_env != env_id else "use the sizes it was trained with"
        fail(f"{path!r} holds {algorithm} networks for {saved_env} of other sizes: {hint}")

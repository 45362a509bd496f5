"""--resume and --checkpoint-every: the flags, resume.pt written and read (whose, which flags were
typed), the run folder held by one process. What a checkpoint holds is `state`'s."""

import io
import os
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from tqdm import tqdm

from leanrl_utils import checkpoints, state
from leanrl_utils.checks import fail


@dataclass
class Flags:
    """The flags of preemption-safe runs, shared by every script's Args."""

    resume: str | None = None
    """a run folder (or its resume.pt) to continue where it stopped, with the same flags"""
    checkpoint_every: float = 0.0
    """seconds between resumable checkpoints (runs/{run_name}/resume.pt; 0: only when stopped)"""


# Flags a resumed run may change (speed, tracking, outputs; --total-timesteps extends the run).
FREE = {
    "resume", "checkpoint_every", "total_timesteps", "track", "wandb_project_name", "wandb_entity", "capture_video",
    "save_model", "load_model", "eval_episodes", "compile", "cudagraphs", "threads", "cuda", "backend", "dist_timeout",
}  # fmt: skip


def given(argv):
    """The flags named on a command line (`--name value`, `--name=value`, `--no-name`), as fields."""
    names = {token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")}
    return names | {name.removeprefix("no_") for name in names}


def hold(folder):
    """A lock on `folder`: a second process is refused in one line; a dead one leaves it free."""
    lock = FileLock(os.path.join(folder, ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        with suppress(OSError), open(os.path.join(folder, ".pid")) as f:
            fail(f"{folder} is written by another process (pid {f.read().strip()}): stop it first, or wait for its end")
        fail(f"{folder} is written by another process: stop it first, or wait for its end")
    with suppress(OSError), open(os.path.join(folder, ".pid"), "w") as f:
        f.write(str(os.getpid()))
    return lock


def read(args, script, argv=None):
    """--resume's checkpoint (+ "dir", "lock"), checked to be `script`'s and whole, or None. Flags not
    typed take the run's values; a typed one that differs is refused, or if FREE said in one line."""
    if not getattr(args, "resume", None):
        return None
    where, world_size = f"--resume {args.resume}", int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun every rank reads; rank 0 holds the folder
    if args.load_model:
        fail(f"--load-model and {where} both set the weights: resume the run, or start a new one from the model")
    path = Path(args.resume)
    path = path / "resume.pt" if path.is_dir() else path
    if not path.is_file():
        fail(f"{where}: no checkpoint there; pass a run folder (runs/<run_name>) holding resume.pt")
    lock = hold(path.parent) if rank0 else None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        saved_args, saved_script, done = checkpoint["args"], checkpoint["script"], checkpoint["loop"]["__tuple__"][0]
        assert isinstance(saved_args, dict) and isinstance(done, int) and isinstance(checkpoint["finished"], bool)
        assert all(isinstance(checkpoint[k], dict) for k in ("objects", "loop", "random"))
        assert isinstance(checkpoint["seeds"], list) and all(isinstance(s, dict) for s in checkpoint["seeds"])
        ranks = checkpoint.get("ranks", [])  # under torchrun, ranks 1, 2, ...: their own objects, loop and streams
        assert isinstance(ranks, list) and all(isinstance(r[k], dict) for r in ranks for k in ("objects", "loop", "random"))
    except Exception as e:  # torch.load raises many types for a file that is no checkpoint; a field can be missing
        fail(f"{where}: cannot read its checkpoint ({type(e).__name__}); it is corrupt or not one: start anew")
    name = os.path.basename(script)
    if saved_script != name:
        fail(f"{where} is a checkpoint of {saved_script}, not of {name}: resume it with that script")
    if len(ranks) + 1 != world_size:
        ran, now = (f"{n} torchrun ranks" if n > 1 else "one process" for n in (len(ranks) + 1, world_size))
        fail(f"{where} is a run of {ran}, not {now}: resume it with {ran}")
    typed, changed = given(sys.argv[1:] if argv is None else argv), []
    for key, saved in saved_args.items():
        if key in ("resume", "load_model") or not hasattr(args, key) or getattr(args, key) == saved:
            continue
        flag, value = f"--{key.replace('_', '-')}", getattr(args, key)
        if key not in typed:
            setattr(args, key, saved)
        elif key in FREE:
            changed.append(f"{flag} {value} (the run had {saved})")
        else:
            fail(
                f"{flag} {value} contradicts the checkpoint ({flag} {saved}): resume with the flags of the run, or start anew"
            )
    if args.total_timesteps < done:
        fail(
            f"--total-timesteps {args.total_timesteps} is below the {done} steps the run has done: leave it out, or give more"
        )
    if checkpoint["finished"] and args.total_timesteps <= saved_args["total_timesteps"]:
        fail(f"{where}: that run already finished its {saved_args['total_timesteps']} steps; pass a larger --total-timesteps")
    if changed and rank0:
        print(f"notice: resuming with {', '.join(changed)}", file=sys.stderr)
    return checkpoint | {"dir": str(path.parent), "lock": lock}


def save(lead, iteration, finished):
    """resume.pt, atomically: what --resume needs to go on at `iteration`, every seed's and (gathered
    by rank 0) every rank's. A failed save is said in one line and tried again at the next."""
    if lead.loop is None:
        return
    mine = {"objects": {name: state.state_of(obj) for name, obj in lead.objects.items()},
            "loop": state.to_plain(tuple(lead.loop())), "random": state.random_state()}  # fmt: skip
    ranks = []
    if lead.world_size > 1:
        import torch.distributed as dist

        serialized = io.BytesIO()  # bytes with CPU tensors: a rank's CUDA tensors would not unpickle on rank 0
        torch.save(mine, serialized)
        gathered = [None] * lead.world_size if lead.rank0 else None
        dist.gather_object(serialized.getvalue(), gathered, dst=0)
        ranks = [torch.load(io.BytesIO(b), map_location="cpu", weights_only=True) for b in gathered[1:]] if lead.rank0 else []
    if not lead.rank0:
        return
    seeds = []
    for run in lead.seeds:
        run.open()
        run.write("flush")
        events = {f: os.path.getsize(f"{run.dir}/{f}") for f in os.listdir(run.dir) if f.startswith("events.out.tfevents")}
        seeds.append(
            {"name": run.name, "step": run.step, "updates": run.updates, "returns": list(run.returns)}
            | {"curve_bytes": run.curve.tell(), "events": events, "wandb_id": run.wandb.id if run.wandb else None}
        )
    saved = {
        "script": lead.script, "algorithm": lead.algorithm, "args": vars(lead.args), "time": lead.time,
        "iteration": iteration, "finished": finished, "wall_s": lead.offset_s + time.perf_counter() - lead.start,
        "seeds": seeds, **mine, "ranks": ranks,
    }  # fmt: skip
    path = f"{lead.dir}/resume.pt"
    try:
        checkpoints.atomic_save(saved, path)
        lead.resume_error = None
    except Exception as e:
        lead.resume_error = f"cannot save {path} ({checkpoints.why(e)})"
        tqdm.write(f"error: {lead.resume_error}; training goes on and tries again at the next checkpoint", file=sys.stderr)


def save_finished(lead):
    """Once, after a loop that ran to its end, a kept resume.pt marked finished (every rank calls it)."""
    if lead.iteration is None or lead.stop_signal or lead.stop_reason or getattr(lead, "ended", False):
        return
    lead.ended = True
    if getattr(lead.args, "checkpoint_every", 0) or lead.resumed:
        save(lead, lead.iteration + 1, finished=True)

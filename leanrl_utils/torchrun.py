"""torchrun: joining the process group, rank 0's parameters to every rank, gradients averaged in one
all_reduce, episodes gathered on rank 0, and a check at the end that the ranks agree."""

import os
from datetime import timedelta

import torch

from leanrl_utils import resume
from leanrl_utils.checks import fail


def init(args):
    """(rank, world size, device); under torchrun, the process group joined (gloo on a CPU, nccl on
    CUDA, or --backend; the GPU of LOCAL_RANK), every collective waiting at most --dist-timeout."""
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


def broadcast(params):
    """Rank 0's parameters to every rank, as one flat buffer."""
    import torch.distributed as dist

    params = [p.detach() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    for p, new in zip(params, flat.split([p.numel() for p in params])):
        p.copy_(new.view_as(p))


def all_reduce_mean(grads, metrics, world_size):
    """The ranks' mean gradients (name -> tensor) and metrics, in one flat `all_reduce`."""
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads.values()] + [metrics])
    dist.all_reduce(flat)
    flat = flat / world_size
    *parts, metrics = flat.split([g.numel() for g in grads.values()] + [metrics.numel()])
    return {name: part.view(g.shape) for (name, g), part in zip(grads.items(), parts)}, metrics


def gather_episodes(episodes, rank, world_size):
    """Every rank's (step, return, length) on rank 0 in step order, [] elsewhere. note: a host sync."""
    import torch.distributed as dist

    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(episodes, gathered, dst=0)
    return sorted(e for rank_episodes in gathered for e in rank_episodes) if rank == 0 else []


def leave(run, params, world_size, lost):
    """The end of a torchrun run: parameters that drifted apart across ranks (checksums) exit 1, then
    the group is left (no collective after a stop or a lost rank)."""
    import torch.distributed as dist

    fields = {}
    if not run.stop_signal and not lost:
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
        resume.save_finished(run.lead)
    dist.destroy_process_group()
    return fields

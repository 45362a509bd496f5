"""The end of a run: the last resume.pt, the --save-model checkpoint (only ever from finite weights),
evaluation, closing the writers, the one-line JSON summary and the exit status."""

import json
import math
import os
import signal
import sys
import time

import numpy as np

from leanrl_utils import checkpoints, resume

try:  # POSIX only: peak memory comes from psutil elsewhere (Windows)
    import resource
except ImportError:
    resource = None


def peak_rss_mb():
    """The process's peak resident memory in MiB."""
    if resource is not None:  # ru_maxrss: KiB on Linux, bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    import psutil

    info = psutil.Process().memory_info()
    return getattr(info, "peak_wset", info.rss) / 2**20  # peak_wset: Windows


def strict(value):
    """A summary value in strict JSON: a non-finite number is null."""
    if isinstance(value, list):
        return [strict(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return round(float(value), 3) if math.isfinite(value) else None
    return value


def finish(run, step, updates, networks, evaluate, fields):
    """Exit 1 after a non-finite loss or a failed save, 130 after Ctrl-C, 143 after SIGTERM."""
    lead = run.lead
    run.step, run.updates = step, updates
    wall_s = time.perf_counter() - run.start + run.offset_s
    run.open()
    if run.bar:
        run.bar.close()
    resume.save_finished(lead)
    if lead.stop_signal and run.rank0 and run is lead:
        print(f"notice: interrupted at step {run.step}; saving what there is", file=sys.stderr)
    checkpoint, state = None, run.last_good
    # A run stopped before its loop ran an iteration has no weights of its own to save.
    if run.args.save_model and run.rank0 and networks and not (lead.stop_signal and not lead.ran):
        current = {name: net.state_dict() for name, net in networks.items()}
        if run.stop_reason is None and checkpoints.finite(current):
            state = current
        if state is None:
            print("notice: the weights were never finite at a log point; no checkpoint saved", file=sys.stderr)
        else:
            path = f"{run.dir}/{run.args.exp_name}.pt"
            try:
                checkpoint = checkpoints.save(path, state, run.algorithm, run.args)
                print(f"notice: model saved to {checkpoint}", file=sys.stderr)
            except Exception as e:  # a full disk, a quota, a folder made read-only
                run.save_error = f"cannot save {path} ({checkpoints.why(e)}): nothing saved"
    if run.args.eval_episodes > 0 and run.rank0 and not (run.stop_reason or lead.stop_signal):

        def stop(signum, frame):  # a long evaluation stops at once on Ctrl-C or SIGTERM
            lead.stop_signal = lead.stop_signal or signal.Signals(signum)
            raise KeyboardInterrupt

        previous = [signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)]
        try:
            run.eval_return = evaluate()
        except KeyboardInterrupt:
            lead.stop_signal = lead.stop_signal or signal.SIGINT
        for s, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            signal.signal(s, handler)
    run.curve.close()
    run.write("close")
    if run.wandb:
        run.wandb.finish()
    if run is not lead:
        return
    returns, evals = [r.mean_return() for r in run.seeds], [r.eval_return for r in run.seeds]
    save_errors = [r.save_error for r in run.seeds if r.save_error] + [run.resume_error] * bool(run.resume_error)
    found = [m for m in returns if m is not None]
    seeds = {"episodic_returns": returns, "eval_returns": evals} if len(run.seeds) > 1 else {}
    end_sps = run.last_sps and run.last_sps * len(run.seeds)
    summary = {
        "script": run.script, "env_id": run.args.env_id, "seed": run.args.seed, "num_seeds": len(run.seeds),
        "compile": getattr(run.args, "compile", False), "cudagraphs": False, **fields,
        "total_steps": run.step, "updates": run.updates, "wall_s": wall_s, "sps": end_sps, "warmup_s": run.warmup_s,
        "episodic_return": np.mean(found) if found else None, **seeds,
        "eval_return": np.mean(evals) if None not in evals else None, "peak_rss_mb": peak_rss_mb(),
        "interrupted": bool(lead.stop_signal), "checkpoint": checkpoint, "run_dir": run.dir,
        **({"save_failed": True} if save_errors else {}),
    }  # fmt: skip
    if run.rank0:
        print(json.dumps({k: strict(v) for k, v in summary.items()}), flush=True)
    if run.stop_reason:
        print(f"error: {run.stop_reason}", file=sys.stderr)
    if save_errors:
        more = f" (and {len(save_errors) - 1} more seeds)" if len(save_errors) > 1 else ""
        print(f"error: {save_errors[0]}{more}", file=sys.stderr)
    code = 1 if run.stop_reason or save_errors else {signal.SIGTERM: 143, signal.SIGINT: 130}.get(lead.stop_signal, 0)
    if fields.get("world_size", 1) > 1:
        # A gloo rank that reaches interpreter teardown can abort there (SIGABRT, "terminate called
        # without an active exception"), from gloo's threads: leave before it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)

"""The speed toggles' plumbing: the device, CPU threads, whether CUDA graphs run, the guards that
torch.compile keeps, and a cold compile that a stop signal ends."""

import functools
import signal
import sys
import threading

import torch


def setup(args, rank=0):
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


class StopCompile(BaseException):
    """A stop signal in a cold compile (BaseException: torch's handlers of Exception let it by)."""


def interruptible(run, *fns):
    """torch.compile'd `fns` whose cold compile (their first call) a stop signal ends at once, not
    tens of seconds later (`Run.on_signal` raises StopCompile): that call and every compiled call
    after it then run eagerly, so the loop reaches its next `checkpoint` and saves. A StopCompile
    raised inside a finalizer (a `__del__`, a weakref callback) is dropped by Python: the signal is
    sent again, so it lands where it ends the compile."""

    def wrap(fn):
        eager, first = getattr(fn, "__wrapped__", None), True  # torch.compile's wrapper names fn
        if eager is None:
            return fn

        @functools.wraps(fn)  # inspect.unwrap finds what fn closes over (state.closure_generators)
        def call(*args, **kwargs):
            nonlocal first
            if not first:
                return fn(*args, **kwargs)
            lead, first, hook = run.lead, False, sys.unraisablehook

            def dropped(unraisable):
                if not isinstance(unraisable.exc_value, StopCompile):
                    return hook(unraisable)
                main = threading.main_thread().ident  # to the main thread: it may wait in a call (for g++)
                send = functools.partial(signal.pthread_kill, main) if hasattr(signal, "pthread_kill") else signal.raise_signal
                threading.Timer(0.01, send, (lead.stop_signal,)).start()

            try:
                if lead.stop_signal is None:  # a stop before the compile skips it
                    lead.compiling, sys.unraisablehook = True, dropped
                    return fn(*args, **kwargs)
            # (A signal in the ms between the compile's end and the call's return runs the call twice.)
            except StopCompile:
                pass
            finally:
                lead.compiling, sys.unraisablehook = False, hook
            torch.compiler.set_stance("force_eager")
            return eager(*args, **kwargs)

        return call

    return tuple(map(wrap, fns)) if len(fns) > 1 else wrap(fns[0])

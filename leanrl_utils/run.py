"""The run recorder: runs/<run_name> (TensorBoard, curve.csv, checkpoints, resume.pt), wandb, the
progress bar, steps/s, stop signals. It records what the script's loop tells it."""

import importlib.util
import itertools
import math
import os
import signal
import sys
import time
from collections import deque
from contextlib import suppress

import numpy as np
import torch
import tqdm

from leanrl_utils import checkpoints, resume, speed, state, summary
from leanrl_utils.checks import fail
from leanrl_utils.vector import ended_episodes

CURVE_HEADER = "step,seconds,episodic_return\n"


class Run:
    """One seed's records (under torchrun, rank 0 writes); `resumed`: `resume.read`'s checkpoint. With
    --num-seeds the first seed's Run, the lead, takes the signals and shows the bar and summary.
    The folder is made at the first log point or save: a run refused before leaves none."""

    def __init__(self, args, total_steps, script, resumed=None, rank=0, lead=None, warmup_updates=3):
        self.args, self.total_steps, self.warmup_updates = args, total_steps, warmup_updates
        self.rank, self.rank0 = rank, rank == 0
        self.script, self.algorithm = os.path.basename(script), checkpoints.algorithm_of(script)
        self.lead, self.seeds, self.resumed = lead or self, [self], resumed
        if lead:
            lead.seeds.append(self)
        mine = resumed["seeds"][len(self.lead.seeds) - 1] if resumed else {}
        self.time = lead.time if lead else resumed["time"] if resumed else int(time.time())
        self.name = mine.get("name", f"{args.env_id}__{args.exp_name}__{args.seed}__{self.time}")
        self.dir = f"runs/{self.name}"
        if resumed:  # a resumed run writes on in its folder, wherever it is (each seed's beside the lead's)
            self.dir = os.path.join(os.path.dirname(resumed["dir"]), self.name) if lead else resumed["dir"]
        self.step, self.updates = mine.get("step", 0), mine.get("updates", 0)
        self.returns, self.points = deque(mine.get("returns", []), maxlen=10), []
        self.offset_s, self.start = resumed["wall_s"] if resumed else 0.0, time.perf_counter()
        self.warm_time, self.warm_step = self.start, 0
        self.curve = self.writer = self.wandb = self.bar = self.warmup_s = self.last_sps = self.last_good = None
        self.stop_reason = self.save_error = self.resume_error = self.stop_signal = self.iteration = self.loop = None
        self.objects, self.eval_return, self.due, self.ran, self.compiling = {}, None, time.perf_counter(), 0, False
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if args.track and self.rank0 and importlib.util.find_spec("wandb") is None:
            fail("--track needs wandb: pip install wandb (or the extra leanrl[track])")
        if not lead:
            signal.signal(signal.SIGTERM, self.on_signal)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # not where a shell ignores it
                signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum, frame):
        """Ctrl-C and SIGTERM: noted, acted on at the loop's next `checkpoint`; a cold compile ends
        here (`speed.interruptible`). Further signals change nothing else."""
        self.stop_signal = self.stop_signal or signal.Signals(signum)
        if self.compiling:
            raise speed.StopCompile

    def open(self):
        """The folder and writers, at the first need: a new folder (<name>__2, __3... when taken), or
        the resumed one cut back to the saved point."""
        if self.curve is not None:
            return
        if not self.rank0:
            self.curve = open(os.devnull, "w")
            return
        mine = self.resumed["seeds"][self.lead.seeds.index(self)] if self.resumed else None
        try:
            if mine:
                os.makedirs(self.dir, exist_ok=True)
                self.lock = self.resumed["lock"] if self is self.lead else resume.hold(self.dir)
                self.curve = self.reopen_curve(mine["curve_bytes"])
                for name in os.listdir(self.dir):
                    if name.startswith("events.out.tfevents"):
                        with open(f"{self.dir}/{name}", "r+b") as events:
                            events.truncate(mine["events"].get(name, 0))
            else:
                base = self.name
                for k in itertools.count(2):
                    try:
                        os.makedirs(self.dir)
                        break
                    except FileExistsError:
                        self.name, self.dir = f"{base}__{k}", f"runs/{base}__{k}"
                self.lock = resume.hold(self.dir)
                self.curve = open(f"{self.dir}/curve.csv", "w", buffering=1)  # line-buffered: each row at once
                self.curve.write(CURVE_HEADER)
        except OSError as e:
            fail(f"cannot write {self.dir} ({e.strerror}): run from a folder you can write to")
        try:
            from torch.utils.tensorboard import SummaryWriter

            # max_queue: a log point's burst of scalars waits in the queue, where a short one hands the
            # GIL to the writer thread at every event. An absolute path: the thread may outlive a chdir.
            self.writer = SummaryWriter(os.path.abspath(self.dir), max_queue=1000)
            if not mine:
                table = "\n".join(f"|{k}|{v}|" for k, v in vars(self.args).items())
                self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        except ImportError:
            if self.lead is self:
                print(
                    "notice: tensorboard is not installed; metrics go to --track only (pip install tensorboard)",
                    file=sys.stderr,
                )
        if self.args.track:
            import wandb

            # Several runs live at once only with reinit="create_new" (wandb 0.19.10 or later).
            kw = {"group": self.lead.name, "reinit": "create_new"} if len(self.lead.seeds) > 1 else {}
            kw.update({"id": mine["wandb_id"], "resume": "allow"} if mine and mine.get("wandb_id") else {})
            a = self.args
            self.wandb = wandb.init(project=a.wandb_project_name, entity=a.wandb_entity, config=vars(a), name=self.name, **kw)

    def reopen_curve(self, saved_bytes):
        """curve.csv cut back to the checkpoint; one missing or short is rebuilt, and said."""
        path = f"{self.dir}/curve.csv"
        rows = open(path).read().splitlines(keepends=True) if os.path.exists(path) else []
        if sum(map(len, rows)) >= saved_bytes and rows[:1] == [CURVE_HEADER]:
            curve = open(path, "a", buffering=1)
            curve.truncate(saved_bytes)
            return curve
        rows = [row for row in rows if row != CURVE_HEADER and row.endswith("\n") and row.count(",") == 2]
        print(f"notice: {path} was missing or short; rebuilt with its header and {len(rows)} rows", file=sys.stderr)
        curve = open(path, "w", buffering=1)
        curve.write("".join([CURVE_HEADER, *rows]))
        return curve

    def load(self, networks):
        """--load-model into `networks` (name -> module)."""
        checkpoints.load(self.args.load_model, networks, self.args.env_id, self.algorithm)

    def resume(self, objects, loop, device="cpu"):
        """What resume.pt holds: `objects` (name -> module, optimizer, buffer, envs; False: none) and
        `loop()`, the loop's variables, env step first. Returns them resumed (tensors on `device`),
        with the random streams and each rank's own state, or `loop()` without --resume."""
        self.objects, self.loop = {name: obj for name, obj in objects.items() if obj is not False}, loop
        if not self.resumed:
            return loop()
        mine = self.resumed["ranks"][self.rank - 1] if self.rank else self.resumed
        try:
            for name, obj in self.objects.items():
                state.restore(obj, mine["objects"][name])
        except (KeyError, RuntimeError, ValueError, IndexError) as e:
            fail(f"--resume {self.args.resume}: its state does not fit this run ({type(e).__name__}); start anew")
        state.set_random_state(mine["random"])
        loop = tuple(state.from_plain(v, device) for v in mine["loop"]["__tuple__"])
        if self.rank0:
            print(f"notice: resuming {self.dir} from step {int(loop[0])}", file=sys.stderr)
        return loop

    def checkpoint(self, iteration):
        """At each iteration's start: resume.pt when stopped or --checkpoint-every is due. True: stop
        the loop (every rank at once)."""
        every = getattr(self.args, "checkpoint_every", 0)
        stop = self.stop_signal is not None
        save = stop or bool(every and time.perf_counter() - self.due >= every)
        if self.world_size > 1:  # every rank stops and saves at the same iteration, or the others wait
            import torch.distributed as dist

            flags = torch.tensor([float(stop), float(save)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop, save = bool(flags[0]), bool(flags[1])  # note: a host sync, once per iteration
            self.stop_signal = self.stop_signal or (signal.SIGTERM if stop else None)
        self.iteration, self.ran = iteration, self.ran + (not stop)  # the iterations this process ran
        if save:
            resume.save(self, iteration, finished=False)
            self.due = time.perf_counter()
        return stop

    def episodes(self, step, infos):
        """CleanRL's charts, one point per finished episode in a vector env's `infos`."""
        for _, r, n in ended_episodes(step, infos):
            self.record(step, r, n)

    def record(self, step, r, n):
        self.returns.append(r)
        self.points.append((step, {"charts/episodic_return": r, "charts/episodic_length": n}))

    def write(self, then=None):
        """The points since the last log point, to TensorBoard and wandb, then the TensorBoard writer's
        `then` ("flush", "close"); a failing writer is said in one line and dropped."""
        try:
            for step, values in self.points:
                for k, v in values.items() if self.writer else ():
                    self.writer.add_scalar(k, v, step)  # TensorBoard's thread raises its errors here
                if self.wandb:
                    self.wandb.log(values, step=step)
            if then and self.writer:
                getattr(self.writer, then)()  # and here
        except Exception as e:
            self.write_failed("TensorBoard events", e)
            with suppress(Exception):
                self.writer.close()
            self.writer = None
        self.points.clear()

    def write_failed(self, what, e):
        # tqdm.write: a line of its own, not glued to the progress bar's
        tqdm.tqdm.write(f"error: cannot write {what} in {self.dir} ({checkpoints.why(e)}); training goes on", file=sys.stderr)

    def write_curve(self, line):
        try:
            self.curve.write(line)
        except OSError as e:
            self.write_failed("curve.csv", e)
            self.curve = open(os.devnull, "w")

    def mean_return(self):
        """The mean return of the last 10 episodes, None before the first."""
        return float(np.mean(self.returns)) if self.returns else None

    def log(self, step, updates, metrics, networks):
        """A log point: steps/s (once `warmup_updates` have run), bar, curve, metrics, and with
        --save-model the weights if finite."""
        self.open()
        seeds = len(self.seeds)
        if self.bar is None:
            hidden = not self.rank0 or self.lead is not self
            self.bar = tqdm.tqdm(total=self.total_steps * seeds, initial=self.step * seeds, file=sys.stderr, disable=hidden)
        self.bar.update((step - self.step) * seeds)
        self.step, self.updates, now = step, updates, time.perf_counter()
        if self.warmup_s is None and updates >= self.warmup_updates:
            self.warmup_s, self.warm_step, self.warm_time = now - self.start, step, now
        # The summary's steps/s is the last log point's: closing envs and saving are not training.
        warm = self.warmup_s is not None and step > self.warm_step
        sps = self.last_sps = (step - self.warm_step) / (now - self.warm_time) if warm else None
        means = [m for m in (run.mean_return() for run in self.seeds) if m is not None]
        self.bar.set_description(f"sps={(sps or math.nan) * seeds:6.0f} return={np.mean(means) if means else math.nan:8.2f}")
        if self.returns:
            self.write_curve(f"{step},{now - self.start + self.offset_s:.3f},{self.mean_return():.3f}\n")
        self.points.append((step, {**metrics, "charts/SPS": sps or 0.0}))
        self.write()
        if self.args.save_model:
            state = {name: {k: v.detach().clone() for k, v in net.state_dict().items()} for name, net in networks.items()}
            if checkpoints.finite(state):
                self.last_good = state

    def finish(self, step, updates, networks, evaluate, **fields):
        """Save, evaluate, close and print the summary (the lead, for every seed, last): `summary.finish`."""
        summary.finish(self, step, updates, networks, evaluate, fields)

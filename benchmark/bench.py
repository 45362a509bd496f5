"""The LeanRL benchmark: every pair of scripts, every mode, over seeds, with ceilings.

For each family (a plain script and its `_torchcompile` twin) it runs the plain script and the
lean script in four modes (eager, compile, cudagraphs, compile+cudagraphs) with the same
hyper-parameters and budget, collects the one-line JSON summaries into `results.jsonl`,
measures two ceilings, and writes `table.md` and PNG plots. On a machine without CUDA the
cudagraphs modes are reported as not applicable, never run as something else.

Ceilings:
- env: the same environment, stepped with random actions through the same vector API and
  number of envs, no learning (steps per second);
- arithmetic (off-policy families): the matrix multiplies of one training step, recorded from
  a short run of the plain script and replayed in a tight loop (steps per second if a step
  cost nothing else).

Noise: every run and every ceiling is pinned to one core beside a probe of that core's speed;
speeds are also given at a fixed reference core speed, and each median comes with a repeat
band, where a rerun's median should fall (REFERENCE_CORE_SPEED and repeat_bands below).

Usage: see `./run.sh --help`.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"
# Every run, plain or lean, uses one intra-op thread. On 2 cores the networks here are too small
# for a second thread to pay, and when anything else runs, OpenMP's spinning threads stall:
# a 0.7 ms PPO minibatch step took 46 ms with two threads beside one busy process.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MODES = {
    "eager": [],
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}

# Per family: the env, the hyper-parameters every mode shares, and the budget (total env
# steps) of each profile. "quick" finishes the whole benchmark in minutes (the README's table);
# "full" measures over longer budgets. "tiny" is for the benchmark's own test.
FAMILIES = {
    "ppo_continuous_action": {
        "env_id": "HalfCheetah-v5",
        "num_envs": 1,
        "args": ["--num-steps", "2048"],
        # Iterations of 2048 steps, the first of them warm-up: full 11 (20,480 steps measured),
        # quick 3 (4,096 measured).
        "budget": {"full": 22528, "quick": 6144, "tiny": 256},
        "tiny_args": ["--env-id", "InvertedPendulum-v5", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2"],
        "off_policy": False,
    },
    "sac_continuous_action": {
        "env_id": "HalfCheetah-v5",
        "num_envs": 1,
        "args": ["--learning-starts", "1000"],
        # Updates after learning starts: full 6,000, quick 300. Timing starts at the first log
        # line after the first two updates (step 1,100), so quick measures 200 steps.
        "budget": {"full": 7000, "quick": 1300, "tiny": 200},
        "tiny_args": ["--env-id", "Pendulum-v1", "--learning-starts", "64", "--batch-size", "32"],
        "off_policy": True,
    },
    "td3_continuous_action": {
        "env_id": "HalfCheetah-v5",
        "num_envs": 1,
        "args": ["--learning-starts", "1000"],
        "budget": {"full": 7000, "quick": 1300, "tiny": 200},
        "tiny_args": ["--env-id", "Pendulum-v1", "--learning-starts", "64", "--batch-size", "32"],
        "off_policy": True,
    },
    "dqn": {
        "env_id": "CartPole-v1",
        "num_envs": 1,
        "args": ["--learning-starts", "1000"],
        "budget": {"full": 20000, "quick": 12000, "tiny": 300},
        "tiny_args": ["--learning-starts", "100", "--batch-size", "32"],
        "off_policy": True,
    },
    "ppo_atari_envpool": {
        "env_id": "Breakout-v5",
        "num_envs": 8,
        "args": [],
        # Iterations of 8 x 128 steps, the first of them warm-up: full 12 (11,264 steps
        # measured), quick 2 (1,024 measured).
        "budget": {"full": 12288, "quick": 2048, "tiny": 64},
        "tiny_args": ["--num-envs", "2", "--num-steps", "16"],
        "off_policy": False,
    },
}


def family_of(path):
    return Path(path).stem.removesuffix("_torchcompile")


def machine():
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version()}


def plan(families, seeds, profile, cuda):
    """The list of runs: (family, script, mode, seed, argv). Cudagraphs modes without CUDA are
    returned separately as not applicable."""
    runs, skipped = [], []
    # Seeds are the outer loop: on a shared host the machine's speed drifts by tens of percent
    # over minutes, so the seeds of one cell run minutes apart and its min-max shows that drift
    # instead of one slow or fast stretch deciding a whole family. A plain run and the lean runs
    # of the same seed stay next to each other, for the paired speed-up.
    for seed in seeds:
        for fam in families:
            cfg = FAMILIES[fam]
            base = ["--total-timesteps", str(cfg["budget"][profile])]
            base += cfg["tiny_args"] if profile == "tiny" else ["--env-id", cfg["env_id"], *cfg["args"]]
            plain, lean = SCRIPTS / f"{fam}.py", SCRIPTS / f"{fam}_torchcompile.py"
            runs.append((fam, plain, "plain", seed, [*base, "--seed", str(seed)]))
            for mode, flags in MODES.items():
                if "cudagraphs" in mode and not cuda:
                    if seed == seeds[0]:
                        skipped.append((fam, lean, mode))
                    continue
                runs.append((fam, lean, mode, seed, [*base, "--seed", str(seed), *flags]))
    return runs, skipped


# The host this benchmark was built on changes the speed of each core by up to 2x over minutes
# (one core's matmul loop ran at 2,300 and then 3,100 units/s two minutes apart), and the two
# cores drift independently. A probe on the same core as the run tracks it (correlation 0.98
# over 2 s windows); a probe on the other core does not (correlation near 0). So every run and
# every ceiling runs pinned to one core, a small probe shares that core, and each speed is also
# given at a fixed reference core speed: steps/s x (REFERENCE_CORE_SPEED / the probe's mean
# during the run's measured window) ** the cell's ELASTICITY. Repeated runs of DQN and TD3
# varied by 13% and 17% in raw steps/s, and by 5% and 4% at the reference speed (exponent 1).
REFERENCE_CORE_SPEED = 350.0  # probe units per CPU-second: a typical core speed of this host
# How far each cell's steps/s move with the probe's speed on this host: the slope of log steps/s
# against log core speed over its 20 runs in four quick benchmarks (D1-D4, in
# benchmark/results/calibration; `./run.sh --fit-elasticity` prints such a fit). No probe moves
# exactly like every workload: the matmul-bound SAC, TD3 and Atari PPO move less than the probe
# (0.8-0.9), DQN and PPO on MuJoCo more (1.16-1.32), compiled DQN most (1.46). Dividing by the
# probe alone left compiled DQN's steps/s moving with the core as speed ** 0.46, and medians of
# benchmarks that met cores 20% apart missed each other's bands by 11-16%. Slopes fitted to two
# of the four runs kept every median of the other two inside the other's band (90 of 90 cells
# over the six pairs); four later benchmarks with these slopes, 78 of 90 (45 of 45 among the
# first three; the fourth met a slower, noisier host, see README "Does it repeat?"), against 83 of
# 90 with an exponent of 1. A cell without an entry (the cudagraphs modes) uses 1.0. On another
# machine, fit them again.
ELASTICITY = {
    ("ppo_continuous_action", "plain"): 1.31,
    ("ppo_continuous_action", "eager"): 1.27,
    ("ppo_continuous_action", "compile"): 1.32,
    ("sac_continuous_action", "plain"): 0.86,
    ("sac_continuous_action", "eager"): 0.89,
    ("sac_continuous_action", "compile"): 0.83,
    ("td3_continuous_action", "plain"): 0.91,
    ("td3_continuous_action", "eager"): 0.88,
    ("td3_continuous_action", "compile"): 0.80,
    ("dqn", "plain"): 1.16,
    ("dqn", "eager"): 1.19,
    ("dqn", "compile"): 1.46,
    ("ppo_atari_envpool", "plain"): 0.82,
    ("ppo_atari_envpool", "eager"): 0.91,
    ("ppo_atari_envpool", "compile"): 0.90,
}
PROBE_PERIOD_S = 0.25  # 6-9 ms of probe work every 0.25 s: 2-3.5% of the core, for every mode alike
PROBE = r"""
import sys, time, torch
torch.set_num_threads(1)
a, s = torch.randn(256, 256), torch.randn(64)
def matmuls():
    for _ in range(10):
        torch.mm(a, a)
def small_ops():  # the dispatcher-bound work of small networks
    for _ in range(300):
        s.add(1.0).mul_(0.5)
def rate(work):
    # per CPU-second of this thread, so sharing the core with the run does not lower it
    start = time.thread_time()
    work()
    return 1.0 / (time.thread_time() - start)
for _ in range(3):
    matmuls(), small_ops()
while True:
    # matmul-bound (SAC, TD3) and dispatcher-bound (DQN) scripts slow down with a host by
    # different amounts; the geometric mean of the two tracks both
    print(f"{time.monotonic():.3f} {(rate(matmuls) * rate(small_ops)) ** 0.5:.2f}", flush=True)
    time.sleep(float(sys.argv[1]))
"""


@contextlib.contextmanager
def pinned(core):
    """Pin the calling thread to one core (processes and threads it starts inherit it)."""
    if core is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class CoreProbe:
    """The probe process on `core`, sampled in the background: `speed(start, end)` is its mean
    over a window of time.monotonic() seconds (None without a reading in or near it)."""

    def __init__(self, core, wait_s=60.0):
        with pinned(core):
            self.proc = subprocess.Popen([sys.executable, "-c", PROBE, str(PROBE_PERIOD_S)], stdout=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
        self.samples = []
        threading.Thread(target=self._read, daemon=True).start()
        # the first run's timed window must not start before the probe's first reading
        deadline = time.monotonic() + wait_s
        while not self.samples and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.samples:
            self.close()
            raise RuntimeError(f"the core-speed probe gave no reading within {wait_s:.0f} s (is torch importable by {sys.executable}?)")

    def _read(self):
        for line in self.proc.stdout:
            try:
                t, speed = map(float, line.split())
            except ValueError:  # a stray line (a warning) is not a reading
                continue
            self.samples.append((t, speed))

    def speed(self, start, end):
        samples = list(self.samples)
        inside = [v for t, v in samples if start <= t <= end]
        if inside:
            return statistics.mean(inside)
        # a window shorter than the probe's period: the reading nearest to it, if close
        middle = (start + end) / 2
        near = [(abs(t - middle), v) for t, v in samples if abs(t - middle) < 2 * PROBE_PERIOD_S]
        return min(near)[1] if near else None

    def close(self):
        self.proc.kill()
        self.proc.wait()


def at_reference(sps, core_speed, elasticity=1.0):
    """Steps per second at REFERENCE_CORE_SPEED, or None without a probe reading."""
    return sps * (REFERENCE_CORE_SPEED / core_speed) ** elasticity if core_speed else None


def with_reference(measured, probe, window):
    """A run's record or a ceiling's measurement with the core's speed over `window` (seconds
    of time.monotonic()) and its steps/s at the reference core speed, as `speed` works it out
    (None without a reading)."""
    core_speed = probe.speed(*window)
    record = {**measured, "core_speed": core_speed and round(core_speed, 2)}
    return {**record, "sps_ref": round(speed(record), 1) if core_speed else None}


def fit_elasticity(results):
    """Per cell with at least three probed runs: the least-squares slope of log steps/s against
    log core speed, its standard error and the number of runs (ELASTICITY holds such slopes)."""
    points = {}
    for r in results:
        if r.get("core_speed") and r.get("sps"):
            points.setdefault((r["family"], r["mode"]), []).append((math.log(r["core_speed"]), math.log(r["sps"])))
    fits = {}
    for key, xy in points.items():
        n = len(xy)
        if n < 3:
            continue
        mx, my = statistics.fmean(x for x, _ in xy), statistics.fmean(y for _, y in xy)
        sxx = sum((x - mx) ** 2 for x, _ in xy)
        if sxx == 0:  # every run met the same core speed: no slope to see
            continue
        slope = sum((x - mx) * (y - my) for x, y in xy) / sxx
        residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in xy)
        fits[key] = (slope, math.sqrt(residual / (n - 2) / sxx), n)
    return fits


def run_one(script, argv, log_dir, timeout, core):
    """Run one script pinned to `core`; return its summary dict (None if it failed), the log
    path, and the time.monotonic() at which its summary line arrived (the end of its training)."""
    log = log_dir / f"{script.stem}__{'_'.join(a.strip('-') for a in argv[-3:])}.log"
    env = {**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    summary, done_at = None, None
    with open(log, "w") as err:
        with pinned(core):
            # its own process group, so that a timeout also stops anything it started
            proc = subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=log_dir, start_new_session=True)
        kill = lambda: os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None  # noqa: E731
        timer = threading.Timer(timeout, kill)
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    summary, done_at = line, time.monotonic()
            proc.wait()
        finally:  # on Ctrl-C too: no run is left behind (after a normal end, kill does nothing)
            timer.cancel()
            kill()
            proc.wait()
    if proc.returncode != 0 or summary is None:
        return None, log, None
    summary = json.loads(summary)
    if summary.get("sps") is None or summary.get("warmup_s") is None:  # a budget too small to time
        return None, log, None
    return summary, log, done_at


def env_ceiling(env_id, num_envs, envpool_env=False, seconds=5.0):
    """Steps per second of the env alone: random actions, no learning, same vector API; and the
    time.monotonic() window it was timed over."""
    import numpy as np

    if envpool_env:
        import envpool

        envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=1)
        n_act = envs.action_space.n
        envs.reset()
        step = lambda: envs.step(np.random.randint(0, n_act, num_envs))  # noqa: E731
    else:
        import gymnasium as gym

        envs = gym.vector.SyncVectorEnv(
            [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(env_id)) for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        envs.action_space.seed(1)
        envs.reset(seed=1)
        step = lambda: envs.step(envs.action_space.sample())  # noqa: E731
    for _ in range(100):
        step()
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(100):
            step()
        steps += 100 * num_envs
    end = time.monotonic()
    envs.close()
    return {"sps": steps / (end - start), "window": [start, end]}


RECORD_MATMULS = r"""
import json, runpy, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
out, script, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
aten = torch.ops.aten
MM = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
seen = []
class Record(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MM:
            mats = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            seen.append([func.__name__, [list(m.shape) for m in mats], [m.stride(-1) != 1 for m in mats]])
        return func(*args, **(kwargs or {}))
import contextlib, io
buf = io.StringIO()
sys.argv = [script, *argv]
with Record(), contextlib.redirect_stdout(buf):
    runpy.run_path(script, run_name="__main__")
summary = json.loads(buf.getvalue().strip().splitlines()[-1])
json.dump({"matmuls": seen, "summary": summary}, open(out, "w"))
"""


def arithmetic_ceiling(family, work_dir, seconds=3.0):
    """Steps per second if a training step cost only its matrix multiplies.

    A short eager run of the plain script records every matmul (shapes and transposition);
    those after learning starts are replayed in a tight loop, and the time per step follows
    from the number of env steps they served."""
    import torch

    cfg = FAMILIES[family]
    # The acting forwards of the first `learning_starts` steps are recorded too: single-row
    # matmuls, well under 1% of the replay time.
    learning_starts, train_steps = 256, 300
    out = (work_dir / f"matmuls_{family}.json").resolve()
    argv = ["--env-id", cfg["env_id"], "--learning-starts", str(learning_starts), "--total-timesteps", str(learning_starts + train_steps)]
    subprocess.run([sys.executable, "-c", RECORD_MATMULS, str(out), str(SCRIPTS / f"{family}.py"), *argv], check=True, cwd=work_dir, capture_output=True, env={**os.environ, **ONE_THREAD, "WANDB_MODE": "disabled"})
    torch.set_num_threads(1)  # as the runs it is compared with
    mats = []
    for name, shapes, transposed in json.loads(out.read_text())["matmuls"]:
        pair = []
        for shape, t in zip(shapes, transposed):
            x = torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2) if t else torch.randn(*shape)
            pair.append(x)
        mats.append((torch.bmm if len(shapes[0]) == 3 else torch.mm, pair))
    for fn, (a, b) in mats:
        fn(a, b)
    reps, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        for fn, (a, b) in mats:
            fn(a, b)
        reps += 1
    end = time.monotonic()
    per_pass = (end - start) / reps
    flops = sum(2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1) for _, (a, b) in mats)
    # One pass replays every update of the recorded run: `train_steps` env steps' worth.
    return {"sps": train_steps * cfg["num_envs"] / per_pass, "gflop_per_step": flops / train_steps / 1e9, "gflops": flops / per_pass / 1e9, "window": [start, end]}


def run_all(runs, out, timeout, probe, core, then=""):
    """Run every planned run in turn with a progress line; append each summary to results.jsonl.
    `then` names what follows the runs, for the time-left estimate, which counts the runs only."""
    results, start = [], time.perf_counter()
    with open(out / "results.jsonl", "w") as sink:
        for i, (fam, script, mode, seed, run_argv) in enumerate(runs, 1):
            elapsed = time.perf_counter() - start
            eta = f", about {fmt_duration(elapsed / (i - 1) * (len(runs) - i + 1))} left{then}" if i > 1 else ""
            print(f"[{i}/{len(runs)}] {script.name} {mode} seed {seed} (elapsed {fmt_duration(elapsed)}{eta})", flush=True)
            summary, log, done_at = run_one(script, run_argv, out / "logs", timeout, core)
            if summary is None:
                print(f"  failed: see {log}", flush=True)
                continue
            window = (done_at - (summary["wall_s"] - summary["warmup_s"]), done_at)
            record = with_reference({"family": fam, "mode": mode, **summary}, probe, window)
            sps_ref = record["sps_ref"]
            if sps_ref is None:
                print("  no core-speed reading during this run: the table uses its raw steps/s", flush=True)
            results.append(record)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            at_ref = f" ({sps_ref:,.0f} at the reference core speed)" if sps_ref else ""
            print(f"  {summary['sps']:,.0f} steps/s after warm-up{at_ref}, warm-up {summary['warmup_s']:.1f} s, return {summary['episodic_return']}", flush=True)
    return results


def fmt_duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def read_ceilings(path):
    """The ceilings and machine saved beside a results.jsonl (measured with those runs, on the
    same machine). Folders from before the core probe stored a bare `env_sps`."""
    saved = json.loads(Path(path).read_text())
    ceilings = {fam: {"env": {"sps": c.pop("env_sps")}, **c} if "env_sps" in c else c for fam, c in saved["ceilings"].items()}
    return ceilings, saved["machine"]


def read_results(path):
    """The records of a results.jsonl, one per run."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# Two-sided 99% quantiles of Student's t by degrees of freedom; between keys the smaller key's
# (larger) value is used, beyond 30 the normal's.
T_99 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250, 10: 3.169, 15: 2.947, 20: 2.845, 30: 2.750}


def t_99(dof):
    return T_99[max(k for k in T_99 if k <= dof)] if dof <= 30 else 2.576


def repeat_bands(cells, drift=0.0):
    """Per cell (key -> steps/s of its runs): the half-width of the band around its median in
    which a rerun's median should fall (99%); None for a cell of one run. `drift`: the host's
    run-to-run drift of a median (relative standard deviation, see host_drift).

    The min-max over seeds is not such a band: for two runs of five seeds of pure, independent
    noise, each median lies inside the other's min-max in a given cell 72% of the time, and in
    all 15 cells of the table 0.6% of the time (simulated). The median of n runs has a standard
    error of about sqrt(pi/2) * s / sqrt(n) (s: the standard deviation over seeds), the
    difference of two runs' medians sqrt(2) times that; Student's t at 99% would make 15 cells
    hold together about 86% of the time (0.99 ** 15) if each band were exact (`compare` asks for
    each median inside the other's band, which is stricter). Five seeds can also agree by chance (five TD3
    runs within 2% of each other, then a rerun 5% off), so no band is narrower than the one the
    relative spread pooled over all cells of the benchmark gives.

    The spread over seeds is all within one benchmark; a rerun also meets another state of the
    host, which moves every run of a cell together. Each of the two medians carries its own such
    shift, so that part adds 2.576 * sqrt(2) * drift in quadrature."""
    spread = {key: statistics.stdev(v) / statistics.mean(v) for key, v in cells.items() if len(v) > 1}
    dof = sum(len(cells[key]) - 1 for key in spread)
    pooled = math.sqrt(sum((len(cells[key]) - 1) * sd**2 for key, sd in spread.items()) / dof) if dof else 0.0
    bands = {}
    for key, values in cells.items():
        n = len(values)
        if n < 2:
            bands[key] = None
            continue
        relative = max(t_99(n - 1) * spread[key], t_99(dof) * pooled) * math.sqrt(math.pi / 2) * math.sqrt(2 / n)
        relative = math.hypot(relative, 2.576 * math.sqrt(2) * drift)
        bands[key] = relative * statistics.median(values)
    return bands


# Earlier quick benchmarks of this project's machine, all of one version of the scripts, from
# which host_drift works out the host's run-to-run drift for the repeat bands (README, "Does it
# repeat?"). Runs of another machine, or of an unknown one (no ceilings.json beside them), are
# not used.
DRIFT_RUNS = [f"benchmark/results/calibration/D{i}" for i in range(1, 5)] + [f"benchmark/results/repeats/E{i}" for i in range(1, 5)]


def host_drift(histories):
    """The relative standard deviation by which a cell's median moves from one benchmark to the
    next beyond what its spread over seeds explains, pooled over the cells of earlier runs of
    the same scripts (`histories`: lists of records, one per benchmark): the variance of the
    log medians between benchmarks minus the mean sampling variance of one median. Also returns
    the number of benchmarks it came from; (0.0, n) below two."""
    logs, sampling = {}, {}
    for results in histories:
        for key, cell in by_cell(results).items():
            values = [speed(r) for r in cell]
            if len(values) > 1:
                logs.setdefault(key, []).append(math.log(statistics.median(values)))
                sampling.setdefault(key, []).append(math.pi / 2 * (statistics.stdev(values) / statistics.mean(values)) ** 2 / len(values))
    cells = [key for key, medians in logs.items() if len(medians) > 1]
    dof = sum(len(logs[key]) - 1 for key in cells)
    if not dof:
        return 0.0, len(histories)
    between = sum((x - statistics.fmean(logs[key])) ** 2 for key in cells for x in logs[key]) / dof
    within = statistics.fmean(v for key in cells for v in sampling[key])
    return math.sqrt(max(0.0, between - within)), len(histories)


def drift_of_machine(info, skip=()):
    """host_drift over the DRIFT_RUNS measured on the machine `info` describes (CPU, cores, GPU),
    leaving out the results files in `skip` (a run is not its own history)."""
    histories, skipped = [], {Path(p).resolve() for p in skip}
    for folder in DRIFT_RUNS:
        path = ROOT / folder / "results.jsonl"
        if not path.exists() or not (path.parent / "ceilings.json").exists() or path.resolve() in skipped:
            continue
        _, saved = read_ceilings(path.parent / "ceilings.json")
        if all(saved.get(k) == info.get(k) for k in ("cpu", "cores", "gpu")):
            histories.append(read_results(path))
    return host_drift(histories)


def speed(record):
    """A run's steps per second at the reference core speed, worked out again from its raw steps/s
    and core speed with ELASTICITY as it is now (so saved results follow a refit); its raw steps
    per second if it has no probe reading (results from before the probe, or a failed probe).
    Ceilings have no cell and use 1.0."""
    elasticity = ELASTICITY.get((record.get("family"), record.get("mode")), 1.0)
    return at_reference(record["sps"], record.get("core_speed"), elasticity) or record["sps"]


def by_cell(results):
    """The records grouped by cell, (family, mode), in the order they first appear."""
    cells = {}
    for r in results:
        cells.setdefault((r["family"], r["mode"]), []).append(r)
    return cells


def summarize(results, skipped, ceilings, info, drift=(0.0, 0)):
    """The Markdown table: per family and mode, the median over seeds and its min-max.
    `drift`: host_drift's (relative drift, number of benchmarks) for the repeat bands."""
    rows = [
        f"Machine: {info['cpu']}, {info['cores']} cores, GPU: {info['gpu'] or 'none'}; torch {info['torch']}, Python {info['python']}.",
        f"Command: `{info['command']}` (profile `{info['profile']}`, seeds {info['seeds']}).",
        "",
        "| algorithm | script | mode | steps/s at reference core speed (median) | repeat band (99%) | min-max | raw steps/s (median) | vs plain | of env ceiling | of arithmetic ceiling | warm-up s | peak RSS MB | return (median) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = by_cell(results)
    speeds = {key: [speed(r) for r in cell] for key, cell in cells.items()}
    bands = repeat_bands(speeds, drift[0])
    for fam in dict.fromkeys(r["family"] for r in results):
        plain_sps = {r["seed"]: speed(r) for r in cells.get((fam, "plain"), [])}
        ceil = ceilings.get(fam, {})
        for mode in ["plain", *MODES]:
            if any(s[0] == fam and s[2] == mode for s in skipped):
                rows.append(f"| {fam} | {fam}_torchcompile.py | {mode} | n/a (needs CUDA) | | | | | | | | | |")
                continue
            cell = cells.get((fam, mode))
            if not cell:
                continue
            sps = speeds[(fam, mode)]
            med = statistics.median(sps)
            band = bands[(fam, mode)]
            paired = [speed(r) / plain_sps[r["seed"]] for r in cell if r["seed"] in plain_sps]
            returns = [r["episodic_return"] for r in cell if r["episodic_return"] is not None]
            cols = [
                fam,
                cell[0]["script"],
                mode,
                f"{med:,.0f}",
                f"±{band / med:.1%}" if band is not None else "",
                f"{min(sps):,.0f}-{max(sps):,.0f}",
                f"{statistics.median([r['sps'] for r in cell]):,.0f}",
                f"{statistics.median(paired):.2f}x" if paired else "",
                f"{med / speed(ceil['env']):.0%}" if ceil.get("env") else "",
                f"{med / speed(ceil['arith']):.0%}" if ceil.get("arith") else "",
                f"{statistics.median([r['warmup_s'] for r in cell]):.1f}",
                f"{max(r['peak_rss_mb'] for r in cell):,.0f}",
                f"{statistics.median(returns):.1f}" if returns else "",
            ]
            rows.append("| " + " | ".join(cols) + " |")
    rows += [
        "",
        f"Each run and each ceiling ran pinned to one core beside a probe that measures that core's speed; steps/s at the reference core speed are raw steps/s x ({REFERENCE_CORE_SPEED:g} / the probe's mean over the run's timed window) ** e, the probe in units per CPU-second and e the cell's ELASTICITY in benchmark/bench.py (1.0 for ceilings).",
        "repeat band: the noise band of each median, where a rerun's median should fall (99%; from the spread over seeds and the host's drift between benchmarks, see `repeat_bands` in benchmark/bench.py). "
        + (f"The host's drift, {drift[0]:.1%} per median, is worked out from {drift[1]} earlier benchmarks of this machine (DRIFT_RUNS). " if drift[1] > 1 else "Fewer than two earlier benchmarks of this machine (DRIFT_RUNS): the bands leave out the host's drift between benchmarks. ")
        + "min-max: over seeds. vs plain: the median over seeds of each run's steps/s over the plain script's run of the same seed, run just before it.",
    ]
    unprobed = sum(not r.get("core_speed") for r in results)
    if unprobed:
        rows += ["", f"{unprobed} of {len(results)} runs had no core-speed reading: their raw steps/s stand in for steps/s at the reference core speed."]
    core_speeds = [r["core_speed"] for r in results if r.get("core_speed")]
    if core_speeds:
        rows += ["", f"Core speed during the runs ranged {min(core_speeds):,.0f}-{max(core_speeds):,.0f} probe units/s over {len(core_speeds)} runs ({max(core_speeds) / min(core_speeds):.2f}x)."]
    rows += ["", "Ceilings (steps/s at the reference core speed):", ""]
    for fam, ceil in ceilings.items():
        line = f"- {fam}: env alone {speed(ceil['env']):,.0f} ({FAMILIES[fam]['env_id']}, {FAMILIES[fam]['num_envs']} env, random actions)"
        if ceil.get("arith"):
            a = ceil["arith"]
            line += f"; matmuls alone {speed(a):,.0f} ({a['gflop_per_step']:.3g} GFLOP per step at {a['gflops']:.0f} GFLOP/s raw)"
        rows.append(line)
    return "\n".join(rows) + "\n"


def compare(first, second, drift=0.0):
    """Check a second benchmark run against a first one, cell by cell (family and mode).

    A cell repeats when each run's median lies inside the other run's repeat band (the noise
    band the table reports, with the host's `drift`); a cell of one run has no band and is not
    judged. Returns the Markdown lines and the number of cells that did not repeat."""

    def bands(results):
        sps = {key: [speed(r) for r in cell] for key, cell in by_cell(results).items()}
        band = repeat_bands(sps, drift)
        return {key: (statistics.median(v), band[key]) for key, v in sps.items()}

    def shown(median, band):
        return f"{median:,.0f} ± {band / median:.1%}" if band is not None else f"{median:,.0f} (one run: no band)"

    a, b = bands(first), bands(second)
    rows = [
        "| algorithm | mode | run 1: median ± repeat band | run 2: median ± repeat band | change | medians within the other's band |",
        "|---|---|---:|---:|---:|---|",
    ]
    outside, judged = 0, 0
    for key in [k for k in a if k in b]:
        (ma, band_a), (mb, band_b) = a[key], b[key]
        if band_a is None or band_b is None:
            verdict = "n/a (one run)"
        else:
            ok = abs(mb - ma) <= min(band_a, band_b)
            judged, outside = judged + 1, outside + (not ok)
            verdict = "yes" if ok else "no"
        cols = [*key, shown(ma, band_a), shown(mb, band_b), f"{mb / ma - 1:+.1%}", verdict]
        rows.append("| " + " | ".join(cols) + " |")
    rows += ["", f"{judged - outside} of {judged} cells repeat within their noise band."]
    return rows, outside


def plot(results, out_dir):
    """Bars of steps per second per mode, and return against wall-clock and against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    grouped = by_cell(results)
    for fam in dict.fromkeys(r["family"] for r in results):
        cells = {mode: cell for (f, mode), cell in grouped.items() if f == fam}
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        modes = list(cells)
        meds = [statistics.median([speed(r) for r in cells[m]]) for m in modes]
        lows = [m - min(speed(r) for r in cells[k]) for m, k in zip(meds, modes)]
        highs = [max(speed(r) for r in cells[k]) - m for m, k in zip(meds, modes)]
        colors = ["grey" if mode == "plain" else f"C{i}" for i, mode in enumerate(modes)]
        axes[0].bar(modes, meds, yerr=[lows, highs], capsize=4, color=colors)
        axes[0].set_ylabel("steps/s at reference core speed")
        axes[0].set_title(f"{fam}: speed")
        axes[0].tick_params(axis="x", rotation=20)
        for i, mode in enumerate(modes):
            for j, r in enumerate(cells[mode]):
                curve = r.get("curve") or []
                if not curve:
                    continue
                steps, secs, rets = zip(*curve)
                label = mode if j == 0 else None
                axes[1].plot(secs, rets, color=colors[i], alpha=0.8, label=label)
                axes[2].plot(steps, rets, color=colors[i], alpha=0.8, label=label)
        axes[1].set_xlabel("wall-clock seconds")
        axes[2].set_xlabel("env steps")
        for ax in axes[1:]:
            ax.set_ylabel("episodic return")
            ax.legend(fontsize=8)
        axes[1].set_title("return against time")
        axes[2].set_title("return against steps")
        fig.tight_layout()
        path = out_dir / f"{fam}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(prog="run.sh", description="Benchmark LeanRL: plain vs lean in every mode, over seeds.")
    parser.add_argument("--profile", choices=["quick", "full", "tiny"], default="full", help="budget per run (see FAMILIES in benchmark/bench.py)")
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="same as --profile quick")
    parser.add_argument("--scripts", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), metavar="FAMILY", help=f"families to run (default: all): {', '.join(FAMILIES)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default: 1 2 3 4 5; 1 for tiny)")
    parser.add_argument("--steps", type=int, default=None, help="override the total env steps of every run")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench_results/<profile>-<time>)")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the env and arithmetic ceilings")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before one run is abandoned")
    parser.add_argument("--results", type=Path, default=None, help="reuse the runs of an earlier results.jsonl (and the ceilings.json beside it, if any): only the table and plots are made")
    parser.add_argument("--compare", type=Path, nargs=2, default=None, metavar="RESULTS", help="check a second run's results.jsonl against a first one's noise bands, and stop")
    parser.add_argument("--fit-elasticity", type=Path, nargs="+", default=None, metavar="RESULTS", help="fit each cell's ELASTICITY (benchmark/bench.py) to the runs of these results.jsonl files, print it, and stop")
    args = parser.parse_args(argv)

    if args.fit_elasticity:
        results = [r for path in args.fit_elasticity for r in read_results(path)]
        fits = fit_elasticity(results)
        for key in by_cell(results):
            if key not in fits:
                print(f"not fitted: {key[0]} {key[1]} (fewer than three runs with a core-speed reading, or all at one speed)")
        print("# slope of log steps/s against log core speed: +- its standard error, over n runs")
        print("ELASTICITY = {")
        for (fam, mode), (slope, se, n) in fits.items():
            print(f"    ({fam!r}, {mode!r}): {slope:.2f},  # +-{se:.2f}, {n} runs")
        print("}")
        return 0

    if args.compare:
        saved = args.compare[0].parent / "ceilings.json"
        drift, n = drift_of_machine(read_ceilings(saved)[1] if saved.exists() else machine(), skip=args.compare)
        rows, outside = compare(*map(read_results, args.compare), drift)
        print("\n".join(rows))
        print(f"The host's drift between benchmarks, {drift:.1%} per median, from {n} earlier benchmarks of this machine (DRIFT_RUNS)." if n > 1 else "Fewer than two earlier benchmarks of this machine (DRIFT_RUNS): the bands leave out the host's drift between benchmarks.")
        return 1 if outside else 0

    import torch

    # Five seeds of short runs: three such benchmarks on this project's drifting machine, compared
    # pair by pair, kept each median inside the other's repeat band in 45 of 45 cells; a fourth, on
    # a slower, noisier host, in 33 of 45 against them (43 of 45 with the host's drift in the
    # bands); the next three, F2, F3 and F4, in 15 of 15 pair by pair (README, "Does it repeat?").
    seeds = args.seeds or ([1] if args.profile == "tiny" else [1, 2, 3, 4, 5])
    out = (args.out or ROOT / "bench_results" / f"{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    if args.steps:
        for cfg in FAMILIES.values():
            cfg["budget"][args.profile] = args.steps
    info = {**machine(), "profile": args.profile, "seeds": seeds, "command": "./run.sh " + " ".join(argv if argv is not None else sys.argv[1:])}
    runs, skipped = plan(args.scripts, seeds, args.profile, torch.cuda.is_available())
    for fam, script, mode in skipped:
        print(f"n/a: {script.name} {mode} needs CUDA; reported as not applicable", flush=True)

    start = time.perf_counter()
    saved = args.results.parent / "ceilings.json" if args.results else None
    reuse_ceilings = saved is not None and saved.exists() and not args.no_ceilings
    measure_ceilings = not reuse_ceilings and not args.no_ceilings and args.profile != "tiny"
    # The runs go to the last core this process may use; the harness mostly waits on the others.
    core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    probe = CoreProbe(core) if not args.results or measure_ceilings else None
    # the ceilings took about 15 s per family on this project's machine (72 s for five, run F2)
    ceilings_eta = f" in the runs, then the ceilings (about {fmt_duration(15 * len(args.scripts))} here)"
    try:
        results = read_results(args.results) if args.results else run_all(runs, out, args.timeout, probe, core, then=ceilings_eta if measure_ceilings else "")
        ceilings = {}
        if reuse_ceilings:
            ceilings, info = read_ceilings(saved)
            print(f"ceilings and machine: reused from {saved}", flush=True)
        elif measure_ceilings:
            env_measured = {}  # families on the same env and number of envs share one measurement
            for fam in args.scripts:
                cfg = FAMILIES[fam]
                print(f"ceiling: {fam} ({cfg['env_id']})", flush=True)
                key = (cfg["env_id"], cfg["num_envs"])
                if key not in env_measured:
                    with pinned(core):
                        measured = env_ceiling(*key, envpool_env=fam == "ppo_atari_envpool")
                        env_measured[key] = with_reference(measured, probe, measured.pop("window"))
                ceilings[fam] = {"env": env_measured[key]}
                if cfg["off_policy"]:
                    try:
                        with pinned(core):
                            measured = arithmetic_ceiling(fam, out / "logs")
                            ceilings[fam]["arith"] = with_reference(measured, probe, measured.pop("window"))
                    except subprocess.CalledProcessError as e:
                        print(f"  arithmetic ceiling failed: {e.stderr.strip().splitlines()[-1] if e.stderr else e}", flush=True)
    finally:
        if probe:
            probe.close()
    (out / "ceilings.json").write_text(json.dumps({"machine": info, "ceilings": ceilings}, indent=1))

    table = summarize(results, skipped, ceilings, info, drift_of_machine(info, skip=[args.results] if args.results else []))
    (out / "table.md").write_text(table)
    plots = plot(results, out) if results else []
    print(table)
    print(f"results: {out / 'results.jsonl'}; table: {out / 'table.md'}; plots: {', '.join(p.name for p in plots)}")
    print(f"done in {fmt_duration(time.perf_counter() - start)}")
    return 0 if args.results or len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())

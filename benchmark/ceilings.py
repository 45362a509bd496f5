"""The ceilings of the LeanRL benchmark: the steps/s no script can beat on this machine.

- env: the env alone, stepped with random actions through the same vector API and number of
  envs as the scripts;
- arithmetic: the dense ops alone (matmuls, convolutions and their gradients) that a short run
  of the plain script records, replayed in a tight loop.

Used by bench.py (`./run.sh`), which reports each cell's steps/s as a fraction of both.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def rate(work, seconds):
    """Calls of `work` per second over `seconds`, after one call to warm up."""
    work()
    calls, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        work()
        calls += 1
    return calls / (time.monotonic() - start)


# Env steps per compiled call of the torch-native ceiling: the lean torch-env PPO's --unroll default.
TORCH_ENV_STEPS = 8


def torch_env_steps(env_id, num_envs, steps=TORCH_ENV_STEPS):
    """A call that steps a torch-native env `steps` times with random actions (counter hashes, as the
    lean scripts draw) and keeps what a rollout stores, compiled into one graph as their rollout is."""
    import torch

    import leanrl_envs

    torch.set_num_threads(1)
    env = leanrl_envs.make(env_id, num_envs)

    def run(state):
        rows = []
        for _ in range(steps):
            uniform = leanrl_envs.uniform(state.key + 1, state.counter, num_envs, 1)[:, 0]
            state, out = env.step(state, (uniform * env.num_actions).long())
            rows.append(torch.cat([out.obs, out.reward[:, None], (out.terminated | out.truncated)[:, None]], 1))
        return state, torch.stack(rows)

    run = torch.compile(run, fullgraph=True, options={"cpp_wrapper": True, "realize_opcount_threshold": 4})
    state = [env.reset(seed=1)[0]]

    def work():
        state[0] = run(state[0])[0]

    return work


def env_ceiling(env_id, num_envs, envpool_env=False, torch_env=False, seconds=5.0):
    """Steps per second of the env alone (random actions, no learning, same vector API and number
    of envs): no script on this env can beat it. A torch-native env steps TORCH_ENV_STEPS times a
    compiled call."""
    import numpy as np

    if torch_env:
        return {"sps": TORCH_ENV_STEPS * num_envs * rate(torch_env_steps(env_id, num_envs), seconds)}
    if envpool_env:
        import envpool

        envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=1)
        envs.reset()
        step = lambda: envs.step(np.random.randint(0, envs.action_space.n, num_envs))  # noqa: E731
    else:
        import gymnasium as gym

        envs = gym.vector.SyncVectorEnv(
            [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(env_id)) for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        envs.action_space.seed(1)
        envs.reset(seed=1)
        step = lambda: envs.step(envs.action_space.sample())  # noqa: E731
    sps = 100 * num_envs * rate(lambda: [step() for _ in range(100)], seconds)
    envs.close()
    return {"sps": sps}


# The dense ops, whose cost no script can avoid: matmuls, convolutions and their gradients.
RECORD_DENSE_OPS = r"""
import contextlib, io, json, runpy, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
out, script, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
aten = torch.ops.aten
DENSE = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
         aten.convolution.default, aten.convolution_backward.default}
def spec(a):  # a tensor as its shape and whether its last two dims are transposed; the rest as is
    return {"shape": list(a.shape), "t": a.dim() in (2, 3) and a.stride(-1) != 1} if isinstance(a, torch.Tensor) else a
seen = []
class Record(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DENSE:
            seen.append([str(func), [spec(a) for a in args]])
        return func(*args, **(kwargs or {}))
sys.argv = [script, *argv]
with Record(), contextlib.redirect_stdout(io.StringIO()):
    runpy.run_path(script, run_name="__main__")
json.dump(seen, open(out, "w"))
"""


def flop(name, args, result):
    """Multiply-adds x 2 of one recorded dense op."""
    if "conv" not in name:
        a, b = args[-2:]  # (bias,) a, b: a (batch,) M x K, b (batch,) K x N
        return 2 * a.numel() * b.shape[-1]
    if name.endswith("convolution.default"):
        return 2 * result.numel() * args[1][0].numel()
    grad_out, weight, mask = args[0], args[2], args[-1]  # convolution_backward: one per gradient asked for
    return 2 * grad_out.numel() * weight[0].numel() * sum(mask[:2])


def arithmetic_ceiling(script, argv, steps, work_dir, seconds=3.0):
    """Steps per second if a training step cost only its dense ops (matmuls, convolutions and
    their gradients, acting included). A short eager run of `script` with `argv`, which trains
    on `steps` env steps, records each one's shapes and layout; they are replayed in a tight loop
    with one thread, and one pass serves those env steps."""
    import torch

    out = (Path(work_dir) / f"dense_ops_{Path(script).stem}.json").resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    subprocess.run(
        [sys.executable, "-c", RECORD_DENSE_OPS, str(out), str(script), *argv],
        check=True,
        cwd=work_dir,
        capture_output=True,
        env=env,
    )
    torch.set_num_threads(1)

    def tensor(a):
        s = a["shape"]
        return torch.randn(*s[:-2], s[-1], s[-2]).transpose(-1, -2) if a["t"] else torch.randn(*s)

    ops = []
    for name, specs in json.loads(out.read_text()):
        fn = torch.ops.aten
        for part in name.split(".")[1:]:
            fn = getattr(fn, part)
        ops.append((name, fn, [tensor(a) if isinstance(a, dict) else a for a in specs]))
    flops = sum(flop(name, args, fn(*args)) for name, fn, args in ops)
    passes = rate(lambda: [fn(*args) for _, fn, args in ops], seconds)
    return {"sps": steps * passes, "gflop_per_step": flops / steps / 1e9, "gflops": flops * passes / 1e9}

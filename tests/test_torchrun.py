"""Lean PPO under torchrun (2 CPU ranks): identical ranks, one summary, the all-reduced gradient, resume, faults."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import assert_bad_input, load_script, pair, run_script, script_command, script_env, scripts, signal_at_step, tiny

import leanrl_utils

# The lean PPO scripts that take torchrun (--dist-timeout among their flags; not those whose envs live on the device).
LEAN_PPO = [s for s in scripts("ppo_*_torchcompile.py") if "dist_timeout" in load_script(s).Args.__dataclass_fields__]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# Two iterations of both ranks at TINY sizes, so that a log point follows an update twice.
TWO_RANKS = {
    f"{f}_torchcompile": ["--total-timesteps", n] for f, n in (("ppo_continuous_action", "256"), ("ppo_atari_envpool", "128"))
}


def torchrun(script, *args, cwd, nproc=2, timeout=900, env=None, before=""):
    """`torchrun --standalone --nproc_per_node nproc script args`; each rank runs the source `before` first."""
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc)]
    command += ["--no-python", *script_command(script, before)] if before else [str(script)]
    options = dict(cwd=cwd, capture_output=True, text=True, timeout=timeout, env=script_env(**(env or {})))
    return subprocess.run([*command, *map(str, args)], **options)


# The JSON summary lines in torchrun's stdout (every rank's stdout goes there).
summaries = lambda proc: [json.loads(line, parse_constant=pytest.fail) for line in proc.stdout.splitlines() if line[:1] == "{"]


def checksum(state_dict):
    """The scripts' parameter checksum (finish_distributed), from a saved state dict."""
    flat = torch.cat([v.reshape(-1) for v in state_dict.values()]).double()
    return (flat * torch.arange(1, flat.numel() + 1, dtype=flat.dtype)).sum()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("script", LEAN_PPO, ids=lambda p: p.stem)
def test_two_ranks_end_identical(script, compiled, workdir):
    args = [*tiny(script), *TWO_RANKS[script.stem], "--save-model", *(["--compile"] if compiled else [])]
    proc = torchrun(script, *args, cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = summaries(proc)  # rank 0's only
    assert summary["world_size"] == 2 and summary["compile"] == compiled
    # One batch of a single process from the checkpoint: it loads, and its batch is half the global one.
    argv = [*tiny(script), "--total-timesteps", summary["batch_size"] // 2, "--load-model", summary["checkpoint"]]
    single, _ = run_script(script, *argv, cwd=workdir)
    assert summary["batch_size"] == 2 * single["batch_size"], (summary, single)
    assert summary["total_steps"] == int(TWO_RANKS[script.stem][1]) and summary["updates"] == 8
    # Every rank's checksum of its final parameters, gathered by the script, is that of rank 0's checkpoint.
    first, second = map(float, summary["rank_checksums"])
    assert first == second, summary["rank_checksums"]
    model = torch.load(workdir / summary["checkpoint"], weights_only=True)["model"]["agent"]
    torch.testing.assert_close(torch.tensor(first, dtype=torch.float64), checksum(model), rtol=1e-12, atol=0)


# What each rank of a worker does first: the script named by argv[1] loaded as a module, the process group joined.
JOINED = textwrap.dedent("""
    import importlib.util, sys, types
    import torch, torch.distributed as dist
    spec = importlib.util.spec_from_file_location("script", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
""")


# Each rank's half of a batch with world_size 2 against the whole with 1, gradients recorded, unclipped, unnormalized.
WORKER = JOINED + textwrap.dedent("""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 8 * world_size
    if "continuous" in sys.argv[1]:
        agent = script.Agent(11, 3)
        batch = [torch.randn(n, 11, generator=g), torch.randn(n, 3, generator=g)]
    else:
        agent = script.Agent(4)
        batch = [torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8), torch.randint(0, 4, (n,), generator=g)]
    batch += [torch.randn(n, generator=g) - 2] + [torch.randn(n, generator=g) for _ in range(3)]
    if "atari" in sys.argv[1]:
        batch.append(torch.ones(n))
    args = script.Args(norm_adv=False, max_grad_norm=1e9)

    params = dict(script.seeds.stack([agent]).items())  # a stack of one, as the script holds it
    batch = [x[None] for x in batch]

    class Recorder:
        def __init__(self):
            self.params = params
        def step(self, grads):
            self.grads = {k: v.clone() for k, v in grads.items()}

    mine = torch.arange(rank * 8, rank * 8 + 8)
    shared = Recorder()
    shared_metrics = script.make_update(agent, shared, args, world_size)(*batch, mine[None])
    if rank == 0:
        together = Recorder()
        together_metrics = script.make_update(agent, together, args, 1)(*batch, torch.arange(n)[None])
        torch.save({"all_reduced": shared.grads, "together": together.grads,
                    "all_reduced_metrics": shared_metrics, "together_metrics": together_metrics}, sys.argv[2])
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("script", LEAN_PPO, ids=lambda p: p.stem)
def test_all_reduced_gradient_is_the_gradient_of_both_batches(script, workdir):
    worker, out = workdir / "worker.py", workdir / "grads.pt"
    worker.write_text(WORKER)
    proc = torchrun(worker, script, out, cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    grads = torch.load(out, weights_only=True)
    assert all(g.abs().sum() > 0 for g in grads["together"].values())
    # float32 sums of the same terms in another order; the metrics too (losses, approx_kl for --target-kl).
    torch.testing.assert_close(grads["all_reduced"], grads["together"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["all_reduced_metrics"], grads["together_metrics"], rtol=1e-5, atol=1e-6)


@pytest.mark.learning
def test_two_ranks_learn_inverted_pendulum(workdir):
    from test_ppo_family import LEARNING

    # The single-process test's 40,960 env steps in batches of 1024: 512 steps on each rank.
    argv = "--env-id InvertedPendulum-v5 --total-timesteps 40960 --num-steps 512 --seed 1 --compile".split()
    proc = torchrun(pair("ppo_continuous_action")[1], *argv, cwd=workdir, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-1000:]
    (summary,) = summaries(proc)
    assert summary["batch_size"] == 1024 and summary["total_steps"] == 40960
    assert summary["episodic_return"] >= LEARNING["ppo_continuous_action"][1], summary


BACKENDS = {"nccl-on-cpu": (["--backend", "nccl"], ["nccl", "--backend gloo"]),
            "unknown-backend": (["--backend", "mpi"], ["mpi", "gloo", "nccl"])}  # fmt: skip


@pytest.mark.parametrize("script", LEAN_PPO, ids=lambda p: p.stem)
@pytest.mark.parametrize("bad_args, words", BACKENDS.values(), ids=BACKENDS)
def test_unavailable_backend_is_one_clear_line(script, bad_args, words, workdir):
    assert_bad_input(script, *tiny(script), *bad_args, words=words, cwd=workdir)


@pytest.mark.parametrize("script", LEAN_PPO, ids=lambda p: p.stem)
def test_a_rank_alone_stops_with_one_line(script, workdir):
    """A rank whose peers never come waits --dist-timeout, then says so in one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    words = ["rank 0", "could not join", "--rdzv-endpoint"]
    assert_bad_input(script, *tiny(script), "--dist-timeout", "2", words=words, cwd=workdir, env=env)


def test_a_stopped_run_resumes_under_torchrun_as_the_unbroken_run(workdir):
    """SIGTERM to rank 1: saved and resumed as the unbroken run."""
    script = scripts("ppo_continuous_action_torchcompile.py")[0]
    args = [*tiny(script), "--total-timesteps", "512", "--save-model"]  # 4 iterations of 2 x 64 steps
    (whole := workdir / "whole").mkdir()
    (parts := workdir / "parts").mkdir()
    unbroken = torchrun(script, *args, cwd=whole)
    assert unbroken.returncode == 0, unbroken.stderr[-4000:]
    at = '(150 if os.environ["RANK"] == "1" else -1)'  # rank 1, its third iteration: both stop before the fourth
    stopped = torchrun(script, *args, cwd=parts, before=signal_at_step(at, times=2))
    (summary,) = summaries(stopped)
    assert summary["interrupted"] and summary["total_steps"] == 384, summary
    run_dir = Path(summary["run_dir"])
    assert (parts / run_dir / "resume.pt").is_file()
    assert_bad_input(script, "--resume", run_dir, words=["2 torchrun ranks", "not one process"], cwd=parts)
    resumed = torchrun(script, "--resume", run_dir, "--save-model", cwd=parts)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed.stderr.count(f"notice: resuming {run_dir} from step 384") == 1, resumed.stderr
    (expected,), (got,) = summaries(unbroken), summaries(resumed)
    assert got["total_steps"] == expected["total_steps"] and got["rank_checksums"] == expected["rank_checksums"]
    expected, got = (torch.load(d / s["checkpoint"], weights_only=True)["model"] for d, s in ((whole, expected), (parts, got)))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# Under torchrun rank 1's parameters differ from rank 0's (or not); the script's end of run compares their checksums.
DRIFT = JOINED + textwrap.dedent("""
    drift = float(sys.argv[2])
    run = types.SimpleNamespace(stop_signal=None, stop_reason=None, iteration=None)
    run.lead = run
    params = [torch.linspace(-1, 1, 7), torch.ones(2, 3) + drift * rank]
    fields = script.torchrun.leave(run, params, world_size, lost=False)
    # one write for the whole line: the ranks share the pipe, and print writes the newline apart
    sys.stdout.write(f"rank {rank}: {len(set(fields['rank_checksums']))} {run.stop_reason}\\n")
    sys.stdout.flush()
""")


@pytest.mark.parametrize("drift", [0.0, 1e-6])
def test_drifted_ranks_stop_the_run(drift, workdir):
    script, worker = LEAN_PPO[0], workdir / "drift.py"
    worker.write_text(DRIFT)
    proc = torchrun(worker, script, drift, cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    if drift:
        assert len(lines) == 2 and all(" 2 the ranks' parameters differ" in line for line in lines), lines
    else:
        assert lines == ["rank 0: 1 None", "rank 1: 1 None"]


def test_the_distributed_helpers_live_in_leanrl_utils():
    """Every lean script that takes torchrun calls leanrl_utils.torchrun's helpers (none defines its own: test_faults)."""
    names = ["init", "error_line", "broadcast", "all_reduce_mean", "gather_episodes", "leave"]
    for path in LEAN_PPO:
        text = path.read_text()
        missing = [name for name in names if f"torchrun.{name}(" not in text]
        assert not missing, (path.name, missing)
    assert all(callable(getattr(leanrl_utils.torchrun, name)) for name in names)

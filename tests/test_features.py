"""Research features every script has: checkpoints (atomic, loadable across the pair),
evaluation, and offline tracking. Signals and bad input are in test_faults.py."""

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import TINY, family, is_lean, load_script, run_script, script_command, scripts

ALL = scripts("*.py")
PLAIN = [s for s in ALL if not is_lean(s)]


def twin(script):
    return script.with_name(script.stem + "_torchcompile.py")


@pytest.mark.parametrize("script", PLAIN, ids=lambda s: s.stem)
def test_checkpoint_round_trip_across_the_pair(script, workdir):
    """A checkpoint saved by either script evaluates to the same return in both: the reloaded
    deterministic policy takes the same actions on the same observations."""
    tiny = TINY[family(script)]
    for trained_by in (script, twin(script)):
        summary, _ = run_script(trained_by, *tiny, "--save-model", cwd=workdir)
        path = Path(workdir) / summary["checkpoint"]
        assert path.is_file() and not Path(str(path) + ".tmp").exists()
        torch.load(path, map_location="cpu", weights_only=True)
        evals = []
        for evaluated_by in (script, twin(script)):
            summary, _ = run_script(
                evaluated_by, *tiny, "--load-model", path, "--total-timesteps", "0", "--eval-episodes", "2", cwd=workdir
            )
            assert summary["updates"] == 0 and summary["total_steps"] == 0
            assert math.isfinite(summary["eval_return"])
            evals.append(summary["eval_return"])
        assert evals[0] == pytest.approx(evals[1], rel=1e-5), (trained_by.name, evals)


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_missing_checkpoint_is_one_line(script, workdir):
    from conftest import assert_one_line_error

    _, proc = run_script(script, *TINY[family(script)], "--load-model", "nope.pt", cwd=workdir, check=False)
    assert_one_line_error(proc, "nope.pt")


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_atomic_save_never_exposes_a_partial_file(script, tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous checkpoint whole at the final path."""
    module = load_script(script)
    path = str(tmp_path / "model.pt")
    module.atomic_save({"w": torch.ones(3)}, path)

    def crash(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(module.torch, "save", crash)
    with pytest.raises(OSError):
        module.atomic_save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["w"], torch.ones(3))


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_track_offline_writes_a_local_run(script, workdir):
    summary, _ = run_script(script, *TINY[family(script)], "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    assert summary["updates"] > 0
    runs = list((Path(workdir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(Path(workdir).rglob("*"))[:20]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_untracked_run_never_imports_wandb(script, workdir):
    """Without --track nothing touches wandb: the script never imports it."""
    proc = subprocess.run(
        [*script_command(script, after="assert 'wandb' not in sys.modules, 'wandb was imported'"), *TINY[family(script)]],
        cwd=workdir, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.stem)
def test_capture_video_without_moviepy_is_one_line(script, workdir):
    """--capture-video without the `video` extra: one line naming it, before any training."""
    from conftest import assert_one_line_error, run_without

    proc = run_without("moviepy", script, *TINY[family(script)], "--capture-video", cwd=workdir)
    assert_one_line_error(proc, "leanrl[video]")


@pytest.mark.parametrize("flags, threads", [([], 1), (["--threads", "2"], 2)], ids=["default", "two"])
def test_lean_scripts_choose_their_cpu_threads(flags, threads, tmp_path, monkeypatch):
    """One intra-op thread on a CPU unless --threads says more, whatever torch started with."""
    from conftest import main_in_process

    before = torch.get_num_threads()
    try:
        for script in (s for s in scripts("*_torchcompile.py") if family(s) in ("dqn", "pqn")):
            torch.set_num_threads(3 - threads)
            code = main_in_process(load_script(script), *flags, tmp_path=tmp_path, monkeypatch=monkeypatch)
            assert code in (0, None) and torch.get_num_threads() == threads, (script.name, code)
    finally:
        torch.set_num_threads(before)


SAME_STEP = [s for s in ALL if "class SameStepEnvs" in s.read_text()]


@pytest.mark.parametrize("script", SAME_STEP, ids=lambda s: s.stem)
def test_same_step_envs_step_as_gymnasium_does(script):
    """The lean scripts' shorter vector-env step: over episodes that end in terminations and in
    truncations (at 12 steps here), the same arrays as gymnasium's SyncVectorEnv under SAME_STEP
    autoreset, and the same final observations and episode statistics."""
    import gymnasium as gym
    import numpy as np

    assert len(SAME_STEP) >= 3, SAME_STEP
    module = load_script(script)
    env_id = "InvertedPendulum-v5" if "continuous" in script.stem else "CartPole-v1"

    def thunk():
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id, max_episode_steps=12))

    ours = module.SameStepEnvs([thunk] * 3)
    theirs = gym.vector.SyncVectorEnv([thunk] * 3, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    for a, b in zip(ours.reset(seed=5)[0], theirs.reset(seed=5)[0]):
        assert np.array_equal(a, b)
    theirs.action_space.seed(5)
    ends = truncations = 0
    for t in range(600):
        actions = theirs.action_space.sample()
        mine, gyms = ours.step(actions), theirs.step(actions)
        for x, y in zip(mine[:4], gyms[:4]):
            assert x.dtype == y.dtype and np.array_equal(x, y), t
        assert ("final_obs" in mine[4]) == ("final_obs" in gyms[4]), t
        if "final_obs" in gyms[4]:
            done = gyms[4]["_final_obs"]
            assert np.array_equal(mine[4]["_final_obs"], done)
            for i in np.flatnonzero(done):
                assert np.array_equal(mine[4]["final_obs"][i], gyms[4]["final_obs"][i])
            stats, expected = mine[4]["final_info"], gyms[4]["final_info"]
            assert np.array_equal(stats["_episode"], expected["_episode"])
            for key in ("r", "l"):
                assert np.array_equal(stats["episode"][key][done], expected["episode"][key][done])
            ends += done.sum()
            truncations += gyms[3].sum()
    assert ends - truncations >= 10 and truncations >= 10, (ends, truncations)
    ours.close()
    theirs.close()

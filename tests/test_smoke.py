"""Every script in every mode at tiny sizes runs through, updates, summarizes, never recompiles, never imports wandb."""

import math

import pytest
import torch
from conftest import TINY, family, is_lean, run_script, scalars, scripts

ALL = scripts("*.py")
LEAN = [s for s in ALL if is_lean(s)]
MODES = {"eager": [], "compile": ["--compile"], "compile+cudagraphs": ["--compile", "--cudagraphs"]}
if torch.cuda.is_available():  # on a CPU, --cudagraphs alone is eager with the notice that compile+cudagraphs checks
    MODES["cudagraphs"] = ["--cudagraphs"]
CUDA_NOTICE = "notice: --cudagraphs needs a CUDA device; running without CUDA graphs"
NO_WANDB = "assert 'wandb' not in sys.modules, 'wandb was imported'"  # without --track nothing imports it


def check_summary(summary, script, workdir):
    assert summary["script"] == script.name
    run_dir = workdir / summary["run_dir"]
    assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard events under runs/"
    points = scalars(run_dir, but=())
    tags = [tag for tag, _, _ in points]
    assert "charts/SPS" in tags and any(tag.startswith("losses/") for tag in tags), sorted(set(tags))
    if summary["episodic_return"] is not None:  # one point per episode: the summary is the last 10's mean
        returns = [value for tag, _, value in points if tag == "charts/episodic_return"]
        assert tags.count("charts/episodic_length") == len(returns)
        assert math.isclose(sum(returns[-10:]) / len(returns[-10:]), summary["episodic_return"], rel_tol=1e-4, abs_tol=1e-3)
    assert (run_dir / "curve.csv").read_text().startswith("step,seconds,episodic_return\n")
    assert summary["updates"] > 0 and summary["total_steps"] > 0, summary
    assert summary["interrupted"] is False and math.isfinite(summary["episodic_return"] or 0), summary  # None or finite


@pytest.mark.parametrize("script", [s for s in ALL if not is_lean(s)], ids=lambda s: s.stem)
def test_plain_script_runs(script, workdir):
    summary, _ = run_script(script, *TINY[family(script)], cwd=workdir, after=NO_WANDB)
    check_summary(summary, script, workdir)
    assert summary["compile"] is False and summary["cudagraphs"] is False


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", LEAN, ids=lambda s: s.stem)
def test_lean_script_runs(script, mode, workdir):
    # Every recompile after the first compilation of a callable is logged under this setting.
    env = {"TORCH_LOGS": "recompiles"}
    summary, proc = run_script(script, *TINY[family(script)], *MODES[mode], cwd=workdir, env=env, after=NO_WANDB)
    check_summary(summary, script, workdir)
    assert summary["compile"] is ("compile" in mode)
    assert "Recompiling" not in proc.stderr, proc.stderr[-4000:]
    if "cudagraphs" in mode and not torch.cuda.is_available():
        assert proc.stderr.count(CUDA_NOTICE) == 1, proc.stderr[-2000:]
        assert summary["cudagraphs"] is False
    else:
        assert CUDA_NOTICE not in proc.stderr

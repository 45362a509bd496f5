"""What every LeanRL script needs and no researcher wants to read twice, as CleanRL's scripts import
`cleanrl_utils`: small modules by concern, which a script calls and which never call back into it.

checks: the flags, bad input in one line      run: the run recorder (folder, metrics, signals)
resume: --resume's flags, checkpoint, state    summary: the end of a run and its JSON line
checkpoints: --save-model / --load-model       seeds: --num-seeds, stacked parameters and runs
acting: numpy acting derived from a module     optimizers: Adam and RAdam as calls on tensors
buffers: a replay buffer on the device         vector: vector envs (gymnasium, envpool Atari)
speed: the device, threads, compile guards     torchrun: the process group, its collectives
"""

from leanrl_utils.checks import cli, fail
from leanrl_utils.run import Run

__all__ = ["Run", "cli", "fail"]

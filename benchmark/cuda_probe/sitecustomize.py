"""Counts CUDA graph captures and replays in a script run by benchmark/cuda_check.py.

Python imports `sitecustomize` at start-up from PYTHONPATH; this one acts only when
LEANRL_GRAPH_PROBE names a file, and writes {"captures": N, "replays": M} there at exit. A
script whose `--cudagraphs` really works captures each graphed callable once and replays it on
every later call: few captures, many replays."""

import atexit
import json
import os

if os.environ.get("LEANRL_GRAPH_PROBE"):
    import torch

    counts = {"captures": 0, "replays": 0}
    graph = torch.cuda.CUDAGraph
    capture_begin, replay = graph.capture_begin, graph.replay

    def counted_capture_begin(self, *args, **kwargs):
        counts["captures"] += 1
        return capture_begin(self, *args, **kwargs)

    def counted_replay(self, *args, **kwargs):
        counts["replays"] += 1
        return replay(self, *args, **kwargs)

    graph.capture_begin, graph.replay = counted_capture_begin, counted_replay

    @atexit.register
    def write_counts():
        with open(os.environ["LEANRL_GRAPH_PROBE"], "w") as f:
            json.dump(counts, f)

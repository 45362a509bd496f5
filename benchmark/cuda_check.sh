#!/usr/bin/env bash
# The CUDA check in one call, for the day a GPU is lent (a few minutes on one GPU):
#   pip install -e ".[dev]" && benchmark/cuda_check.sh [--out DIR] [--jobs N] [--no-bench]
# Writes DIR/cuda_check.md (default bench_results/cuda_check) and prints it; exit 0 when every run passed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmark/cuda_check.py "$@"

#!/usr/bin/env bash
# Benchmark LeanRL: each plain script against its lean twin in the modes eager, compile,
# cudagraphs and compile+cudagraphs, over seeds, with env and arithmetic ceilings; writes
# results.jsonl, table.md and plots under bench_results/ (method: benchmark/RESULTS.md).
#
#   ./run.sh --quick              # every family, seeds 1-5, short budgets (the README table)
#   ./run.sh                      # the full profile: longer budgets
#   ./run.sh --scripts ppo_continuous_action sac_continuous_action --seeds 1 2 3 --steps 50000
#   ./run.sh --help
set -euo pipefail
cd "$(dirname "$0")"
exec python benchmark/bench.py "$@"

#!/usr/bin/env bash
# Benchmark LeanRL: each plain script against its lean twin in the modes eager, compile,
# cudagraphs and compile+cudagraphs, over seeds, with env and arithmetic ceilings; writes
# results.jsonl, table.md and plots under bench_results/.
#
#   ./run.sh                      # full profile, every family, seeds 1 2 3 (the README table)
#   ./run.sh --quick              # minutes: shorter budgets, seeds 1 2
#   ./run.sh --scripts ppo_continuous_action sac_continuous_action --seeds 1 2 3 --steps 50000
#   ./run.sh --help
set -euo pipefail
cd "$(dirname "$0")"
exec python benchmark/bench.py "$@"

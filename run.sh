#!/usr/bin/env bash
# Benchmark LeanRL: each plain script against its lean twin in the modes eager, compile,
# cudagraphs and compile+cudagraphs, over seeds, with env and arithmetic ceilings; writes
# results.jsonl, table.md and plots under bench_results/ (method: benchmark/RESULTS.md).
#
#   ./run.sh --quick              # every family, seeds 1-5, short budgets (the README table)
#   ./run.sh                      # the full profile: longer budgets
#   ./run.sh --scripts ppo_continuous_action sac_continuous_action --seeds 1 2 3 --steps 50000
#
# The learning profile: plain against lean --compile, curves and final returns over seeds
# (benchmark/learning.py):
#
#   ./run.sh --learning --quick   # 3 seeds, short budgets: about an hour on 2 cores
#   ./run.sh --learning           # 5 seeds, budgets where the curves still rise: hours
#   ./run.sh --learning --pairs sac_continuous_action --seeds 4 5 --out B   # more seeds later
#   ./run.sh --learning --merge A B --out AB                                 # one table of both
#
# Scaling on one machine: --num-seeds 1 against more seeds, torchrun with 1 process against 2
# (benchmark/scaling.py):
#
#   ./run.sh --scaling
#
# Three modes, then: speed (the default), --learning and --scaling. ./run.sh --help prints this;
# ./run.sh --quick --help, ./run.sh --learning --help and ./run.sh --scaling --help list each one's flags.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
    --learning) exec python benchmark/learning.py "${@:2}" ;;
    --scaling) exec python benchmark/scaling.py "${@:2}" ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
exec python benchmark/bench.py "$@"

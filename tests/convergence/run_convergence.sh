#!/usr/bin/env bash
# Trains a config to the end under a real mpiexec and checks the final test accuracy: at least
# MIN, and (with REF, the metrics file of another run) within WITHIN of that run's final accuracy.
# usage: run_convergence.sh NP MIN METRICS_FILE [REF_METRICS WITHIN] -- dtrain train args...
set -euo pipefail
np=$1 min=$2 metrics=$3
shift 3
ref="" within=""
if [[ "$1" != "--" ]]; then ref=$1 within=$2; shift 2; fi
[[ "$1" == "--" ]] && shift
final_accuracy() {
  grep '"test_accuracy"' "$1" | grep -v summary | tail -1 | sed 's/.*"test_accuracy": \([0-9.e-]*\).*/\1/'
}
rm -f "$metrics"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpiexec -n "$np" --oversubscribe --bind-to none "$@" --metrics "$metrics" --progress off
acc=$(final_accuracy "$metrics")
[[ -n "$acc" ]] || { echo "no test_accuracy in $metrics"; exit 1; }
echo "final test accuracy $acc (required >= $min)"
awk -v a="$acc" -v m="$min" 'BEGIN { exit !(a >= m) }' || { echo "FAILED: below $min"; exit 1; }
if [[ -n "$ref" ]]; then
  racc=$(final_accuracy "$ref")
  [[ -n "$racc" ]] || { echo "no test_accuracy in the reference run $ref"; exit 1; }
  echo "reference run: $racc; required within $within"
  awk -v a="$acc" -v r="$racc" -v w="$within" 'BEGIN { d = a - r; if (d < 0) d = -d; exit !(d <= w) }' ||
    { echo "FAILED: more than $within from the reference"; exit 1; }
fi

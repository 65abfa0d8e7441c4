#!/usr/bin/env bash
# Trains a config to the end under a real mpiexec and checks the final test accuracy.
# usage: run_convergence.sh NP MIN_ACCURACY METRICS_FILE -- dtrain train args...
set -euo pipefail
np=$1 min=$2 metrics=$3
shift 3
[[ "$1" == "--" ]] && shift
rm -f "$metrics"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpiexec -n "$np" --oversubscribe --bind-to none "$@" --metrics "$metrics" --progress off
acc=$(grep '"test_accuracy"' "$metrics" | grep -v summary | tail -1 | sed 's/.*"test_accuracy": \([0-9.e-]*\).*/\1/')
[[ -n "$acc" ]] || { echo "no test_accuracy in $metrics"; exit 1; }
echo "final test accuracy $acc (required >= $min)"
awk -v a="$acc" -v m="$min" 'BEGIN { exit !(a >= m) }'

#!/usr/bin/env bash
# Trains a config to the end under a real mpiexec and checks the final test accuracy: at least
# MIN, and (with REF, the metrics file of another run) within WITHIN of that run's final accuracy.
# usage: run_convergence.sh NP MIN METRICS_FILE [REF_METRICS WITHIN] -- dtrain train args...
# WITHIN with a leading minus (-0.005) is one-sided: at most that far below the reference, any
# distance above it (a lossy exchange that must not cost more than so much accuracy).
# With SEEDS=a,b,... in the environment the job runs once per seed (--seed s, metrics
# METRICS_FILE.s), and the mean final accuracy is checked; REF_METRICS may then list several
# files (comma-separated), compared by their mean. One run's final accuracy moves by a few tenths
# of a point with any change of rounding (bf16 against fp32, another summation order), so a
# comparison at that scale needs the mean of several seeds.
set -euo pipefail
np=$1 min=$2 metrics=$3
shift 3
ref="" within=""
if [[ "$1" != "--" ]]; then ref=$1 within=$2; shift 2; fi
[[ "$1" == "--" ]] && shift
final_accuracy() {
  grep '"test_accuracy"' "$1" | grep -v summary | tail -1 | sed 's/.*"test_accuracy": \([0-9.e-]*\).*/\1/'
}
mean() { awk '{ s += $1; n += 1 } END { if (n) printf "%.6f", s / n }'; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
accs=()
if [[ -n "${SEEDS:-}" ]]; then
  IFS=, read -ra seeds <<<"$SEEDS"
  for s in "${seeds[@]}"; do
    rm -f "$metrics.$s"
    mpiexec -n "$np" --oversubscribe --bind-to none "$@" --seed "$s" --metrics "$metrics.$s" --progress off
    a=$(final_accuracy "$metrics.$s")
    [[ -n "$a" ]] || { echo "no test_accuracy in $metrics.$s"; exit 1; }
    echo "seed $s: final test accuracy $a"
    accs+=("$a")
  done
else
  rm -f "$metrics"
  mpiexec -n "$np" --oversubscribe --bind-to none "$@" --metrics "$metrics" --progress off
  a=$(final_accuracy "$metrics")
  [[ -n "$a" ]] || { echo "no test_accuracy in $metrics"; exit 1; }
  accs+=("$a")
fi
acc=$(printf '%s\n' "${accs[@]}" | mean)
echo "final test accuracy $acc (required >= $min)"
awk -v a="$acc" -v m="$min" 'BEGIN { exit !(a >= m) }' || { echo "FAILED: below $min"; exit 1; }
if [[ -n "$ref" ]]; then
  raccs=()
  IFS=, read -ra refs <<<"$ref"
  for f in "${refs[@]}"; do
    r=$(final_accuracy "$f")
    [[ -n "$r" ]] || { echo "no test_accuracy in the reference run $f"; exit 1; }
    raccs+=("$r")
  done
  racc=$(printf '%s\n' "${raccs[@]}" | mean)
  if [[ "$within" == -* ]]; then
    below=${within#-}
    echo "reference: $racc (mean of ${#raccs[@]} run(s)); required at most $below below it"
    awk -v a="$acc" -v r="$racc" -v w="$below" 'BEGIN { exit !(r - a <= w) }' ||
      { echo "FAILED: more than $below below the reference"; exit 1; }
  else
    echo "reference: $racc (mean of ${#raccs[@]} run(s)); required within $within"
    awk -v a="$acc" -v r="$racc" -v w="$within" 'BEGIN { d = a - r; if (d < 0) d = -d; exit !(d <= w) }' ||
      { echo "FAILED: more than $within from the reference"; exit 1; }
  fi
fi

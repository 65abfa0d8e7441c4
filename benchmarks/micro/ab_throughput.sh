#!/usr/bin/env bash
# Training throughput of two dtrain builds side by side (before/after a change), interleaved run by
# run so both see the same machine: SimpleCNN (synthetic 1x28x28, batch 64/rank) and the GPT (6 x
# 256, context 128, batch 8/rank, the fortunes tokens) on 1 and 2 ranks, REPEATS runs each, medians.
#   benchmarks/micro/ab_throughput.sh BEFORE_DTRAIN AFTER_DTRAIN [REPEATS] [TOKENS_DIR]
set -euo pipefail
A=$1
B=$2
N=${3:-5}
TOKENS=${4:-/tmp/dtrain-ab-fortunes}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f $TOKENS/train.h5 ]] || "$B" convert text --inputs /usr/share/games/fortunes --out "$TOKENS" >/dev/null
rate() { grep -oE 'done: [0-9]+ steps, [0-9.]+ [a-z]+/s' | awk '{print $4}'; }
median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
run() {  # run BINARY RANKS ARGS...
  local d=$1 n=$2
  shift 2
  mpiexec -n "$n" --bind-to none "$d" train --threads 1 --progress off "$@" 2>&1 | rate
}
echo "| model | ranks | before (median of $N) | after | after / before |"
echo "| --- | ---: | ---: | ---: | ---: |"
for model in simple_cnn gpt; do
  if [[ $model == simple_cnn ]]; then
    args=(--model simple_cnn --synthetic --synthetic-shape 1,28,28 --batch-size 64 --steps 600)
  else
    args=(--model gpt --data "$TOKENS" --layers 6 --width 256 --heads 8 --context 128 --batch-size 8 --steps 40
      --eval-every 0 --warmup-steps 2)
  fi
  for ranks in 1 2; do
    : >/tmp/ab-a.txt
    : >/tmp/ab-b.txt
    for ((i = 0; i < N; i++)); do
      run "$A" "$ranks" "${args[@]}" >>/tmp/ab-a.txt
      run "$B" "$ranks" "${args[@]}" >>/tmp/ab-b.txt
    done
    a=$(median </tmp/ab-a.txt)
    b=$(median </tmp/ab-b.txt)
    echo "| $model | $ranks | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }') |"
  done
done

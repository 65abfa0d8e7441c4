#!/usr/bin/env bash
# Long contexts on one CPU rank, two dtrain builds side by side (runs alternating, so both see the
# same machine): peak resident memory (GNU time's maximum RSS) and training tokens/s of the Llama
# 6 x 256 (8 heads over 2 kv heads), batch 1, 1 thread, at each context of CONTEXTS, then the
# 2 x 128 Llama (4 heads over 2) at 16384 tokens. The build BEFORE runs only the contexts below
# BEFORE_MAX (the materialised attention needs ~5 GiB at 4096 and ~4x that at each doubling).
#   benchmarks/micro/long_context.sh BEFORE_DTRAIN AFTER_DTRAIN [REPEATS] [TOKENS_DIR]
#   CONTEXTS="2048 4096 8192 16384" BEFORE_MAX=4096 STEPS=3 (environment)
set -euo pipefail
A=$1
B=$2
N=${3:-1}
TOKENS=${4:-/tmp/dtrain-ab-fortunes}
CONTEXTS=${CONTEXTS:-2048 4096 8192 16384}
BEFORE_MAX=${BEFORE_MAX:-4096}
STEPS=${STEPS:-3}
[[ -f $TOKENS/train.h5 ]] || "$B" convert text --inputs /usr/share/games/fortunes --out "$TOKENS" >/dev/null
source "$(dirname "$0")/train_runs.sh"
# run BINARY ARGS...: one training run of the Llama at batch 1, 1 thread.
run() {
  local bin=$1
  shift
  train_run "$bin" --model llama --batch-size 1 --threads 1 --steps "$STEPS" --warmup-steps 1 --eval-every 0 \
    --eval-batches 1 --progress off --data "$TOKENS" "$@"
}
echo "| model | context | before tokens/s | after tokens/s | after / before | before peak RSS MiB | after peak RSS MiB | after / before |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
measure() {  # measure LABEL CONTEXT ARGS...
  local label=$1 ctx=$2
  shift 2
  : >/tmp/lc-a.txt
  : >/tmp/lc-b.txt
  for ((i = 0; i < N; i++)); do
    if ((ctx <= BEFORE_MAX)); then run "$A" --context "$ctx" "$@" >>/tmp/lc-a.txt; fi
    run "$B" --context "$ctx" "$@" >>/tmp/lc-b.txt
  done
  local ar br am bm
  ar=$(awk '$1 != "-" {print $1}' /tmp/lc-a.txt | median)
  am=$(awk '$2 != "-" {print $2}' /tmp/lc-a.txt | median)
  br=$(awk '$1 != "-" {print $1}' /tmp/lc-b.txt | median)
  bm=$(awk '$2 != "-" {print $2}' /tmp/lc-b.txt | median)
  echo "| $label | $ctx | ${ar:--} | ${br:--} | $(ratio "$ar" "$br") | ${am:--} | ${bm:--} | $(ratio "$am" "$bm") |"
}
for ctx in $CONTEXTS; do
  measure "llama 6 x 256" "$ctx" --layers 6 --width 256 --heads 8 --kv-heads 2
done
measure "llama 2 x 128" 16384 --layers 2 --width 128 --heads 4 --kv-heads 2

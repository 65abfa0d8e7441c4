#!/usr/bin/env bash
# The language model's head at GPT-2's vocabulary (50257), one CPU rank: the head fused with its
# cross-entropy (DTRAIN_LM_HEAD=fused, the default: logits a 64 MiB chunk of rows at a time) against
# the whole [tokens, vocabulary] logits (materialized), runs alternating so both see the same
# machine: training tokens/s and peak resident memory (GNU time's maximum RSS).
#   benchmarks/micro/lm_head.sh DTRAIN [REPEATS] [TOKENS_DIR]
#   STEPS=3 THREADS=2 GPT_BATCHES="1 4" (environment)
set -euo pipefail
BIN=$1
N=${2:-1}
TOKENS=${3:-/tmp/dtrain-ab-fortunes}
STEPS=${STEPS:-3}
THREADS=${THREADS:-2}
[[ -f $TOKENS/train.h5 ]] || "$BIN" convert text --inputs /usr/share/games/fortunes --out "$TOKENS" >/dev/null
source "$(dirname "$0")/train_runs.sh"
# run PATH ARGS...: one training run with the head on PATH.
run() {
  local path=$1
  shift
  DTRAIN_LM_HEAD=$path train_run "$BIN" --vocab 50257 --context 1024 --threads "$THREADS" --steps "$STEPS" \
    --warmup-steps 1 --eval-every 0 --eval-batches 1 --progress off --data "$TOKENS" "$@"
}
echo "| model (vocabulary 50257, context 1024) | materialized tokens/s | fused tokens/s | fused / materialized | materialized peak RSS MiB | fused peak RSS MiB | fused / materialized |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
measure() {  # measure LABEL ARGS...
  local label=$1
  shift
  : >/tmp/lmh-a.txt
  : >/tmp/lmh-b.txt
  for ((i = 0; i < N; i++)); do
    run materialized "$@" >>/tmp/lmh-a.txt
    run fused "$@" >>/tmp/lmh-b.txt
  done
  local ar br am bm
  ar=$(awk '$1 != "-" {print $1}' /tmp/lmh-a.txt | median)
  am=$(awk '$2 != "-" {print $2}' /tmp/lmh-a.txt | median)
  br=$(awk '$1 != "-" {print $1}' /tmp/lmh-b.txt | median)
  bm=$(awk '$2 != "-" {print $2}' /tmp/lmh-b.txt | median)
  echo "| $label | ${ar:--} | ${br:--} | $(ratio "$ar" "$br") | ${am:--} | ${bm:--} | $(ratio "$am" "$bm") |"
}
for b in ${GPT_BATCHES:-1 4}; do
  measure "gpt 2 x 768 (12 heads), batch $b" --model gpt --layers 2 --width 768 --heads 12 --batch-size "$b"
done
measure "llama 2 x 64 (4 heads, 2 kv), batch 4" --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --batch-size 4
measure "llama 2 x 64 (4 heads, 2 kv), batch 16" --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --batch-size 16

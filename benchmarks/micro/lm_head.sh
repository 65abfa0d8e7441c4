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
median() { sort -n | awk '{v[NR] = $1} END {if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
# run PATH ARGS...: prints "tokens/s peak-RSS-MiB" of one training run with the head on PATH.
run() {
  local path=$1 out
  shift
  out=$(DTRAIN_LM_HEAD=$path /usr/bin/time -f 'maxrss %M' "$BIN" train --vocab 50257 --context 1024 \
    --threads "$THREADS" --steps "$STEPS" --warmup-steps 1 --eval-every 0 --eval-batches 1 --progress off \
    --data "$TOKENS" "$@" 2>&1) || {
    echo "run failed: $path $*" >&2
    echo "$out" | tail -5 >&2
    echo "- -"
    return
  }
  local rate rss
  rate=$(echo "$out" | grep -oE 'done: [0-9]+ steps, [0-9.]+ tokens/s' | awk '{print $4}')
  rss=$(echo "$out" | awk '/^maxrss/ {printf "%.0f", $2 / 1024}')
  echo "$rate $rss"
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
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "") print "-"; else printf "%.2f", b / a }'; }
  echo "| $label | ${ar:--} | ${br:--} | $(ratio "$ar" "$br") | ${am:--} | ${bm:--} | $(ratio "$am" "$bm") |"
}
for b in ${GPT_BATCHES:-1 4}; do
  measure "gpt 2 x 768 (12 heads), batch $b" --model gpt --layers 2 --width 768 --heads 12 --batch-size "$b"
done
measure "llama 2 x 64 (4 heads, 2 kv), batch 4" --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --batch-size 4
measure "llama 2 x 64 (4 heads, 2 kv), batch 16" --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --batch-size 16

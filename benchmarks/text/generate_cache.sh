#!/usr/bin/env bash
# Cached generation against recomputing the window: `dtrain generate --tokens 256 --temperature 0`
# with each layer's keys and values cached, and with --no-cache (the window recomputed for every
# token, as before), for a Llama and a GPT of 6 x 256 (context 512, so all 256 tokens are cached),
# trained a few steps on the fortunes; the same text both ways, tokens/s and the ratio, at 1 and 2
# threads. Prints a markdown table.
# usage: benchmarks/text/generate_cache.sh [DTRAIN_BIN] [WORK_DIR]
set -euo pipefail
bin=${1:-$(dirname "$0")/../../build/dtrain}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
[[ -f $work/tok/train.h5 ]] || "$bin" convert text --inputs /usr/share/games/fortunes --out "$work/tok" >/dev/null
echo "| model | threads | cached tokens/s | recomputed tokens/s | speed-up | same text |"
echo "| --- | ---: | ---: | ---: | ---: | --- |"
for model in llama gpt; do
  extra=()
  [[ $model == llama ]] && extra=(--kv-heads 2)
  "$bin" train --model $model --data "$work/tok" --layers 6 --width 256 --heads 8 --context 512 --batch-size 2 \
    --steps 20 --eval-every 0 --eval-batches 1 --progress off --checkpoint-dir "$work/$model" "${extra[@]}" >/dev/null
  for threads in 1 2; do
    gen=("$bin" generate --checkpoint "$work/$model" --prompt "The " --tokens 256 --temperature 0 --threads $threads)
    "${gen[@]}" >"$work/cached.txt" 2>"$work/cached.err"
    "${gen[@]}" --no-cache >"$work/window.txt" 2>"$work/window.err"
    c=$(sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p' "$work/cached.err")
    w=$(sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p' "$work/window.err")
    same=$(cmp -s "$work/cached.txt" "$work/window.txt" && echo yes || echo NO)
    echo "| $model 6x256 | $threads | $c | $w | $(awk -v a="$c" -v b="$w" 'BEGIN { printf "%.2fx", a / b }') | $same |"
  done
done

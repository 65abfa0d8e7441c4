#!/usr/bin/env bash
# The fixtures' runs: `layouts.sh names` lists them, `layouts.sh args LAYOUT TOKENS` gives the
# `dtrain train` words of one (without the steps and the checkpoint folder).
set -euo pipefail
gpt() {
  echo "--model gpt --data $1 --layers 2 --width 16 --heads 2 --context 16 --batch-size 4"
  echo "--lr 0.003 --eval-every 0 --threads 1 --progress off --log-every 1"
}
case $1 in
  names) echo dp zero1 zero3 tp2 pp2 topk ;;
  args)
    case $2 in
      dp) gpt "$3" ;;
      zero1) echo "$(gpt "$3") --zero 1" ;;
      zero3) echo "$(gpt "$3") --zero 3" ;;
      tp2) echo "$(gpt "$3") --tp 2" ;;
      pp2) echo "$(gpt "$3") --pp 2" ;;
      topk) echo "$(gpt "$3") --compression topk:0.05" ;;
      *) echo "unknown layout $2" >&2 && exit 2 ;;
    esac
    ;;
esac

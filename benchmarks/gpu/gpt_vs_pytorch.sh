#!/usr/bin/env bash
# The GPT of the model-parallel issue (6 layers, width 256, 8 heads, context 128, byte vocabulary,
# AdamW) trained on one GPU by dtrain (--device cuda) and by PyTorch (benchmarks/peers/torch_gpt.py),
# side by side in fp32 (TF32 off), tf32, bf16 and fp16 (dynamic loss scaling), on the fortunes token shards.
#   benchmarks/gpu/gpt_vs_pytorch.sh BATCH STEPS        (DTRAIN=path/to/dtrain, PYTHON=python3 with torch+h5py,
#   or TOKENS=the train tokens as .npy for a PyTorch without h5py; benchmarks/gpu/pack.sh writes one;
#   MODEL=llama: the Llama of the same size, 2 key/value heads; PRECISIONS="fp32 bf16": fewer precisions)
set -euo pipefail
B=${1:-8}
S=${2:-300}
DTRAIN=${DTRAIN:-build/dtrain}
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/fortunes}
MODEL=${MODEL:-gpt}
shape=(--model "$MODEL")
[[ $MODEL == llama ]] && shape+=(--kv-heads 2)
for p in ${PRECISIONS:-fp32 tf32 bf16 fp16}; do
  echo "== dtrain $MODEL $p batch $B"
  "$DTRAIN" train "${shape[@]}" --data "$DATA" --layers 6 --width 256 --heads 8 --context 128 --batch-size "$B" \
    --steps "$S" --eval-every 0 --eval-batches 4 --log-every "$S" --warmup-steps 10 --device cuda --precision "$p" |
    tail -n 4
  echo "== pytorch $MODEL $p batch $B"
  "$PYTHON" benchmarks/peers/torch_gpt.py "${shape[@]}" --device cuda --precision "$p" --batch "$B" --steps "$S" --warmup 10 \
    --tokens "${TOKENS:-$DATA/train.h5}" | tail -n 2
done

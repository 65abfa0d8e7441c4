#!/usr/bin/env bash
# dtrain export read by PyTorch (benchmarks/peers/check_export.py): a SimpleCNN trained briefly on
# Fashion-MNIST, a small GPT and a small Llama (benchmarks/peers/torch_llama.py, Hugging Face's names)
# on the fortunes, each exported as safetensors with PyTorch's names,
# loaded strictly into the PyTorch model: the same logits on a batch (1e-5) and the same test
# accuracy / bits per byte as dtrain eval; where torchvision is installed, also the model file
# examples/models/vit_mini.json against torchvision's VisionTransformer. Skips (77) where PyTorch is
# not installed.
# usage: export_pytorch.sh DTRAIN_BIN FASHION_MNIST_DIR WORK_DIR
set -euo pipefail
bin=$1 fmnist=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
check="$here/../../benchmarks/peers/check_export.py"
if ! /usr/bin/python3 -c "import torch, numpy, h5py" 2>/dev/null; then
  echo "skipped: no PyTorch (/usr/bin/python3 lacks torch, numpy or h5py; scripts/install-deps.sh installs them" \
    "unless DTRAIN_WITH_PYTORCH=0)"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
"$bin" train --model simple_cnn --data "$fmnist/train" --steps 150 --batch-size 64 --threads 1 --progress off \
  --checkpoint-dir "$work/cnn" >"$work/cnn.log" 2>&1 || { cat "$work/cnn.log"; exit 1; }
/usr/bin/python3 "$check" --dtrain "$bin" --checkpoint "$work/cnn" --data "$fmnist/test" --batch-size 64
"$bin" convert text --inputs /usr/share/games/fortunes --out "$work/fortunes" >/dev/null
"$bin" train --model gpt --data "$work/fortunes" --layers 2 --heads 2 --width 32 --context 32 --batch-size 8 \
  --steps 40 --threads 1 --progress off --checkpoint-dir "$work/gpt" >"$work/gpt.log" 2>&1 || { cat "$work/gpt.log"; exit 1; }
/usr/bin/python3 "$check" --dtrain "$bin" --checkpoint "$work/gpt" --data "$work/fortunes" --batch-size 16
"$bin" train --model llama --data "$work/fortunes" --layers 2 --heads 4 --kv-heads 2 --width 32 --context 32 \
  --batch-size 8 --steps 40 --threads 1 --progress off --checkpoint-dir "$work/llama" >"$work/llama.log" 2>&1 ||
  { cat "$work/llama.log"; exit 1; }
/usr/bin/python3 "$check" --dtrain "$bin" --checkpoint "$work/llama" --data "$work/fortunes" --batch-size 16
if /usr/bin/python3 -c "import torchvision" 2>/dev/null; then
  "$bin" train --model-file "$here/../../examples/models/vit_mini.json" --data "$fmnist/train" --steps 50 \
    --batch-size 64 --optimizer adamw --lr 0.001 --threads 1 --progress off --checkpoint-dir "$work/vit" \
    >"$work/vit.log" 2>&1 || { cat "$work/vit.log"; exit 1; }
  /usr/bin/python3 "$check" --dtrain "$bin" --checkpoint "$work/vit" --data "$fmnist/test" --batch-size 64
else
  echo "no torchvision: the ViT model file is not checked (python3-torchvision, DTRAIN_WITH_PEERS=1)"
fi
echo "PASS: the exports load into PyTorch and predict as dtrain does"

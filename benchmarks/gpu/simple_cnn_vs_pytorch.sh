#!/usr/bin/env bash
# SimpleCNN (synthetic 1x28x28 batches, SGD momentum) on one GPU: dtrain --device cuda against
# PyTorch (benchmarks/peers/torch_simple_cnn.py bench), with and without reading the loss back
# every step (dtrain always does). DTRAIN=path/to/dtrain, PYTHON=python3 with torch.
set -uo pipefail
DTRAIN=${DTRAIN:-build/dtrain}
PYTHON=${PYTHON:-python3}
for B in 64 256; do
  for p in fp32 tf32; do
    echo "== dtrain simple_cnn batch $B $p"
    timeout 120 "$DTRAIN" train --synthetic --model simple_cnn --synthetic-shape 1,28,28 --batch-size $B --steps 500 --log-every 500 --device cuda --precision $p --progress off 2>&1 | grep -E "done:|error"
    echo "== pytorch simple_cnn batch $B $p (loss read every step)"
    timeout 120 "$PYTHON" benchmarks/peers/torch_simple_cnn.py bench --device cuda --precision $p --batch-size $B --steps 500 --warmup 50 --read-loss | tail -n 1
    echo "== pytorch simple_cnn batch $B $p (no per-step read)"
    timeout 120 "$PYTHON" benchmarks/peers/torch_simple_cnn.py bench --device cuda --precision $p --batch-size $B --steps 500 --warmup 50 | tail -n 1
  done
done

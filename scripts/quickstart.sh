#!/usr/bin/env bash
# The main job from a fresh Debian 12 machine: install what is needed, build, convert the real
# Fashion-MNIST from the Debian package into HDF5 shards, and train SimpleCNN on 2 MPI ranks.
# Extra arguments go to `dtrain train` (for example --epochs 2).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
[[ -d data/fashion-mnist/train ]] || ./build/dtrain convert fashion-mnist --out data/fashion-mnist
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# Two ranks with a global batch of 64 (32 per rank) follow the single-rank reference recipe.
mpirun -n 2 --bind-to none ./build/dtrain train --config examples/fashion_cnn.ini --global-batch-size 64 \
  --metrics runs/fashion_cnn.jsonl --checkpoint-dir runs/fashion_cnn "$@"

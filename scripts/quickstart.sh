#!/usr/bin/env bash
# The main job from a fresh Debian 12 machine: install what it needs (no test tools, no SLURM
# daemons), build dtrain alone, convert the real Fashion-MNIST from the Debian package into HDF5
# shards, and train SimpleCNN on 2 MPI ranks. Extra arguments go to `dtrain train` (for example
# --epochs 2). scripts/test.sh installs and builds the rest in the same build/.
set -euo pipefail
cd "$(dirname "$0")/.."
DTRAIN_DEPS=run ./scripts/install-deps.sh
DTRAIN_BUILD_TESTS=OFF DTRAIN_BUILD_BENCHMARKS=OFF DTRAIN_BUILD_TARGET=dtrain ./scripts/build.sh
[[ -d data/fashion-mnist/train ]] || ./build/dtrain convert fashion-mnist --out data/fashion-mnist
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# Two ranks with a global batch of 64 (32 per rank) follow the single-rank reference recipe.
mpirun -n 2 --bind-to none ./build/dtrain train --config examples/fashion_cnn.ini --global-batch-size 64 \
  --metrics runs/fashion_cnn.jsonl --checkpoint-dir runs/fashion_cnn "$@"

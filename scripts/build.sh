#!/usr/bin/env bash
# Configures and builds dtrain in build/ (Release). The CUDA engine is built whenever nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DTRAIN_BUILD_JOBS:-$(nproc)}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDTRAIN_CUDA="${DTRAIN_CUDA:-AUTO}" ${DTRAIN_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs"

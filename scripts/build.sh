#!/usr/bin/env bash
# Configures and builds dtrain in build/ (Release). The CUDA engine is built whenever nvcc is found.
# DTRAIN_BUILD_TESTS / DTRAIN_BUILD_BENCHMARKS=OFF leave those out of the configuration, and
# DTRAIN_BUILD_TARGET names the one target to build (the quick start: dtrain alone); by default
# everything, tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DTRAIN_BUILD_JOBS:-$(nproc)}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDTRAIN_CUDA="${DTRAIN_CUDA:-AUTO}" \
  -DDTRAIN_BUILD_TESTS="${DTRAIN_BUILD_TESTS:-ON}" -DDTRAIN_BUILD_BENCHMARKS="${DTRAIN_BUILD_BENCHMARKS:-ON}" \
  ${DTRAIN_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs" ${DTRAIN_BUILD_TARGET:+--target "$DTRAIN_BUILD_TARGET"}

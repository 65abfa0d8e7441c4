#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in build-fuzz/ (clang++, ASan + UBSan; the GCC build in
# build/ is not touched) and runs the CTest label `fuzz`: each target for DTRAIN_FUZZ_SECONDS
# (default 60; scripts/test.sh runs it with 15) from its kept corpus, and every kept crash input
# once, DTRAIN_BUILD_JOBS targets at a time (as in build.sh: one per core). `fuzz.sh --configure`
# only configures build-fuzz/: scripts/sanitize.sh builds the unit and mpi tests there, on the same libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=${DTRAIN_BUILD_JOBS:-$(nproc)}
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DDTRAIN_FUZZ=ON -DDTRAIN_CUDA=OFF >/dev/null
if [[ ${1:-} == --configure ]]; then exit 0; fi
cmake --build build-fuzz --target dtrain_fuzz -j "$jobs"
cd build-fuzz
ctest --output-on-failure -L fuzz -j "$jobs"

#!/usr/bin/env bash
# Sets up everything and runs the whole test suite: unit tests, multi-rank tests under a real
# mpiexec (2 and 4 ranks), the convergence test on real Fashion-MNIST, and (as root) the cluster
# scripts on a real one-node SLURM started and stopped by the tests themselves (label slurm).
# DTRAIN_TEST_LABELS="-L unit" (ctest arguments) narrows the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
cd build
ctest --output-on-failure --timeout 1800 ${DTRAIN_TEST_LABELS:-} 

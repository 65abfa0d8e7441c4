#!/usr/bin/env bash
# The installed HDF5 is not thread-safe: every call in the process must hold h5::lock()
# (src/data/hdf5_util.h), or a loader thread opening a shard breaks the heap (a run's provenance
# once asked H5get_libversion unlocked). The files below take the lock around their calls; a call
# anywhere else fails this test, naming the file and line, until it goes through them.
# usage: hdf5_calls_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
allowed='^(src/data/[a-z_0-9]+\.cpp|include/dtrain/data/hdf5_util\.h|src/train/checkpoint\.cpp):'
calls=$(grep -rnE '\bH5[A-Za-z][A-Za-z0-9_]*[[:space:]]*\(' src comm parallel kernels include --include='*.cpp' \
  --include='*.h' --include='*.cu' --include='*.cuh' | grep -vE "$allowed" || true)
if [[ -n "$calls" ]]; then
  echo "FAIL: HDF5 called outside the files that hold its lock:"
  echo "$calls"
  exit 1
fi
echo "PASS: HDF5 is called only from $(grep -rlE '\bH5[A-Za-z][A-Za-z0-9_]*[[:space:]]*\(' src include | wc -l) files that take its lock"

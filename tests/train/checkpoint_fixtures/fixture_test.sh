#!/usr/bin/env bash
# Checkpoint sets written by an earlier binary (this folder's fixtures, make.sh) resume with this
# one: for each layout, the set of step 2 alone resumes into a fresh folder on 2 ranks and runs to
# step 4, and the set it writes there holds the state of the fixture's own step 4 (compare_sets:
# every tensor, optimizer state, compression residual and attribute; f32 within relative 1e-4, as
# the fixture may come from another processor).
# usage: fixture_test.sh DTRAIN_BIN COMPARE_SETS_BIN WORK_DIR
set -euo pipefail
bin=$1 compare=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
fixtures=$here/sets
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
rm -rf "$work" && mkdir -p "$work"
failed=0
for layout in $("$here/layouts.sh" names); do
  mkdir -p "$work/$layout"
  cp "$fixtures/$layout"/ckpt-step000000002* "$work/$layout/"
  # shellcheck disable=SC2046
  if ! timeout 300 mpirun -n 2 --oversubscribe --bind-to none "$bin" train \
    $("$here/layouts.sh" args "$layout" "$fixtures/tok") --steps 4 --checkpoint-every 2 \
    --checkpoint-dir "$work/$layout" --resume "$work/$layout" >"$work/$layout.log" 2>&1; then
    cat "$work/$layout.log"
    echo "FAIL ($layout): the resume from the fixture's step 2 failed"
    failed=1
    continue
  fi
  grep -q "resum.* step 2" "$work/$layout.log" || {
    cat "$work/$layout.log"
    echo "FAIL ($layout): the run did not say it resumed at step 2"
    failed=1
  }
  echo "== $layout"
  "$compare" "$work/$layout/ckpt-step000000004.h5" "$fixtures/$layout/ckpt-step000000004.h5" 1e-4 ||
    failed=1
done
exit $failed

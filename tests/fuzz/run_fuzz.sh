#!/usr/bin/env bash
# Runs one libFuzzer target as the CTest label `fuzz` does (tests/fuzz/CMakeLists.txt):
#   run_fuzz.sh BINARY NAME SOURCE_DIR WORK_DIR                fuzz for DTRAIN_FUZZ_SECONDS (default 60)
#   run_fuzz.sh BINARY NAME SOURCE_DIR WORK_DIR --regressions  every kept input once
# Fuzzing starts from the kept corpus (corpus/NAME/, regressions/NAME/) and what earlier runs found
# (WORK_DIR/corpus, in the build tree: the kept corpus is never written). A finding in dtrain stops
# the run and fails it, its input saved as WORK_DIR/artifacts/crash-* (or leak-, timeout-, oom-):
# fix the reader, then keep the input under regressions/NAME/. A crash inside libhdf5 on memory it
# allocated, or libhdf5 running out of memory (triage.sh: HDF5 1.10.8's own bug on a malformed
# file, which dtrain cannot fix), is set
# aside in WORK_DIR/hdf5/ and fuzzing goes on; such inputs worth keeping go to known-hdf5/NAME/.
# --regressions runs regressions/NAME/ (no finding allowed) and known-hdf5/NAME/ (a crash only
# inside libhdf5 allowed). DTRAIN_FUZZ_ARGS adds libFuzzer options (e.g. -max_len=65536).
# DTRAIN_FUZZ_SEED=N makes the run repeatable (libFuzzer's -seed, N + k after the k-th set-aside
# crash); without it every run draws its own seed and explores further.
set -euo pipefail
bin=$(realpath "$1") name=$2 src=$3 work=$4
root=$(cd "$src/../.." && pwd)
mkdir -p "$work/corpus" "$work/artifacts"
# fuzz_NAME and fuzz_NAME_regressions share WORK_DIR and may run at once (ctest -j): one log each.
log=$work/last${5:+-regressions}.log
# A hang is an input that runs 20 s; a resident set above 2 GiB is a finding too.
opts=(-timeout=20 -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/")
if [[ -f $src/dict/$name.dict ]]; then opts+=(-dict="$src/dict/$name.dict"); fi
# HDF5 mallocs what a malformed file's metadata declares (43 GB seen): above 2 GiB, malloc returns
# NULL, as the system would refuse it, and HDF5 fails cleanly; operator new (dtrain's allocations)
# still aborts there, so a size dtrain did not check remains a finding. HDF5's own leaks: lsan.supp.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:max_allocation_size_mb=2048}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$src/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

if [[ ${5:-} == --regressions ]]; then
  shopt -s nullglob
  status=0
  for input in "$src/regressions/$name"/*; do
    if ! "$bin" "${opts[@]}" "$input" >"$log" 2>&1; then
      cat "$log"
      echo "run_fuzz: regressions/$name/$(basename "$input") is a finding again" >&2
      status=1
    fi
  done
  for input in "$src/known-hdf5/$name"/*; do
    if ! "$bin" "${opts[@]}" "$input" >"$log" 2>&1 && [[ $("$src/triage.sh" "$log" "$root" "$bin") != hdf5 ]]; then
      cat "$log"
      echo "run_fuzz: known-hdf5/$name/$(basename "$input") now fails outside libhdf5" >&2
      status=1
    fi
  done
  exit $status
fi

dirs=("$work/corpus")
for d in "$src/corpus/$name" "$src/regressions/$name"; do
  if [[ -d $d ]]; then dirs+=("$d"); fi
done
seconds=${DTRAIN_FUZZ_SECONDS:-60}
end=$((SECONDS + seconds))
runs=0 set_aside=0
while ((SECONDS < end)); do
  start=$SECONDS
  seed=()
  if [[ -n ${DTRAIN_FUZZ_SEED:-} ]]; then seed=(-seed=$((DTRAIN_FUZZ_SEED + set_aside))); fi
  if "$bin" "${opts[@]}" "${seed[@]}" -max_total_time=$((end - SECONDS)) -print_final_stats=1 ${DTRAIN_FUZZ_ARGS:-} "${dirs[@]}" \
    >"$log" 2>&1; then
    status=0
  else
    status=$?
  fi
  done_here=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  runs=$((runs + ${done_here:-0}))
  if ((status == 0)); then break; fi
  artifact=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
  if [[ -n $artifact && -f $artifact && $("$src/triage.sh" "$log" "$root" "$bin") == hdf5 ]]; then
    mkdir -p "$work/hdf5"
    mv "$artifact" "$work/hdf5/"
    set_aside=$((set_aside + 1))
    echo "run_fuzz: $name: a crash or out-of-memory inside libhdf5 after $((SECONDS - start)) s (HDF5's own bug): $work/hdf5/$(basename "$artifact")"
    continue
  fi
  cat "$log"
  echo "run_fuzz: $name: a finding in dtrain (input: ${artifact:-none saved}); fix it, then keep the input under" \
    "tests/fuzz/regressions/$name/" >&2
  exit 1
done
echo "run_fuzz: $name: $runs inputs in $seconds s ($((runs / (seconds > 0 ? seconds : 1))) exec/s)," \
  "$(find "$work/corpus" -type f | wc -l) in the work corpus, $set_aside crash(es) inside libhdf5 set aside"

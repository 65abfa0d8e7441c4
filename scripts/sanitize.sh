#!/usr/bin/env bash
# Runs the tests under sanitizers, in clang builds of their own (the GCC build in build/ is not
# touched); any sanitizer report fails the test that made it.
#  - ASan + UBSan: the unit and mpi labels (not the convergence, cluster and install folders: whole
#    trainings, a build against the installed package), built in build-fuzz/ with scripts/fuzz.sh's
#    configuration, so the libraries are compiled once for both. Left out to fit CI's time: the 3-
#    and 4-rank variants (the same code as at 2 ranks, waiting on 2 cores; the allreduce's fake-node
#    layouts stay), the tests that train for minutes under ASan (the GPT with every compressor and
#    its resume: the compressors run in comm_compression_test and parallel_test; the ResNet-20
#    pipelines: the SimpleCNN ones run; the GPT pipeline through the CLI), and the straggler test,
#    which times ranks that the sanitizer and the shared cores slow unevenly.
#  - TSan: build-tsan/ (-DDTRAIN_TSAN=ON) holds only dtrain_core, dtrain_comm, dtrain_data and the
#    tests labelled tsan: the communicators' worker threads, the control channel and its timeouts,
#    the threaded loader. None of these uses OpenMP (libgomp is not TSan-aware).
# Third-party noise is suppressed in tests/sanitizers/lsan.supp and by TSAN_OPTIONS below, each with
# its reason. DTRAIN_SANITIZE=address or =thread runs one of the two; DTRAIN_BUILD_JOBS as in build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
root=$(pwd)
jobs=${DTRAIN_BUILD_JOBS:-$(nproc)}
which=${DTRAIN_SANITIZE:-all}
status=0

if [[ $which == all || $which == address ]]; then
  ./scripts/fuzz.sh --configure
  cmake --build build-fuzz -j "$jobs"
  # Leaks are findings; Open MPI's own ones at exit are suppressed (lsan.supp).
  slow=LmDataParallel.EveryCompressorTrainsNearTheUncompressedRun:LmDataParallel.CompressedRunsResumeExactly
  slow+=:ImagePipeline.Resnet20*:Straggler.*
  # Left out as well: the memory tests, which ASan's shadow mapping (terabytes of address space, no
  # prlimit --as holds) and its quarantine (freed memory kept resident) cannot run; and the attention
  # oracle at 1000 tokens (the same code paths as at 256, 6 minutes under ASan).
  memory='Cli.Context16kTrainsUnderATwoGiBCap|Cli.Vocab50257TrainsUnderACap|Cli.EvalSplitsABatchThatWouldNotFit|FusedVsMaterialised.*/T1000_'
  ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 GTEST_FILTER=-$slow \
    ctest --test-dir build-fuzz --output-on-failure -L 'unit|mpi' -E "_np[34]\$|CliMpi.GptPipeline|$memory" -j "$jobs" ||
    status=$?
fi

if [[ $which == all || $which == thread ]]; then
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DDTRAIN_TSAN=ON -DDTRAIN_CUDA=OFF >/dev/null
  cmake --build build-tsan --target dtrain_tsan_tests -j "$jobs"
  # ignore_noninstrumented_modules: memory accesses that uninstrumented libraries make through
  # TSan's interceptors (memcpy, pthread_cond_destroy, ...) are not checked, while their locks still
  # count. Open MPI hands finished requests between threads with its own atomics, which TSan cannot
  # see: whichever thread drives progress (the control thread, a worker) copies a message into a
  # buffer another thread posted, and every such copy read as a race. dtrain's code stays checked.
  # A failed test runs once more: Open MPI 4.1's mpiexec at times never returns after its ranks
  # have ended, on this slow instrumented build under load (2026-11-27: comm_collectives_test_np4 and
  # comm_early_exit_np2 left mpiexec polling with no rank alive, the same tests passing in 7 s).
  TSAN_OPTIONS=ignore_noninstrumented_modules=1 \
    ctest --test-dir build-tsan --output-on-failure -L tsan -j "$jobs" --repeat until-pass:2 || status=$?
fi
exit $status

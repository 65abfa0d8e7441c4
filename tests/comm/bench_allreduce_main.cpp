// Runs `dtrain bench allreduce` (src/cli/cmd_bench_allreduce.cpp) on its own, so CTest can check
// it (with --check) without the whole CLI.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "dtrain/comm/runtime.h"

int main(int argc, char** argv) {
  try {
    int rc = dtrain::cli::cmd_bench_allreduce(argc, argv);
    dtrain::comm::Runtime::finalize();
    return rc;
  } catch (const std::exception& e) {
    dtrain::comm::Runtime::abort(1, e.what());
  }
}

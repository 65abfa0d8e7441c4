#include <cstring>
#include <string>

#include "commands.h"
#include "dtrain/core/error.h"

namespace dtrain::cli {

int cmd_bench(int argc, char** argv) {
  std::string kind = argc > 1 ? argv[1] : "";
  if (kind == "gemm") return cmd_bench_gemm(argc - 1, argv + 1);
  if (kind == "allreduce") return cmd_bench_allreduce(argc - 1, argv + 1);
  if (kind.empty() || kind == "--help" || kind == "-h") {
    std::printf("usage: dtrain bench <gemm|allreduce> [options]   (dtrain bench <kind> --help)\n");
    return kind.empty() ? 2 : 0;
  }
  throw InputError("unknown benchmark '" + kind + "' (gemm, allreduce)");
}

}  // namespace dtrain::cli
// TEMPORARY-WEAK: removed once comm lands cmd_bench_allreduce.cpp
namespace dtrain::cli {
[[gnu::weak]] int cmd_bench_allreduce(int, char**) { throw InputError("allreduce benchmark not built"); }
}  // namespace dtrain::cli

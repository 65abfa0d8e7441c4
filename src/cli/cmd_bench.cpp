#include <cstring>
#include <string>

#include "commands.h"
#include "dtrain/core/error.h"

namespace dtrain::cli {

int cmd_bench(int argc, char** argv) {
  std::string kind = argc > 1 ? argv[1] : "";
  if (kind == "gemm") return cmd_bench_gemm(argc - 1, argv + 1);
  if (kind == "allreduce") return cmd_bench_allreduce(argc - 1, argv + 1);
  if (kind == "lm-gemm") return cmd_bench_lm_gemm(argc - 1, argv + 1);
  if (kind == "attention") return cmd_bench_attention(argc - 1, argv + 1);
  if (kind.empty() || kind == "--help" || kind == "-h") {
    std::printf("usage: dtrain bench <gemm|allreduce|lm-gemm|attention> [options]   (dtrain bench <kind> --help)\n");
    return kind.empty() ? 2 : 0;
  }
  throw InputError("unknown benchmark '" + kind + "' (gemm, allreduce, lm-gemm, attention)");
}

}  // namespace dtrain::cli

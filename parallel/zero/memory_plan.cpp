#include "dtrain/parallel/zero/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>

namespace dtrain::parallel {

ModelStateBytes plan_model_state(int64_t params, int64_t trained, const std::vector<int64_t>& unit_params, int zero,
                                 int dp_ranks, int optimizer_floats, bool prefetch) {
  const int64_t n = std::max(dp_ranks, 1), f32 = 4;
  const auto slice = [&](int64_t floats) { return (floats + n - 1) / n * f32; };  // one rank's 1/n
  ModelStateBytes b;
  b.parameters = zero >= 3 ? 0 : f32 * params;
  b.gradients = zero >= 2 ? 0 : f32 * trained;
  b.optimizer = zero >= 1 ? slice(optimizer_floats * trained) : f32 * optimizer_floats * trained;
  // The shards: ZeRO-1 a master and a gradient slice of the trained parameters, ZeRO-2 a gradient
  // slice, ZeRO-3 the masters of every parameter and the gradient slice.
  b.shards = zero == 1 ? slice(2 * trained) : zero == 2 ? slice(trained) : zero == 3 ? slice(params) + slice(trained) : 0;
  if (zero >= 3) {
    std::vector<int64_t> largest = unit_params;
    std::sort(largest.begin(), largest.end(), std::greater<>());
    largest.resize(std::min<size_t>(largest.size(), prefetch ? 3 : 2));
    for (int64_t u : largest) b.gathered += f32 * u;
  }
  return b;
}

std::string describe(const ModelStateBytes& b) {
  // In GiB, or in MiB below one GiB.
  const bool large = b.total() >= (int64_t{1} << 30);
  const double unit = large ? 1073741824.0 : 1048576.0;
  const auto v = [&](int64_t bytes) { return static_cast<double>(bytes) / unit; };
  char s[256];
  std::snprintf(
      s, sizeof s,
      "%.2f %s (parameters %.2f, gradients %.2f, optimizer state %.2f, ZeRO shards %.2f, gathered units %.2f)",
      v(b.total()), large ? "GiB" : "MiB", v(b.parameters), v(b.gradients), v(b.optimizer), v(b.shards), v(b.gathered));
  return s;
}

std::string bytes_text(int64_t bytes) {
  char s[32];
  if (bytes >= (int64_t{1} << 30))
    std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  else
    std::snprintf(s, sizeof s, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  return s;
}

}  // namespace dtrain::parallel

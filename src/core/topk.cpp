#include "dtrain/core/topk.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dtrain {

std::vector<int32_t> topk_abs_indices(const float* x, int64_t n, int64_t k) {
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  // Larger magnitude first; equal magnitudes by lower index.
  auto before = [x](int32_t a, int32_t b) {
    float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa > fb || (fa == fb && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace dtrain

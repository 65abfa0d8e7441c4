// The encodings behind the compressors, as plain functions.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "dtrain/comm/compression.h"
#include "dtrain/core/topk.h"

namespace dtrain::comm::codec {

std::vector<int32_t> topk_indices(const float* x, int64_t n, int64_t k) { return topk_abs_indices(x, n, k); }

void pack_signs(const float* x, int64_t n, uint8_t* bits) {
  std::fill(bits, bits + (n + 7) / 8, uint8_t{0});
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= 0) bits[i >> 3] = static_cast<uint8_t>(bits[i >> 3] | (1u << (i & 7)));
}

float qsgd_encode(const float* x, int64_t n, int levels, Rng& rng, int8_t* q) {
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(x[i]) * x[i];
  float norm = static_cast<float>(std::sqrt(sq));
  for (int64_t i = 0; i < n; ++i) {
    float u = rng.uniform();  // drawn for every element, so the stream does not depend on values
    if (norm == 0) {
      q[i] = 0;
      continue;
    }
    float level = std::fabs(x[i]) * static_cast<float>(levels) / norm;
    float lower = std::floor(level);
    int l = static_cast<int>(lower) + (u < level - lower ? 1 : 0);
    l = std::min(l, levels);
    q[i] = static_cast<int8_t>(x[i] < 0 ? -l : l);
  }
  return norm;
}

void orthonormalize_columns(float* m, int64_t rows, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t p = 0; p < c; ++p) {
      double dot = 0;
      for (int64_t i = 0; i < rows; ++i) dot += static_cast<double>(m[i * cols + c]) * m[i * cols + p];
      for (int64_t i = 0; i < rows; ++i) m[i * cols + c] -= static_cast<float>(dot) * m[i * cols + p];
    }
    double sq = 0;
    for (int64_t i = 0; i < rows; ++i) sq += static_cast<double>(m[i * cols + c]) * m[i * cols + c];
    double norm = std::sqrt(sq);
    float inv = norm > 1e-20 ? static_cast<float>(1.0 / norm) : 0.0f;  // a null column stays null
    for (int64_t i = 0; i < rows; ++i) m[i * cols + c] *= inv;
  }
}

}  // namespace dtrain::comm::codec

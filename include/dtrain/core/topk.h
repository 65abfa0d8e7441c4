#pragma once
// Top-k selection by magnitude, shared by the communication layer's top-k compressor and the CPU
// engine's topk_abs, so both pick the same indices.
#include <cstdint>
#include <vector>

namespace dtrain {

// The indices of the k largest |x[i]| of x[0, n) in ascending order; equal magnitudes go to the
// lower index, so every rank and every run agree. k is clamped to [0, n].
std::vector<int32_t> topk_abs_indices(const float* x, int64_t n, int64_t k);

}  // namespace dtrain

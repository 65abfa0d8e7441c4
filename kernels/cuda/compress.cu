// Top-k gradient sparsification on the GPU. The selection is CUB's radix sort (stable) of the
// magnitudes as u32 keys (for non-negative floats the bit pattern orders like the value), descending,
// with the indices as values: equal magnitudes keep ascending index order, as the CPU engine's
// nth_element with its lower-index tie-break picks them. The first k indices are then sorted
// ascending, so both engines give the same idx array.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>

#include "cuda_common.h"
#include "dtrain/core/error.h"
#include "kernels.h"

namespace dtrain::cuda::k {

namespace {

inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535)); }

__global__ void magnitude_keys(const float* x, uint32_t* keys, int32_t* order, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    keys[i] = __float_as_uint(fabsf(x[i]));
    order[i] = static_cast<int32_t>(i);
  }
}

__global__ void gather_clear_kernel(float* x, const int32_t* idx, float* vals, int64_t k) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    int32_t i = idx[j];
    if (vals) vals[j] = x[i];
    x[i] = 0.f;
  }
}

// Distinct indices within one launch: no two threads touch the same element.
__global__ void scatter_add_kernel(const int32_t* idx, const float* vals, float* y, int64_t k) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += gridDim.x * static_cast<int64_t>(blockDim.x))
    y[idx[j]] += vals[j];
}

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    ::dtrain::detail::throw_error("cuda", std::string(what) + ": " + cudaGetErrorString(rc), __FILE__, __LINE__);
}

}  // namespace

size_t topk_scratch_bytes(int64_t n, int64_t k) {
  size_t sort_all = 0, sort_k = 0;
  check(cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_all, static_cast<const uint32_t*>(nullptr),
                                                  static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                  static_cast<int32_t*>(nullptr), static_cast<int>(n)),
        "cub SortPairsDescending (size query)");
  check(cub::DeviceRadixSort::SortKeys(nullptr, sort_k, static_cast<const int32_t*>(nullptr),
                                       static_cast<int32_t*>(nullptr), static_cast<int>(k)),
        "cub SortKeys (size query)");
  return std::max(sort_all, sort_k);
}

void topk_abs(const float* x, int64_t n, int64_t k, int32_t* idx, uint32_t* keys, int32_t* order, void* scratch,
              size_t scratch_bytes, cudaStream_t s) {
  if (n <= 0 || k <= 0) return;
  magnitude_keys<<<blocks_for(n), 256, 0, s>>>(x, keys, order, n);
  DT_CUDA_LAUNCHED();
  size_t bytes = scratch_bytes;
  check(cub::DeviceRadixSort::SortPairsDescending(scratch, bytes, keys, keys + n, order, order + n, static_cast<int>(n),
                                                  0, 32, s),
        "cub SortPairsDescending");
  // Indices are non-negative: 31 bits order them.
  bytes = scratch_bytes;
  check(cub::DeviceRadixSort::SortKeys(scratch, bytes, order + n, idx, static_cast<int>(k), 0, 31, s), "cub SortKeys");
}

void gather_and_clear(float* x, const int32_t* idx, float* vals, int64_t k, cudaStream_t s) {
  if (k > 0) gather_clear_kernel<<<blocks_for(k), 256, 0, s>>>(x, idx, vals, k);
  DT_CUDA_LAUNCHED();
}

void scatter_add(const int32_t* idx, const float* vals, float* y, int64_t k, cudaStream_t s) {
  if (k > 0) scatter_add_kernel<<<blocks_for(k), 256, 0, s>>>(idx, vals, y, k);
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

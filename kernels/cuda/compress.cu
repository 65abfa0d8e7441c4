// Top-k gradient sparsification on the GPU. The selection is CUB's radix sort (stable) of the
// magnitudes as u32 keys (for non-negative floats the bit pattern orders like the value), descending,
// with the indices as values: equal magnitudes keep ascending index order, as the CPU engine's
// nth_element with its lower-index tie-break picks them. The first k indices are then sorted
// ascending, so both engines give the same idx array.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>

#include "cuda_common.h"
#include "dtrain/core/error.h"
#include "dtrain/kernels/functors.h"
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

// One block sums |x| (or x^2) in f64 in a fixed order (strided per thread, then a tree), so the
// result is the same on every run: the payload's first 4 bytes get the f32 mean |x| (or the norm).
constexpr int kReduceThreads = 1024;
__global__ void payload_header_kernel(const float* x, int64_t n, bool norm, uint8_t* payload) {
  __shared__ double part[kReduceThreads];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += norm ? static_cast<double>(x[i]) * x[i] : fabs(x[i]);
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float v =
        norm ? static_cast<float>(sqrt(part[0])) : (n > 0 ? static_cast<float>(part[0] / static_cast<double>(n)) : 0.f);
    *reinterpret_cast<float*>(payload) = v;  // a payload's own buffer: aligned
  }
}

// Byte j of the sign bits, and what was sent leaves x (each thread owns 8 elements).
__global__ void sign_pack_kernel(float* x, int64_t n, uint8_t* payload) {
  const float scale = fn::payload_head(payload);
  uint8_t* bits = payload + 4;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < (n + 7) / 8;
       j += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    const uint8_t byte = fn::sign_byte(x, n, j);
    bits[j] = byte;
    for (int b = 0; b < 8 && 8 * j + b < n; ++b) x[8 * j + b] -= scale * ((byte >> b) & 1 ? 1.f : -1.f);
  }
}

__global__ void sign_unpack_add_kernel(const uint8_t* payload, int64_t n, float* y) {
  const float scale = fn::payload_head(payload);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    y[i] += scale * fn::sign_unit(payload + 4, i);
}

__global__ void qsgd_pack_kernel(const float* x, int64_t n, int levels, uint64_t seed, uint8_t* payload) {
  const float norm = fn::payload_head(payload);
  auto* q = reinterpret_cast<int8_t*>(payload + 4);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    q[i] = norm > 0.f ? fn::qsgd_level(x[i], norm, levels, fn::hash_uniform(seed, static_cast<uint64_t>(i))) : 0;
}

__global__ void qsgd_unpack_add_kernel(const uint8_t* payload, int64_t n, int levels, float* y) {
  const float norm = fn::payload_head(payload);
  const auto* q = reinterpret_cast<const int8_t*>(payload + 4);
  const float s = static_cast<float>(levels);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    y[i] += norm * static_cast<float>(q[i]) / s;
}

// Gram-Schmidt, column after column, in one block (PowerSGD's P has few columns): each dot product
// and norm is an f64 block reduction in a fixed order.
__device__ double block_sum(double v, double* part) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  const double total = part[0];
  __syncthreads();
  return total;
}

__global__ void orthonormalize_kernel(float* m, int64_t rows, int64_t cols) {
  __shared__ double part[kReduceThreads];
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t p = 0; p < c; ++p) {
      double acc = 0;
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x)
        acc += static_cast<double>(m[i * cols + c]) * m[i * cols + p];
      const float dot = static_cast<float>(block_sum(acc, part));
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) m[i * cols + c] -= dot * m[i * cols + p];
      __syncthreads();
    }
    double acc = 0;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x)
      acc += static_cast<double>(m[i * cols + c]) * m[i * cols + c];
    const double norm = sqrt(block_sum(acc, part));
    const float inv = norm > 1e-20 ? static_cast<float>(1.0 / norm) : 0.f;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) m[i * cols + c] *= inv;
    __syncthreads();
  }
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

void sign_encode(float* x, int64_t n, uint8_t* payload, cudaStream_t s) {
  payload_header_kernel<<<1, kReduceThreads, 0, s>>>(x, n, false, payload);
  DT_CUDA_LAUNCHED();
  if (n > 0) sign_pack_kernel<<<blocks_for((n + 7) / 8), 256, 0, s>>>(x, n, payload);
  DT_CUDA_LAUNCHED();
}

void sign_decode_add(const uint8_t* payload, int64_t n, float* y, cudaStream_t s) {
  if (n > 0) sign_unpack_add_kernel<<<blocks_for(n), 256, 0, s>>>(payload, n, y);
  DT_CUDA_LAUNCHED();
}

void qsgd_encode(const float* x, int64_t n, int levels, uint64_t seed, uint8_t* payload, cudaStream_t s) {
  payload_header_kernel<<<1, kReduceThreads, 0, s>>>(x, n, true, payload);
  DT_CUDA_LAUNCHED();
  if (n > 0) qsgd_pack_kernel<<<blocks_for(n), 256, 0, s>>>(x, n, levels, seed, payload);
  DT_CUDA_LAUNCHED();
}

void qsgd_decode_add(const uint8_t* payload, int64_t n, int levels, float* y, cudaStream_t s) {
  if (n > 0) qsgd_unpack_add_kernel<<<blocks_for(n), 256, 0, s>>>(payload, n, levels, y);
  DT_CUDA_LAUNCHED();
}

void orthonormalize_columns(float* m, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows > 0 && cols > 0) orthonormalize_kernel<<<1, kReduceThreads, 0, s>>>(m, rows, cols);
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

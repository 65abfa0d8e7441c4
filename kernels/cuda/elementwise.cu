// Element-wise kernels of the CUDA engine. The arithmetic is the functors of
// dtrain/kernels/functors.h, the same the CPU engine loops over, so the CPU tests cover it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.h"
#include "dtrain/kernels/functors.h"
#include "kernels.h"

namespace dtrain::cuda::k {

namespace {

constexpr int kThreads = 256;

// Grid-stride launches: enough blocks to fill the device, capped so huge n do not need huge grids.
inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

#define DT_GRID_STRIDE(i, n)                                                             \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += gridDim.x * static_cast<int64_t>(blockDim.x))

// x, y: [n]
template <typename F>
__global__ void map1_kernel(const float* x, float* y, int64_t n, F f) {
  DT_GRID_STRIDE(i, n) y[i] = f(x[i]);
}
// a, b, y: [n]
template <typename F>
__global__ void map2_kernel(const float* a, const float* b, float* y, int64_t n, F f) {
  DT_GRID_STRIDE(i, n) y[i] = f(a[i], b[i]);
}

template <typename F>
void map1(const float* x, float* y, int64_t n, F f, cudaStream_t s) {
  if (n > 0) map1_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n, f);
  DT_CUDA_LAUNCHED();
}
template <typename F>
void map2(const float* a, const float* b, float* y, int64_t n, F f, cudaStream_t s) {
  if (n > 0) map2_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, b, y, n, f);
  DT_CUDA_LAUNCHED();
}

struct Fill {
  float v;
  __device__ float operator()(float) const { return v; }
};

__global__ void dropout_kernel(float* mask, int64_t n, fn::DropoutMask f) {
  DT_GRID_STRIDE(i, n) mask[i] = f(static_cast<uint64_t>(i));
}

// Casts; the 16-bit types travel as raw uint16_t.
__global__ void f32_to_bf16_kernel(const float* s, uint16_t* d, int64_t n) {
  DT_GRID_STRIDE(i, n) d[i] = float_to_bf16(s[i]);  // the host's rounding, shared through dtype.h
}
__global__ void bf16_to_f32_kernel(const uint16_t* s, float* d, int64_t n) {
  DT_GRID_STRIDE(i, n) d[i] = bf16_to_float(s[i]);
}
// f32 -> bf16 -> f32 in one pass: the value a bf16 copy would hold, kept in f32.
__global__ void round_to_bf16_kernel(const float* s, float* d, int64_t n) {
  DT_GRID_STRIDE(i, n) d[i] = bf16_to_float(float_to_bf16(s[i]));
}
__global__ void f32_to_f16_kernel(const float* s, uint16_t* d, int64_t n) {
  DT_GRID_STRIDE(i, n) d[i] = __half_as_ushort(__float2half_rn(s[i]));
}
__global__ void f16_to_f32_kernel(const uint16_t* s, float* d, int64_t n) {
  DT_GRID_STRIDE(i, n) d[i] = __half2float(__ushort_as_half(s[i]));
}

// y [M,N] += bias [N]
__global__ void add_row_bias_kernel(float* y, const float* bias, int64_t m, int64_t n) {
  DT_GRID_STRIDE(i, m * n) y[i] += bias[i % n];
}
// dbias [N] += column sums of dy [M,N]: a 32x8 tile of threads per block column strip; threads of a
// warp read consecutive columns (coalesced), the 8 row-groups meet in shared memory.
__global__ void row_bias_grad_kernel(const float* dy, float* dbias, int64_t m, int64_t n) {
  __shared__ float part[8][33];
  int64_t col = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (col < n)
    for (int64_t r = threadIdx.y; r < m; r += 8) acc += dy[r * n + col];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float t = 0.f;
    for (int j = 0; j < 8; ++j) t += part[j][threadIdx.x];
    dbias[col] += t;
  }
}

__device__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// *out += sum x^2 (f64): per-thread partials, a warp shuffle, one atomic per warp.
__global__ void sum_squares_kernel(const float* x, int64_t n, double* out) {
  double acc = 0;
  DT_GRID_STRIDE(i, n) acc += static_cast<double>(x[i]) * x[i];
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

__global__ void unscale_check_kernel(float* x, int64_t n, fn::Unscale f, float* found_inf) {
  int bad = 0;
  DT_GRID_STRIDE(i, n) {
    float v = f(x[i]);
    x[i] = v;
    bad |= !fn::is_finite(v);
  }
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found_inf = 1.f;
}

// Read-only: x is not written (another stream may be reading it).
__global__ void check_finite_kernel(const float* x, int64_t n, float* found_inf) {
  int bad = 0;
  DT_GRID_STRIDE(i, n) bad |= !fn::is_finite(x[i]);
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found_inf = 1.f;
}

}  // namespace

void unary_forward(Unary op, const float* x, float* y, int64_t n, cudaStream_t s) {
  if (op == Unary::Relu)
    map1(x, y, n, fn::Relu{}, s);
  else if (op == Unary::GeluExact)
    map1(x, y, n, fn::GeluExact{}, s);
  else
    map1(x, y, n, fn::Gelu{}, s);
}
void unary_backward(Unary op, const float* x, const float* dy, float* dx, int64_t n, cudaStream_t s) {
  if (op == Unary::Relu)
    map2(x, dy, dx, n, fn::ReluGrad{}, s);
  else if (op == Unary::GeluExact)
    map2(x, dy, dx, n, fn::GeluExactGrad{}, s);
  else
    map2(x, dy, dx, n, fn::GeluGrad{}, s);
}
void mul(const float* a, const float* b, float* y, int64_t n, cudaStream_t s) { map2(a, b, y, n, fn::Mul{}, s); }
void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s) { map2(a, b, y, n, fn::Add{}, s); }
void axpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t s) { map2(x, y, y, n, fn::Axpy{alpha}, s); }
void scale(float* y, float alpha, int64_t n, cudaStream_t s) { map1(y, y, n, fn::Scale{alpha}, s); }
void fill(float* y, float value, int64_t n, cudaStream_t s) { map1(y, y, n, Fill{value}, s); }

void dropout_mask(float* mask, float p, uint64_t seed, int64_t n, cudaStream_t s) {
  if (n > 0) dropout_kernel<<<blocks_for(n), kThreads, 0, s>>>(mask, n, fn::DropoutMask{p, 1.f / (1.f - p), seed});
  DT_CUDA_LAUNCHED();
}

void cast(const void* src, DType from, void* dst, DType to, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  unsigned b = blocks_for(n);
  auto f32in = static_cast<const float*>(src);
  auto u16in = static_cast<const uint16_t*>(src);
  if (from == DType::F32 && to == DType::BF16) {
    f32_to_bf16_kernel<<<b, kThreads, 0, s>>>(f32in, static_cast<uint16_t*>(dst), n);
    DT_CUDA_LAUNCHED();
  } else if (from == DType::BF16 && to == DType::F32) {
    bf16_to_f32_kernel<<<b, kThreads, 0, s>>>(u16in, static_cast<float*>(dst), n);
    DT_CUDA_LAUNCHED();
  } else if (from == DType::F32 && to == DType::F16) {
    f32_to_f16_kernel<<<b, kThreads, 0, s>>>(f32in, static_cast<uint16_t*>(dst), n);
    DT_CUDA_LAUNCHED();
  } else if (from == DType::F16 && to == DType::F32) {
    f16_to_f32_kernel<<<b, kThreads, 0, s>>>(u16in, static_cast<float*>(dst), n);
    DT_CUDA_LAUNCHED();
  }
}

void round_to_bf16(const float* src, float* dst, int64_t n, cudaStream_t s) {
  if (n > 0) round_to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(src, dst, n);
  DT_CUDA_LAUNCHED();
}

void add_row_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t s) {
  if (m * n > 0) add_row_bias_kernel<<<blocks_for(m * n), kThreads, 0, s>>>(y, bias, m, n);
  DT_CUDA_LAUNCHED();
}
void row_bias_grad(const float* dy, float* dbias, int64_t m, int64_t n, cudaStream_t s) {
  if (n > 0) row_bias_grad_kernel<<<static_cast<unsigned>((n + 31) / 32), dim3(32, 8), 0, s>>>(dy, dbias, m, n);
  DT_CUDA_LAUNCHED();
}
void sum_squares(const float* x, int64_t n, double* out, cudaStream_t s) {
  if (n > 0) sum_squares_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, n, out);
  DT_CUDA_LAUNCHED();
}
void unscale_and_check(float* x, float inv_scale, int64_t n, float* found_inf, cudaStream_t s) {
  if (n > 0) unscale_check_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, n, fn::Unscale{inv_scale}, found_inf);
  DT_CUDA_LAUNCHED();
}

void check_finite(const float* x, int64_t n, float* found_inf, cudaStream_t s) {
  if (n > 0) check_finite_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, n, found_inf);
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

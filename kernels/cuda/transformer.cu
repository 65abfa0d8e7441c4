// Transformer kernels: head permutation, causal softmax (scale fused), embedding gather and
// scatter-add. The CPU loops of kernels/cpu/transformer.cpp are their reference in the tests.
#include <cfloat>

#include "cuda_common.h"
#include "dtrain/kernels/functors.h"
#include "kernels.h"

namespace dtrain::cuda::k {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// One thread per element of y [a,c,b,d].
__global__ void permute_0213_kernel(const float* x, float* y, int64_t a, int64_t b, int64_t c, int64_t d) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= a * b * c * d) return;
  int64_t e = idx % d, r = idx / d;
  int64_t j = r % b;  // y is [i, k, j, e]
  r /= b;
  int64_t k = r % c, i = r / c;
  y[idx] = x[((i * b + j) * c + k) * d + e];
}

// One warp per row of T scores; causal: row r is query position r % t, so keys 0..i are visible.
__global__ void attention_softmax_forward_kernel(const float* scores, float* probs, int64_t rows, int64_t t,
                                                 float scale, bool causal) {
  int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int64_t i = causal ? row % t : t - 1;
  const float* s = scores + row * t;
  float* p = probs + row * t;
  float mx = -FLT_MAX;
  for (int64_t j = lane; j <= i; j += 32) mx = fmaxf(mx, s[j] * scale);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (int64_t j = lane; j <= i; j += 32) sum += expf(s[j] * scale - mx);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float inv = 1.f / sum;
  for (int64_t j = lane; j < t; j += 32) p[j] = j <= i ? expf(s[j] * scale - mx) * inv : 0.f;
}

__global__ void attention_softmax_backward_kernel(const float* probs, const float* dprobs, float* dscores, int64_t rows,
                                                  int64_t t, float scale, bool causal) {
  int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int64_t i = causal ? row % t : t - 1;
  const float* p = probs + row * t;
  const float* dp = dprobs + row * t;
  float* g = dscores + row * t;
  float dot = 0.f;
  for (int64_t j = lane; j <= i; j += 32) dot += p[j] * dp[j];
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  for (int64_t j = lane; j < t; j += 32) g[j] = j <= i ? scale * p[j] * (dp[j] - dot) : 0.f;
}

// One thread per element of y [n,c].
__global__ void embedding_forward_kernel(const int32_t* ids, const float* table, float* y, int64_t n, int64_t v,
                                         int64_t c, int64_t offset) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * c) return;
  int64_t r = idx / c, col = idx % c;
  int64_t row = ids[r] - offset;
  y[idx] = (row >= 0 && row < v) ? table[row * c + col] : 0.f;
}

// Repeated ids add into the same row: atomics (the order, unlike the CPU's, is not fixed).
__global__ void embedding_backward_kernel(const int32_t* ids, const float* dy, float* dtable, int64_t n, int64_t v,
                                          int64_t c, int64_t offset) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * c) return;
  int64_t r = idx / c, col = idx % c;
  int64_t row = ids[r] - offset;
  if (row >= 0 && row < v) atomicAdd(dtable + row * c + col, dy[idx]);
}

// One thread per rotary pair of x viewed as [N, T, D].
__global__ void rotary_kernel(const float* x, const float* table, float* y, int64_t pairs, int64_t t, int64_t d,
                              int64_t pos0, bool inverse) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= pairs) return;
  const int64_t half = d / 2, i = idx % half, r = idx / half;
  const float* cs = table + (pos0 + r % t) * d;
  const float* in = x + r * d;
  float* out = y + r * d;
  fn::RotatePair{inverse}(in[i], in[i + half], cs[i], cs[i + half], out[i], out[i + half]);
}

// One thread per output element of gu [M, 2F] -> y [M, F].
__global__ void swiglu_forward_kernel(const float* gu, float* y, int64_t m, int64_t f) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= m * f) return;
  const int64_t r = idx / f, i = idx % f;
  y[idx] = fn::SwiGlu{}(gu[r * 2 * f + i], gu[r * 2 * f + f + i]);
}

__global__ void swiglu_backward_kernel(const float* gu, const float* dy, float* dgu, int64_t m, int64_t f) {
  int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= m * f) return;
  const int64_t r = idx / f, i = idx % f;
  fn::SwiGluGrad{}(gu[r * 2 * f + i], gu[r * 2 * f + f + i], dy[idx], dgu[r * 2 * f + i], dgu[r * 2 * f + f + i]);
}

}  // namespace

void permute_0213(const float* x, float* y, int64_t a, int64_t b, int64_t c, int64_t d, cudaStream_t s) {
  int64_t n = a * b * c * d;
  if (n == 0) return;
  permute_0213_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, a, b, c, d);
  DT_CUDA_LAUNCHED();
}

void attention_softmax_forward(const float* scores, float* probs, int64_t rows, int64_t t, float scale, bool causal,
                               cudaStream_t s) {
  if (rows == 0) return;
  attention_softmax_forward_kernel<<<blocks_for(rows * 32), kThreads, 0, s>>>(scores, probs, rows, t, scale, causal);
  DT_CUDA_LAUNCHED();
}

void attention_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t t,
                                float scale, bool causal, cudaStream_t s) {
  if (rows == 0) return;
  attention_softmax_backward_kernel<<<blocks_for(rows * 32), kThreads, 0, s>>>(probs, dprobs, dscores, rows, t, scale,
                                                                               causal);
  DT_CUDA_LAUNCHED();
}

void embedding_forward(const int32_t* ids, const float* table, float* y, int64_t n, int64_t v, int64_t c,
                       int64_t offset, cudaStream_t s) {
  if (n * c == 0) return;
  embedding_forward_kernel<<<blocks_for(n * c), kThreads, 0, s>>>(ids, table, y, n, v, c, offset);
  DT_CUDA_LAUNCHED();
}

void embedding_backward(const int32_t* ids, const float* dy, float* dtable, int64_t n, int64_t v, int64_t c,
                        int64_t offset, cudaStream_t s) {
  if (n * c == 0) return;
  embedding_backward_kernel<<<blocks_for(n * c), kThreads, 0, s>>>(ids, dy, dtable, n, v, c, offset);
  DT_CUDA_LAUNCHED();
}

void rotary(const float* x, const float* table, float* y, int64_t rows, int64_t t, int64_t d, int64_t pos0,
            bool inverse, cudaStream_t s) {
  const int64_t pairs = rows * (d / 2);
  if (pairs == 0) return;
  rotary_kernel<<<blocks_for(pairs), kThreads, 0, s>>>(x, table, y, pairs, t, d, pos0, inverse);
  DT_CUDA_LAUNCHED();
}

void swiglu_forward(const float* gu, float* y, int64_t m, int64_t f, cudaStream_t s) {
  if (m * f == 0) return;
  swiglu_forward_kernel<<<blocks_for(m * f), kThreads, 0, s>>>(gu, y, m, f);
  DT_CUDA_LAUNCHED();
}

void swiglu_backward(const float* gu, const float* dy, float* dgu, int64_t m, int64_t f, cudaStream_t s) {
  if (m * f == 0) return;
  swiglu_backward_kernel<<<blocks_for(m * f), kThreads, 0, s>>>(gu, dy, dgu, m, f);
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

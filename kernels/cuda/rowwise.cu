// Row-wise kernels: softmax cross-entropy over logits [M,C], LayerNorm and RMSNorm over x [M,D]. One block
// per row; the CPU engine's loops (kernels/cpu/) are the reference the tests compare against.
#include <cfloat>

#include "cuda_common.h"
#include "kernels.h"

namespace dtrain::cuda::k {

namespace {

constexpr int kRowThreads = 256;

// Block-wide reductions over kRowThreads threads; every thread gets the result.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* shared /* [32] */) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < kRowThreads / 32; ++w) v = op(v, shared[w]);
  return v;
}
struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinIndex {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

// logits, probs: [M,C]; labels: [M]. Row i by block i.
__global__ void softmax_xent_forward_kernel(const float* logits, const int32_t* labels, float* probs, int64_t c,
                                            double* loss_sum, unsigned long long* correct, int* bad_label) {
  __shared__ float fsh[32];
  __shared__ double dsh[32];
  __shared__ int64_t ish[32];
  const float* row = logits + blockIdx.x * c;
  float* prow = probs + blockIdx.x * c;
  float mx = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, Max{}, fsh);
  // The first index holding the maximum, as the CPU's strict '>' scan picks.
  int64_t arg = c;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
    if (row[j] == mx && j < arg) arg = j;
  arg = block_reduce(arg, MinIndex{}, ish);
  double sum = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    float e = expf(row[j] - mx);
    prow[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, Sum{}, dsh);
  float inv = static_cast<float>(1.0 / sum);
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) prow[j] *= inv;
  if (threadIdx.x == 0) {
    int32_t label = labels[blockIdx.x];
    if (label == -1) return;  // kIgnoreLabel: no loss on this target
    if (label < 0 || label >= c) {
      *bad_label = 1;
      return;
    }
    atomicAdd(loss_sum, -(static_cast<double>(row[label]) - mx - log(sum)));
    if (arg == label) atomicAdd(correct, 1ull);
  }
}

// dlogits [M,C] = (probs - onehot(labels)) * scale
__global__ void softmax_xent_backward_kernel(const float* probs, const int32_t* labels, float scale, float* d,
                                             int64_t m, int64_t c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < m * c;
       i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    int64_t r = i / c, j = i % c;
    d[i] = labels[r] == -1 ? 0.f : (probs[i] - (j == labels[r] ? 1.f : 0.f)) * scale;
  }
}

// Vocabulary-parallel cross-entropy over a slice [M, N]: one block per row for the reductions.
__global__ void row_max_kernel(const float* x, float* out, int64_t n) {
  __shared__ float fsh[32];
  const float* row = x + blockIdx.x * n;
  float mx = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, Max{}, fsh);
  if (threadIdx.x == 0) out[blockIdx.x] = mx;
}

// One block a row: the max of scale*x, the sum of exponentials, then the quotients.
__global__ void softmax_rows_kernel(const float* x, float scale, float* y, int64_t n) {
  __shared__ float fsh[32];
  const float* row = x + blockIdx.x * n;
  float* out = y + blockIdx.x * n;
  float mx = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, scale * row[j]);
  mx = block_reduce(mx, Max{}, fsh);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += expf(scale * row[j] - mx);
  sum = block_reduce(sum, Sum{}, fsh);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = expf(scale * row[j] - mx) / sum;
}

__global__ void vocab_xent_loss_kernel(const float* rowmax, const float* sumexp, const float* target,
                                       const int32_t* labels, int64_t m, double* loss_sum,
                                       unsigned long long* hits) {
  __shared__ double part[kRowThreads];
  __shared__ unsigned long long hit_part[kRowThreads];
  double acc = 0;
  unsigned long long hit = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x)
    if (labels[i] != -1) {
      acc += log(static_cast<double>(sumexp[i])) + rowmax[i] - target[i];
      hit += target[i] >= rowmax[i];  // the target's logit is the row's maximum
    }
  part[threadIdx.x] = acc;
  hit_part[threadIdx.x] = hit;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      part[threadIdx.x] += part[threadIdx.x + half];
      hit_part[threadIdx.x] += hit_part[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *loss_sum += part[0];
    *hits += hit_part[0];
  }
}

__global__ void vocab_xent_partials_kernel(const float* logits, const int32_t* labels, int64_t offset,
                                           const float* rowmax, float* sumexp, float* target, int64_t n) {
  __shared__ double dsh[32];
  const float* row = logits + blockIdx.x * n;
  const float mx = rowmax[blockIdx.x];
  double sum = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += expf(row[j] - mx);
  sum = block_reduce(sum, Sum{}, dsh);
  if (threadIdx.x == 0) {
    sumexp[blockIdx.x] = static_cast<float>(sum);
    int64_t col = labels[blockIdx.x] - offset;
    target[blockIdx.x] = col >= 0 && col < n ? row[col] : 0.f;
  }
}

__global__ void vocab_xent_backward_kernel(const float* logits, const int32_t* labels, int64_t offset,
                                           const float* rowmax, const float* sumexp, float scale, float* d, int64_t m,
                                           int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < m * n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    int64_t r = i / n, j = i % n;
    const float k = labels[r] == -1 ? 0.f : scale;  // kIgnoreLabel: no loss on this target
    d[i] = k * (expf(logits[i] - rowmax[r]) / sumexp[r] - (j == static_cast<int64_t>(labels[r]) - offset ? 1.f : 0.f));
  }
}

// x, y: [M,D]; mean, rstd: [M]. Two passes over the row (mean, then centred squares) as the CPU does.
__global__ void layernorm_forward_kernel(const float* x, const float* gamma, const float* beta, float eps, float* mean,
                                         float* rstd, float* y, int64_t d) {
  __shared__ double dsh[32];
  const float* row = x + blockIdx.x * d;
  float* out = y + blockIdx.x * d;
  double s = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) s += row[j];
  s = block_reduce(s, Sum{}, dsh);
  float mu = static_cast<float>(s / d);
  double ss = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += static_cast<double>(row[j] - mu) * (row[j] - mu);
  ss = block_reduce(ss, Sum{}, dsh);
  float r = static_cast<float>(1.0 / sqrt(ss / d + eps));
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = r;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = (row[j] - mu) * r * gamma[j] + beta[j];
}

// dx [M,D] = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
__global__ void layernorm_backward_dx_kernel(const float* x, const float* dy, const float* gamma, const float* mean,
                                             const float* rstd, float* dx, int64_t d) {
  __shared__ double dsh[32];
  const int64_t i = blockIdx.x;
  const float* row = x + i * d;
  const float* drow = dy + i * d;
  float* out = dx + i * d;
  const float mu = mean[i], r = rstd[i];
  double s1 = 0, s2 = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float xhat = (row[j] - mu) * r;
    float dxh = drow[j] * gamma[j];
    s1 += dxh;
    s2 += dxh * xhat;
  }
  s1 = block_reduce(s1, Sum{}, dsh);
  s2 = block_reduce(s2, Sum{}, dsh);
  float mean1 = static_cast<float>(s1 / d), mean2 = static_cast<float>(s2 / d);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float xhat = (row[j] - mu) * r;
    out[j] = r * (drow[j] * gamma[j] - mean1 - xhat * mean2);
  }
}

// dgamma [D] += sum_i dy*xhat, dbeta [D] += sum_i dy: a 32-column strip per block, 8 row groups.
__global__ void layernorm_backward_params_kernel(const float* x, const float* dy, const float* mean, const float* rstd,
                                                 float* dgamma, float* dbeta, int64_t m, int64_t d) {
  __shared__ float pg[8][33], pb[8][33];
  int64_t col = blockIdx.x * 32 + threadIdx.x;
  float ag = 0.f, ab = 0.f;
  if (col < d)
    for (int64_t r = threadIdx.y; r < m; r += 8) {
      float g = dy[r * d + col];
      ag += g * (x[r * d + col] - mean[r]) * rstd[r];
      ab += g;
    }
  pg[threadIdx.y][threadIdx.x] = ag;
  pb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < d) {
    float tg = 0.f, tb = 0.f;
    for (int j = 0; j < 8; ++j) {
      tg += pg[j][threadIdx.x];
      tb += pb[j][threadIdx.x];
    }
    dgamma[col] += tg;
    dbeta[col] += tb;
  }
}

// RMSNorm, x, y: [M,D]; rstd: [M]. One block per row, squares summed in f64 as the CPU does.
__global__ void rmsnorm_forward_kernel(const float* x, const float* gamma, float eps, float* rstd, float* y,
                                       int64_t d) {
  __shared__ double dsh[32];
  const float* row = x + blockIdx.x * d;
  float* out = y + blockIdx.x * d;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += static_cast<double>(row[j]) * row[j];
  ss = block_reduce(ss, Sum{}, dsh);
  const float r = static_cast<float>(1.0 / sqrt(ss / d + eps));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = row[j] * r * gamma[j];
}

// dx = rstd (dy gamma - x rstd^2 mean(dy gamma x)).
__global__ void rmsnorm_backward_dx_kernel(const float* x, const float* dy, const float* gamma, const float* rstd,
                                           float* dx, int64_t d) {
  __shared__ double dsh[32];
  const int64_t i = blockIdx.x;
  const float* row = x + i * d;
  const float* drow = dy + i * d;
  float* out = dx + i * d;
  double s = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) s += static_cast<double>(drow[j]) * gamma[j] * row[j];
  s = block_reduce(s, Sum{}, dsh);
  const float r = rstd[i], k = static_cast<float>(s / d) * r * r;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = r * (drow[j] * gamma[j] - row[j] * k);
}

// dgamma [D] += sum_i dy x rstd: a 32-column strip per block, 8 row groups.
__global__ void rmsnorm_backward_gamma_kernel(const float* x, const float* dy, const float* rstd, float* dgamma,
                                              int64_t m, int64_t d) {
  __shared__ float pg[8][33];
  int64_t col = blockIdx.x * 32 + threadIdx.x;
  float ag = 0.f;
  if (col < d)
    for (int64_t r = threadIdx.y; r < m; r += 8) ag += dy[r * d + col] * x[r * d + col] * rstd[r];
  pg[threadIdx.y][threadIdx.x] = ag;
  __syncthreads();
  if (threadIdx.y == 0 && col < d) {
    float tg = 0.f;
    for (int j = 0; j < 8; ++j) tg += pg[j][threadIdx.x];
    dgamma[col] += tg;
  }
}

// Block per channel c of x [N,C,HW]; see kernels.h.
__global__ void channel_reduce_kernel(const float* x, const float* b, float* out1, float* out2, int64_t n, int64_t c,
                                      int64_t hw) {
  __shared__ double dsh[32];
  const int64_t ch = blockIdx.x;
  double s1 = 0, s2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t base = (i * c + ch) * hw;
    for (int64_t j = threadIdx.x; j < hw; j += blockDim.x) {
      double v = x[base + j];
      s1 += b ? v * b[base + j] : v;
      s2 += v * v;
    }
  }
  s1 = block_reduce(s1, Sum{}, dsh);
  if (out2) s2 = block_reduce(s2, Sum{}, dsh);
  if (threadIdx.x == 0) {
    out1[ch] = static_cast<float>(s1);
    if (out2) out2[ch] = static_cast<float>(s2);
  }
}

__global__ void channel_affine_kernel(const float* x, const float* scale, const float* shift, float* y, int64_t total,
                                      int64_t c, int64_t hw) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    int64_t ch = (i / hw) % c;
    y[i] = x[i] * scale[ch] + shift[ch];
  }
}

}  // namespace

void channel_reduce(const float* x, const float* b, float* out1, float* out2, int64_t n, int64_t c, int64_t hw,
                    cudaStream_t s) {
  if (c > 0) channel_reduce_kernel<<<static_cast<unsigned>(c), kRowThreads, 0, s>>>(x, b, out1, out2, n, c, hw);
  DT_CUDA_LAUNCHED();
}

void channel_affine(const float* x, const float* scale, const float* shift, float* y, int64_t n, int64_t c, int64_t hw,
                    cudaStream_t s) {
  int64_t total = n * c * hw;
  if (total <= 0) return;
  unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535));
  channel_affine_kernel<<<blocks, 256, 0, s>>>(x, scale, shift, y, total, c, hw);
  DT_CUDA_LAUNCHED();
}

void softmax_xent_forward(const float* logits, const int32_t* labels, float* probs, int64_t m, int64_t c,
                          double* loss_sum, unsigned long long* correct, int* bad_label, cudaStream_t s) {
  if (m > 0)
    softmax_xent_forward_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(logits, labels, probs, c, loss_sum,
                                                                                 correct, bad_label);
  DT_CUDA_LAUNCHED();
}

void softmax_xent_backward(const float* probs, const int32_t* labels, float scale, float* dlogits, int64_t m, int64_t c,
                           cudaStream_t s) {
  int64_t n = m * c;
  if (n <= 0) return;
  unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  softmax_xent_backward_kernel<<<blocks, 256, 0, s>>>(probs, labels, scale, dlogits, m, c);
  DT_CUDA_LAUNCHED();
}

void row_max(const float* x, float* out, int64_t m, int64_t n, cudaStream_t s) {
  if (m > 0) row_max_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, out, n);
  DT_CUDA_LAUNCHED();
}

void softmax_rows(const float* x, float scale, float* y, int64_t m, int64_t n, cudaStream_t s) {
  if (m > 0) softmax_rows_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, scale, y, n);
  DT_CUDA_LAUNCHED();
}

void vocab_xent_loss(const float* rowmax, const float* sumexp, const float* target, const int32_t* labels, int64_t m,
                     double* loss_sum, unsigned long long* hits, cudaStream_t s) {
  vocab_xent_loss_kernel<<<1, kRowThreads, 0, s>>>(rowmax, sumexp, target, labels, m, loss_sum, hits);
  DT_CUDA_LAUNCHED();
}

void vocab_xent_partials(const float* logits, const int32_t* labels, int64_t offset, const float* rowmax, float* sumexp,
                         float* target, int64_t m, int64_t n, cudaStream_t s) {
  if (m > 0)
    vocab_xent_partials_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(logits, labels, offset, rowmax, sumexp,
                                                                                target, n);
  DT_CUDA_LAUNCHED();
}

void vocab_xent_backward(const float* logits, const int32_t* labels, int64_t offset, const float* rowmax,
                         const float* sumexp, float scale, float* dlogits, int64_t m, int64_t n, cudaStream_t s) {
  int64_t total = m * n;
  if (total <= 0) return;
  unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535));
  vocab_xent_backward_kernel<<<blocks, 256, 0, s>>>(logits, labels, offset, rowmax, sumexp, scale, dlogits, m, n);
  DT_CUDA_LAUNCHED();
}

void layernorm_forward(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                       float* y, int64_t m, int64_t d, cudaStream_t s) {
  if (m > 0)
    layernorm_forward_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, gamma, beta, eps, mean, rstd, y, d);
  DT_CUDA_LAUNCHED();
}

void layernorm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d, cudaStream_t s) {
  if (m <= 0 || d <= 0) return;
  layernorm_backward_dx_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, dy, gamma, mean, rstd, dx, d);
  DT_CUDA_LAUNCHED();
  layernorm_backward_params_kernel<<<static_cast<unsigned>((d + 31) / 32), dim3(32, 8), 0, s>>>(x, dy, mean, rstd,
                                                                                                dgamma, dbeta, m, d);
  DT_CUDA_LAUNCHED();
}

void rmsnorm_forward(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d,
                     cudaStream_t s) {
  if (m > 0) rmsnorm_forward_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, gamma, eps, rstd, y, d);
  DT_CUDA_LAUNCHED();
}

void rmsnorm_backward(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx, float* dgamma,
                      int64_t m, int64_t d, cudaStream_t s) {
  if (m <= 0 || d <= 0) return;
  rmsnorm_backward_dx_kernel<<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(x, dy, gamma, rstd, dx, d);
  DT_CUDA_LAUNCHED();
  rmsnorm_backward_gamma_kernel<<<static_cast<unsigned>((d + 31) / 32), dim3(32, 8), 0, s>>>(x, dy, rstd, dgamma, m, d);
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

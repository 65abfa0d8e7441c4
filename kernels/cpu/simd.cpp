// The reference kernel table (plain loops over the shared functors: what the engine ran before the
// AVX-512 kernels, and still runs on processors without them) and the run-time choice of table.
#include "simd.h"

#include <algorithm>
#include <cmath>

namespace dtrain::cpu::simd {

// Defined in simd_avx512.cpp and simd_avx2.cpp; only called after the processor checks below.
const Kernels& avx512_table();
const Kernels& avx2_table();

namespace {

void gelu_forward(const float* x, float* y, int64_t n) {
  fn::Gelu f;
  for (int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  fn::GeluGrad f;
  for (int64_t i = 0; i < n; ++i) dx[i] = f(x[i], dy[i]);
}

void swiglu_forward(const float* gu, float* y, int64_t rows, int64_t f) {
  const fn::SwiGlu op;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < f; ++i) y[r * f + i] = op(gu[r * 2 * f + i], gu[r * 2 * f + f + i]);
}

void swiglu_backward(const float* gu, const float* dy, float* dgu, int64_t rows, int64_t f) {
  const fn::SwiGluGrad op;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < f; ++i)
      op(gu[r * 2 * f + i], gu[r * 2 * f + f + i], dy[r * f + i], dgu[r * 2 * f + i], dgu[r * 2 * f + f + i]);
}

void add(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void mul(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] * b[i];
}

void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void scale(float* y, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

void add_row_bias(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
}

void row_bias_grad(const float* dy, float* dbias, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) dbias[j] += dy[i * n + j];
}

void layernorm_forward(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                       float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += row[j];
    float mu = static_cast<float>(s / d);
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(row[j] - mu) * (row[j] - mu);
    float r = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
    mean[i] = mu;
    rstd[i] = r;
    float* out = y + i * d;
    for (int64_t j = 0; j < d; ++j) out[j] = (row[j] - mu) * r * gamma[j] + beta[j];
  }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
void layernorm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    if (dgamma) {
      for (int64_t j = 0; j < d; ++j) {
        float xhat = (row[j] - mean[i]) * rstd[i];
        dgamma[j] += drow[j] * xhat;
        dbeta[j] += drow[j];
      }
    }
    if (!dx) continue;
    double s1 = 0, s2 = 0;
    for (int64_t j = 0; j < d; ++j) {
      float xhat = (row[j] - mean[i]) * rstd[i];
      float dxh = drow[j] * gamma[j];
      s1 += dxh;
      s2 += dxh * xhat;
    }
    float mean1 = static_cast<float>(s1 / d), mean2 = static_cast<float>(s2 / d);
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; ++j) {
      float xhat = (row[j] - mean[i]) * rstd[i];
      out[j] = rstd[i] * (drow[j] * gamma[j] - mean1 - xhat * mean2);
    }
  }
}

void rmsnorm_forward(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(row[j]) * row[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    rstd[i] = r;
    float* out = y + i * d;
    for (int64_t j = 0; j < d; ++j) out[j] = row[j] * r * gamma[j];
  }
}

void rmsnorm_backward(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx, float* dgamma,
                      int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    const float r = rstd[i];
    if (dgamma)
      for (int64_t j = 0; j < d; ++j) dgamma[j] += drow[j] * row[j] * r;
    if (!dx) continue;
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += static_cast<double>(drow[j] * gamma[j]) * row[j];
    const float k = static_cast<float>(s / static_cast<double>(d)) * r * r;
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; ++j) out[j] = r * (drow[j] * gamma[j] - row[j] * k);
  }
}

void attention_softmax_forward(const float* ps, float* pp, int64_t row0, int64_t rows, int64_t t, float scale,
                               bool causal) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t i = causal ? (row0 + r) % t : t - 1;  // keys 0..i are visible
    const float* s = ps + r * t;
    float* p = pp + r * t;
    float mx = s[0] * scale;
    for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, s[j] * scale);
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) {
      p[j] = std::exp(s[j] * scale - mx);
      sum += p[j];
    }
    float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j <= i; ++j) p[j] *= inv;
    for (int64_t j = i + 1; j < t; ++j) p[j] = 0.f;
  }
}

void attention_softmax_backward(const float* pp, const float* pd, float* pg, int64_t row0, int64_t rows, int64_t t,
                                float scale, bool causal) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t i = causal ? (row0 + r) % t : t - 1;
    const float* p = pp + r * t;
    const float* dp = pd + r * t;
    float* g = pg + r * t;
    double dot = 0;
    for (int64_t j = 0; j <= i; ++j) dot += static_cast<double>(p[j]) * dp[j];
    float fdot = static_cast<float>(dot);
    for (int64_t j = 0; j <= i; ++j) g[j] = scale * p[j] * (dp[j] - fdot);
    for (int64_t j = i + 1; j < t; ++j) g[j] = 0.f;
  }
}

void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const fn::AdamStep& f) {
  for (int64_t i = 0; i < n; ++i) f(p[i], g[i], m[i], v[i]);
}

double sum_squares(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

const Kernels& reference() {
  static const Kernels k{.name = "reference",
                         .gelu_forward = gelu_forward,
                         .gelu_backward = gelu_backward,
                         .swiglu_forward = swiglu_forward,
                         .swiglu_backward = swiglu_backward,
                         .add = add,
                         .mul = mul,
                         .axpy = axpy,
                         .scale = scale,
                         .add_row_bias = add_row_bias,
                         .row_bias_grad = row_bias_grad,
                         .layernorm_forward = layernorm_forward,
                         .layernorm_backward = layernorm_backward,
                         .rmsnorm_forward = rmsnorm_forward,
                         .rmsnorm_backward = rmsnorm_backward,
                         .attention_softmax_forward = attention_softmax_forward,
                         .attention_softmax_backward = attention_softmax_backward,
                         .adam_update = adam_update,
                         .sum_squares = sum_squares};
  return k;
}

const Kernels* avx512() {
  static const Kernels* k = has_avx512() ? &avx512_table() : nullptr;
  return k;
}

const Kernels* avx2() {
  static const Kernels* k = has_avx2() ? &avx2_table() : nullptr;
  return k;
}

const Kernels& active() {
  static const Kernels& k = avx512() ? *avx512() : avx2() ? *avx2() : reference();
  return k;
}

}  // namespace dtrain::cpu::simd

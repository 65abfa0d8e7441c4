// The AVX2 kernel table (see simd.h) for processors with AVX2 and FMA but not AVX-512: the same
// kernels as simd_avx512.cpp in 8-float registers, tails through AVX2's masked loads and stores
// (masked-off lanes load as 0, as the AVX-512 maskz loads do), so the arithmetic and its order
// follow the AVX-512 file line for line. This file alone is compiled with -mavx2 -mfma; nothing
// here runs before simd::avx2() has checked the processor.
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "simd.h"

namespace dtrain::cpu::simd {

namespace {

constexpr int64_t kW = 8;  // floats per register

// e^x for x <= 0, |relative error| < 2e-7 down to the clamp: x = n ln2 + r, |r| <= ln2/2 (ln2 in a
// high and a low part), Cephes' degree-6 polynomial for e^r, and 2^n built in the exponent bits
// (n >= -126 after the clamp, so 2^n is a normal float; below it e^x is < 1.2e-38 and rounds away
// in tanh's 1 - e and 1 + e). The same steps as the AVX-512 exp_ps.
inline __m256 exp_nonpositive_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// tanh(u) = sign(u) (1 - e) / (1 + e), e = e^(-2|u|): fn::tanh_via_exp's formula.
inline __m256 tanh_ps(__m256 u) {
  const __m256 sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  __m256 a = _mm256_andnot_ps(sign_bit, u);
  __m256 e = exp_nonpositive_ps(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(u, sign_bit));
}

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

inline __m256 gelu_ps(__m256 x) {
  __m256 x2 = _mm256_mul_ps(x, x);
  __m256 u = _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(kGeluK)),
                           _mm256_fmadd_ps(x2, _mm256_set1_ps(kGeluC), _mm256_set1_ps(1.f)));
  __m256 hx = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
  return _mm256_fmadd_ps(hx, tanh_ps(u), hx);  // 0.5 x (1 + t)
}

// dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2))
inline __m256 gelu_grad_ps(__m256 x, __m256 dy) {
  const __m256 one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f);
  __m256 x2 = _mm256_mul_ps(x, x);
  __m256 u = _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(kGeluK)), _mm256_fmadd_ps(x2, _mm256_set1_ps(kGeluC), one));
  __m256 t = tanh_ps(u);
  __m256 du = _mm256_mul_ps(_mm256_set1_ps(kGeluK), _mm256_fmadd_ps(x2, _mm256_set1_ps(3.f * kGeluC), one));
  __m256 sech2 = _mm256_fnmadd_ps(t, t, one);
  __m256 left = _mm256_mul_ps(half, _mm256_add_ps(one, t));
  __m256 right = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_mul_ps(sech2, du));
  return _mm256_mul_ps(dy, _mm256_add_ps(left, right));
}

// Tails (fewer than 8 elements) go through one register padded with zeros.
void gelu_forward(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm256_storeu_ps(y + i, gelu_ps(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float in[kW] = {}, out[kW];
    for (int64_t j = 0; j < n - i; ++j) in[j] = x[i + j];
    _mm256_store_ps(out, gelu_ps(_mm256_load_ps(in)));
    for (int64_t j = 0; j < n - i; ++j) y[i + j] = out[j];
  }
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm256_storeu_ps(dx + i, gelu_grad_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(dy + i)));
  if (i < n) {
    alignas(32) float in[kW] = {}, d[kW] = {}, out[kW];
    for (int64_t j = 0; j < n - i; ++j) in[j] = x[i + j], d[j] = dy[i + j];
    _mm256_store_ps(out, gelu_grad_ps(_mm256_load_ps(in), _mm256_load_ps(d)));
    for (int64_t j = 0; j < n - i; ++j) dx[i + j] = out[j];
  }
}

// Lane mask for the first n (0..8) lanes: all ones where the lane is in, as maskload wants.
inline __m256i head_mask(int64_t n) {
  alignas(32) static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - n));
}
// Lanes [j, d) of a row, at most 8.
inline __m256i span_mask(int64_t j, int64_t d) { return head_mask(d - j >= kW ? kW : d - j); }
// Masked moves are slow on AMD's Zen, a masked store microcoded (on a Zen 3 EPYC, perf: AdamW's
// kernel took 4.3 % of a Llama 6 x 256 step through it, 1.4 % once whole registers were stored
// plainly), a masked load slower than a plain one (the softmax and SwiGLU kernels 20-45 % faster
// without), so a whole register, the common case, is loaded and stored plainly.
inline __m256 load(const float* p, __m256i k) {
  return _mm256_testc_si256(k, _mm256_set1_epi32(-1)) ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, k);
}
inline void store(float* p, __m256 v, __m256i k) {
  if (_mm256_testc_si256(k, _mm256_set1_epi32(-1)))
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, k, v);
}

// sigmoid(g) from e = e^(-|g|), which never overflows: 1 / (1 + e) for g >= 0 and e / (1 + e)
// below, fn::sigmoid's value.
inline __m256 sigmoid_ps(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = exp_nonpositive_ps(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));
  return _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));  // blend on g's sign bit
}

// fn::SwiGlu and fn::SwiGluGrad: y = g s u; d gate = dy u s (1 + g (1 - s)), d up = dy g s.
inline __m256 swiglu_ps(__m256 g, __m256 u) { return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid_ps(g)), u); }
inline void swiglu_grad_ps(__m256 g, __m256 u, __m256 dy, __m256& dg, __m256& du) {
  const __m256 one = _mm256_set1_ps(1.f), s = sigmoid_ps(g);
  du = _mm256_mul_ps(_mm256_mul_ps(dy, g), s);
  dg = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dy, u), s), _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));
}

void swiglu_forward(const float* gu, float* y, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * f, *u = g + f;
    float* yr = y + r * f;
    for (int64_t i = 0; i < f; i += kW) {
      const __m256i k = span_mask(i, f);
      store(yr + i, swiglu_ps(load(g + i, k), load(u + i, k)), k);
    }
  }
}

void swiglu_backward(const float* gu, const float* dy, float* dgu, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * f, *u = g + f, *d = dy + r * f;
    float *dg = dgu + r * 2 * f, *du = dg + f;
    for (int64_t i = 0; i < f; i += kW) {
      const __m256i k = span_mask(i, f);
      __m256 a, b;
      swiglu_grad_ps(load(g + i, k), load(u + i, k), load(d + i, k), a, b);
      store(dg + i, a, k);
      store(du + i, b, k);
    }
  }
}

inline double reduce_add_pd(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
inline float reduce_max_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
// Adds the 8 floats of v to two 4-lane double accumulators.
inline void add_pd(__m256 v, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

// y[i] = op(a[i], b[i]) over n elements, 8 at a time, masked tail.
template <typename Op>
inline void binary(const float* a, const float* b, float* y, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm256_storeu_ps(y + i, op(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    __m256i k = head_mask(n - i);
    store(y + i, op(load(a + i, k), load(b + i, k)), k);
  }
}

void add(const float* a, const float* b, float* y, int64_t n) {
  binary(a, b, y, n, [](__m256 u, __m256 v) { return _mm256_add_ps(u, v); });
}

void mul(const float* a, const float* b, float* y, int64_t n) {
  binary(a, b, y, n, [](__m256 u, __m256 v) { return _mm256_mul_ps(u, v); });
}

void axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(alpha);
  binary(x, y, y, n, [va](__m256 u, __m256 v) { return _mm256_fmadd_ps(va, u, v); });
}

void scale(float* y, float alpha, int64_t n) {
  const __m256 va = _mm256_set1_ps(alpha);
  binary(y, y, y, n, [va](__m256 u, __m256) { return _mm256_mul_ps(u, va); });
}

void add_row_bias(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) add(y + i * n, bias, y + i * n, n);
}

// Column sums, 32 columns (four registers) per sweep down the rows.
void row_bias_grad(const float* dy, float* dbias, int64_t m, int64_t n) {
  int64_t j = 0;
  for (; j + 4 * kW <= n; j += 4 * kW) {
    __m256 s0 = _mm256_loadu_ps(dbias + j), s1 = _mm256_loadu_ps(dbias + j + kW);
    __m256 s2 = _mm256_loadu_ps(dbias + j + 2 * kW), s3 = _mm256_loadu_ps(dbias + j + 3 * kW);
    for (int64_t i = 0; i < m; ++i) {
      const float* r = dy + i * n + j;
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(r));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps(r + kW));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(r + 2 * kW));
      s3 = _mm256_add_ps(s3, _mm256_loadu_ps(r + 3 * kW));
    }
    _mm256_storeu_ps(dbias + j, s0);
    _mm256_storeu_ps(dbias + j + kW, s1);
    _mm256_storeu_ps(dbias + j + 2 * kW, s2);
    _mm256_storeu_ps(dbias + j + 3 * kW, s3);
  }
  for (; j < n; j += kW) {
    __m256i k = span_mask(j, n);
    __m256 s = load(dbias + j, k);
    for (int64_t i = 0; i < m; ++i) s = _mm256_add_ps(s, load(dy + i * n + j, k));
    store(dbias + j, s, k);
  }
}

// Row sums in double lanes, the reference's order of float operations otherwise (see the AVX-512
// layernorm_forward for why).
void layernorm_forward(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                       float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    __m256d slo = _mm256_setzero_pd(), shi = _mm256_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) add_pd(load(row + j, span_mask(j, d)), slo, shi);
    const float mu = static_cast<float>(reduce_add_pd(_mm256_add_pd(slo, shi)) / static_cast<double>(d));
    const __m256 vmu = _mm256_set1_ps(mu);
    __m256d qlo = _mm256_setzero_pd(), qhi = _mm256_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 c = _mm256_and_ps(_mm256_sub_ps(load(row + j, k), vmu), _mm256_castsi256_ps(k));
      __m256d clo = _mm256_cvtps_pd(_mm256_castps256_ps128(c)), chi = _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1));
      qlo = _mm256_fmadd_pd(clo, clo, qlo);
      qhi = _mm256_fmadd_pd(chi, chi, qhi);
    }
    const double var = reduce_add_pd(_mm256_add_pd(qlo, qhi)) / static_cast<double>(d);
    const float r = static_cast<float>(1.0 / std::sqrt(var + eps));
    mean[i] = mu;
    rstd[i] = r;
    const __m256 vr = _mm256_set1_ps(r);
    float* out = y + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load(row + j, k), vmu), vr);
      store(out + j, _mm256_add_ps(_mm256_mul_ps(xhat, load(gamma + j, k)), load(beta + j, k)), k);
    }
  }
}

void layernorm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    const __m256 vmu = _mm256_set1_ps(mean[i]), vr = _mm256_set1_ps(rstd[i]);
    __m256d s1lo = _mm256_setzero_pd(), s1hi = _mm256_setzero_pd(), s2lo = _mm256_setzero_pd(),
            s2hi = _mm256_setzero_pd();
    // One pass: the parameter gradients and the two row sums dx needs (masked lanes add 0).
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load(row + j, k), vmu), vr);
      __m256 g = load(drow + j, k);
      if (dgamma) {
        store(dgamma + j, _mm256_add_ps(load(dgamma + j, k), _mm256_mul_ps(g, xhat)), k);
        store(dbeta + j, _mm256_add_ps(load(dbeta + j, k), g), k);
      }
      __m256 dxh = _mm256_mul_ps(g, load(gamma + j, k));
      add_pd(dxh, s1lo, s1hi);
      add_pd(_mm256_mul_ps(dxh, xhat), s2lo, s2hi);
    }
    if (!dx) continue;
    const double dd = static_cast<double>(d);
    const __m256 mean1 = _mm256_set1_ps(static_cast<float>(reduce_add_pd(_mm256_add_pd(s1lo, s1hi)) / dd));
    const __m256 mean2 = _mm256_set1_ps(static_cast<float>(reduce_add_pd(_mm256_add_pd(s2lo, s2hi)) / dd));
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load(row + j, k), vmu), vr);
      __m256 dxh = _mm256_mul_ps(load(drow + j, k), load(gamma + j, k));
      __m256 v = _mm256_sub_ps(_mm256_sub_ps(dxh, mean1), _mm256_mul_ps(xhat, mean2));
      store(out + j, _mm256_mul_ps(vr, v), k);
    }
  }
}

// Sums of squares in double lanes, as layernorm_forward's; the scaling in the reference's float order.
void rmsnorm_forward(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    __m256d qlo = _mm256_setzero_pd(), qhi = _mm256_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __m256 v = load(row + j, span_mask(j, d));
      __m256d vlo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), vhi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      qlo = _mm256_fmadd_pd(vlo, vlo, qlo);
      qhi = _mm256_fmadd_pd(vhi, vhi, qhi);
    }
    const double ms = reduce_add_pd(_mm256_add_pd(qlo, qhi)) / static_cast<double>(d);
    const float r = static_cast<float>(1.0 / std::sqrt(ms + eps));
    rstd[i] = r;
    const __m256 vr = _mm256_set1_ps(r);
    float* out = y + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      store(out + j, _mm256_mul_ps(_mm256_mul_ps(load(row + j, k), vr), load(gamma + j, k)), k);
    }
  }
}

void rmsnorm_backward(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx, float* dgamma,
                      int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    const __m256 vr = _mm256_set1_ps(rstd[i]);
    __m256d slo = _mm256_setzero_pd(), shi = _mm256_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 xv = load(row + j, k), g = load(drow + j, k);
      if (dgamma) store(dgamma + j, _mm256_add_ps(load(dgamma + j, k), _mm256_mul_ps(_mm256_mul_ps(g, xv), vr)), k);
      if (!dx) continue;
      __m256 dxh = _mm256_mul_ps(g, load(gamma + j, k));
      slo = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(dxh)), _mm256_cvtps_pd(_mm256_castps256_ps128(xv)),
                            slo);
      shi = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(dxh, 1)),
                            _mm256_cvtps_pd(_mm256_extractf128_ps(xv, 1)), shi);
    }
    if (!dx) continue;
    const float r = rstd[i];
    const __m256 vk =
        _mm256_set1_ps(static_cast<float>(reduce_add_pd(_mm256_add_pd(slo, shi)) / static_cast<double>(d)) * r * r);
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __m256i k = span_mask(j, d);
      __m256 dxh = _mm256_mul_ps(load(drow + j, k), load(gamma + j, k));
      store(out + j, _mm256_mul_ps(vr, _mm256_sub_ps(dxh, _mm256_mul_ps(load(row + j, k), vk))), k);
    }
  }
}

// Asks for the first n floats of a row two rows ahead: a causal row reads a part of itself whose
// length changes from row to row, which the hardware prefetchers do not follow (on a Zen 3 EPYC,
// perf put half of the softmax's time on the first load of each row, from L3).
inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t j = 0; j < n; j += 64 / sizeof(float)) _mm_prefetch(reinterpret_cast<const char*>(row + j), _MM_HINT_T0);
}

// Zeroes row[from, t).
inline void zero_tail(float* row, int64_t from, int64_t t) {
  for (int64_t j = from; j < t; j += kW) store(row + j, _mm256_setzero_ps(), span_mask(j, t));
}

void attention_softmax_forward(const float* ps, float* pp, int64_t row0, int64_t rows, int64_t t, float scale,
                               bool causal) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = causal ? (row0 + r) % t + 1 : t;  // visible keys
    const float* s = ps + r * t;
    float* p = pp + r * t;
    prefetch_row(s + 2 * t, r + 2 < rows ? std::min(len + 2, t) : 0);
    __m256 mx = neg_inf;
    for (int64_t j = 0; j < len; j += kW) {
      __m256i k = span_mask(j, len);
      __m256 v = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(load(s + j, k), vs), _mm256_castsi256_ps(k));
      mx = _mm256_max_ps(mx, v);
    }
    const __m256 vmax = _mm256_set1_ps(reduce_max_ps(mx));
    // The normaliser is summed in double, as the reference does.
    __m256d slo = _mm256_setzero_pd(), shi = _mm256_setzero_pd();
    for (int64_t j = 0; j < len; j += kW) {
      __m256i k = span_mask(j, len);
      // Visible lanes have s*scale - max <= 0; masked ones are zeroed after the exp.
      __m256 e = _mm256_and_ps(exp_nonpositive_ps(_mm256_sub_ps(_mm256_mul_ps(load(s + j, k), vs), vmax)),
                               _mm256_castsi256_ps(k));
      store(p + j, e, k);
      add_pd(e, slo, shi);
    }
    const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / reduce_add_pd(_mm256_add_pd(slo, shi))));
    for (int64_t j = 0; j < len; j += kW) {
      __m256i k = span_mask(j, len);
      store(p + j, _mm256_mul_ps(load(p + j, k), inv), k);
    }
    zero_tail(p, len, t);
  }
}

void attention_softmax_backward(const float* pp, const float* pd, float* pg, int64_t row0, int64_t rows, int64_t t,
                                float scale, bool causal) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = causal ? (row0 + r) % t + 1 : t;
    const float* p = pp + r * t;
    const float* dp = pd + r * t;
    float* g = pg + r * t;
    const int64_t ahead = r + 2 < rows ? std::min(len + 2, t) : 0;
    prefetch_row(p + 2 * t, ahead);
    prefetch_row(dp + 2 * t, ahead);
    // sum(p * dp) in double (see the AVX-512 kernel).
    __m256d dlo = _mm256_setzero_pd(), dhi = _mm256_setzero_pd();
    for (int64_t j = 0; j < len; j += kW) {
      __m256i k = span_mask(j, len);
      __m256 a = load(p + j, k), b = load(dp + j, k);
      dlo =
          _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)), _mm256_cvtps_pd(_mm256_castps256_ps128(b)), dlo);
      dhi = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)),
                            dhi);
    }
    const __m256 vdot = _mm256_set1_ps(static_cast<float>(reduce_add_pd(_mm256_add_pd(dlo, dhi))));
    for (int64_t j = 0; j < len; j += kW) {
      __m256i k = span_mask(j, len);
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(vs, load(p + j, k)), _mm256_sub_ps(load(dp + j, k), vdot));
      store(g + j, v, k);
    }
    zero_tail(g, len, t);
  }
}

inline void adam_lanes(float* p, const float* g, float* m, float* v, __m256i k, const fn::AdamStep& f) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 b1 = _mm256_set1_ps(f.beta1), b2 = _mm256_set1_ps(f.beta2);
  __m256 vp = load(p, k), vg = load(g, k);
  if (f.decoupled)
    vp = _mm256_fnmadd_ps(_mm256_set1_ps(f.lr * f.weight_decay), vp, vp);
  else
    vg = _mm256_fmadd_ps(_mm256_set1_ps(f.weight_decay), vp, vg);
  __m256 vm = _mm256_fmadd_ps(b1, load(m, k), _mm256_mul_ps(_mm256_sub_ps(one, b1), vg));
  __m256 vv = _mm256_fmadd_ps(b2, load(v, k), _mm256_mul_ps(_mm256_sub_ps(one, b2), _mm256_mul_ps(vg, vg)));
  __m256 mhat = _mm256_div_ps(vm, _mm256_set1_ps(f.bias1));
  __m256 vhat = _mm256_div_ps(vv, _mm256_set1_ps(f.bias2));
  __m256 step = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(f.lr), mhat),
                              _mm256_add_ps(_mm256_sqrt_ps(vhat), _mm256_set1_ps(f.eps)));
  store(p, _mm256_sub_ps(vp, step), k);
  store(m, vm, k);
  store(v, vv, k);
}

void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const fn::AdamStep& f) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) adam_lanes(p + i, g + i, m + i, v + i, head_mask(kW), f);
  if (i < n) adam_lanes(p + i, g + i, m + i, v + i, head_mask(n - i), f);
}

double sum_squares(const float* x, int64_t n) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    lo = _mm256_fmadd_pd(a, a, lo);
    hi = _mm256_fmadd_pd(b, b, hi);
  }
  double s = reduce_add_pd(_mm256_add_pd(lo, hi));
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

}  // namespace

const Kernels& avx2_table() {
  static const Kernels k{.name = "avx2",
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

}  // namespace dtrain::cpu::simd

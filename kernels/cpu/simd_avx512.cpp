// The AVX-512 kernel table (see simd.h): 16 floats per register, masked loads and stores for the
// tails, so any length works without a scalar epilogue. This file alone is compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma; nothing here runs before simd::avx512() has
// checked the processor. Sums run in float lanes (the reference sums in double): for rows of a few
// thousand elements the difference is a few float ulps.
// GCC 12's AVX-512 headers start intrinsics from `__m512 __Y = __Y;` (an "undefined" register),
// which -Wall reports as uninitialised once inlined (GCC bug 105593); the warning says nothing about
// this file's code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "simd.h"

namespace dtrain::cpu::simd {

namespace {

constexpr int64_t kW = 16;  // floats per register

// Lanes [0, n) of a 16-lane register, for the tail of a loop (0 < n < 16).
inline __mmask16 head_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline void store(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }

// e^x, |relative error| < 2e-7 on the clamped range: x = n ln2 + r with |r| <= ln2/2 (ln2 split in
// a high and a low part so n ln2 is exact enough), a degree-6 polynomial for e^r (Cephes' expf
// coefficients), and 2^n applied by VSCALEFPS, which also handles the underflow end. NaN passes
// through the clamps (the constant is the first operand of min/max, so a NaN x is returned).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-103.9f), _mm512_min_ps(_mm512_set1_ps(88.72f), x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// tanh(u) = sign(u) (1 - e) / (1 + e), e = e^(-2|u|): the same formula as fn::tanh_via_exp.
inline __m512 tanh_ps(__m512 u) {
  __m512 a = _mm512_abs_ps(u);
  __m512 e = exp_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  __m512 sign = _mm512_and_ps(u, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm512_or_ps(t, sign);
}

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

inline __m512 gelu_ps(__m512 x) {
  __m512 x2 = _mm512_mul_ps(x, x);
  __m512 u = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(kGeluK)),
                           _mm512_fmadd_ps(x2, _mm512_set1_ps(kGeluC), _mm512_set1_ps(1.f)));
  __m512 hx = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  return _mm512_fmadd_ps(hx, tanh_ps(u), hx);  // 0.5 x (1 + t)
}

// dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2))
inline __m512 gelu_grad_ps(__m512 x, __m512 dy) {
  const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  __m512 x2 = _mm512_mul_ps(x, x);
  __m512 u = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(kGeluK)), _mm512_fmadd_ps(x2, _mm512_set1_ps(kGeluC), one));
  __m512 t = tanh_ps(u);
  __m512 du = _mm512_mul_ps(_mm512_set1_ps(kGeluK), _mm512_fmadd_ps(x2, _mm512_set1_ps(3.f * kGeluC), one));
  __m512 sech2 = _mm512_fnmadd_ps(t, t, one);
  __m512 left = _mm512_mul_ps(half, _mm512_add_ps(one, t));
  __m512 right = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_mul_ps(sech2, du));
  return _mm512_mul_ps(dy, _mm512_add_ps(left, right));
}

// sigmoid(g) from e = e^(-|g|): 1 / (1 + e) for g >= 0 and e / (1 + e) below (the AVX2 file's
// steps), fn::sigmoid's value.
inline __m512 sigmoid_ps(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_ps(_mm512_or_ps(g, _mm512_set1_ps(-0.f)));
  const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(g));  // g's sign bits
  return _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
}

// fn::SwiGlu and fn::SwiGluGrad: y = g s u; d gate = dy u s (1 + g (1 - s)), d up = dy g s.
inline __m512 swiglu_ps(__m512 g, __m512 u) { return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid_ps(g)), u); }
inline void swiglu_grad_ps(__m512 g, __m512 u, __m512 dy, __m512& dg, __m512& du) {
  const __m512 one = _mm512_set1_ps(1.f), s = sigmoid_ps(g);
  du = _mm512_mul_ps(_mm512_mul_ps(dy, g), s);
  dg = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dy, u), s), _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
}

void swiglu_forward(const float* gu, float* y, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * f, *u = g + f;
    float* yr = y + r * f;
    for (int64_t i = 0; i < f; i += kW) {
      const __mmask16 k = head_mask(std::min<int64_t>(kW, f - i));
      store(yr + i, swiglu_ps(load(g + i, k), load(u + i, k)), k);
    }
  }
}

void swiglu_backward(const float* gu, const float* dy, float* dgu, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * f, *u = g + f, *d = dy + r * f;
    float *dg = dgu + r * 2 * f, *du = dg + f;
    for (int64_t i = 0; i < f; i += kW) {
      const __mmask16 k = head_mask(std::min<int64_t>(kW, f - i));
      __m512 a, b;
      swiglu_grad_ps(load(g + i, k), load(u + i, k), load(d + i, k), a, b);
      store(dg + i, a, k);
      store(du + i, b, k);
    }
  }
}

void gelu_forward(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm512_storeu_ps(y + i, gelu_ps(_mm512_loadu_ps(x + i)));
  if (i < n) {
    __mmask16 k = head_mask(n - i);
    store(y + i, gelu_ps(load(x + i, k)), k);
  }
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm512_storeu_ps(dx + i, gelu_grad_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(dy + i)));
  if (i < n) {
    __mmask16 k = head_mask(n - i);
    store(dx + i, gelu_grad_ps(load(x + i, k), load(dy + i, k)), k);
  }
}

// y[i] = op(a[i], b[i]) over n elements, 16 at a time, masked tail.
template <typename Op>
inline void binary(const float* a, const float* b, float* y, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) _mm512_storeu_ps(y + i, op(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
  if (i < n) {
    __mmask16 k = head_mask(n - i);
    store(y + i, op(load(a + i, k), load(b + i, k)), k);
  }
}

void add(const float* a, const float* b, float* y, int64_t n) {
  binary(a, b, y, n, [](__m512 u, __m512 v) { return _mm512_add_ps(u, v); });
}

void mul(const float* a, const float* b, float* y, int64_t n) {
  binary(a, b, y, n, [](__m512 u, __m512 v) { return _mm512_mul_ps(u, v); });
}

void axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  binary(x, y, y, n, [va](__m512 u, __m512 v) { return _mm512_fmadd_ps(va, u, v); });
}

void scale(float* y, float alpha, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  binary(y, y, y, n, [va](__m512 u, __m512) { return _mm512_mul_ps(u, va); });
}

void add_row_bias(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) add(y + i * n, bias, y + i * n, n);
}

// Column sums, 64 columns (four registers) per sweep down the rows, so each sweep reads whole
// cache lines and the partial sums stay in registers.
void row_bias_grad(const float* dy, float* dbias, int64_t m, int64_t n) {
  int64_t j = 0;
  for (; j + 4 * kW <= n; j += 4 * kW) {
    __m512 s0 = _mm512_loadu_ps(dbias + j), s1 = _mm512_loadu_ps(dbias + j + kW);
    __m512 s2 = _mm512_loadu_ps(dbias + j + 2 * kW), s3 = _mm512_loadu_ps(dbias + j + 3 * kW);
    for (int64_t i = 0; i < m; ++i) {
      const float* r = dy + i * n + j;
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(r));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(r + kW));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(r + 2 * kW));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(r + 3 * kW));
    }
    _mm512_storeu_ps(dbias + j, s0);
    _mm512_storeu_ps(dbias + j + kW, s1);
    _mm512_storeu_ps(dbias + j + 2 * kW, s2);
    _mm512_storeu_ps(dbias + j + 3 * kW, s3);
  }
  for (; j < n; j += kW) {
    __mmask16 k = n - j >= kW ? static_cast<__mmask16>(0xffff) : head_mask(n - j);
    __m512 s = load(dbias + j, k);
    for (int64_t i = 0; i < m; ++i) s = _mm512_add_ps(s, load(dy + i * n + j, k));
    store(dbias + j, s, k);
  }
}

// Lane mask for elements [j, d) of a row, at most 16.
inline __mmask16 span_mask(int64_t j, int64_t d) {
  return d - j >= kW ? static_cast<__mmask16>(0xffff) : head_mask(d - j);
}

// Adds the 16 floats of v to two 8-lane double accumulators.
inline void add_pd(__m512 v, __m512d& lo, __m512d& hi) {
  lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}

// LayerNorm sums its rows in double lanes and otherwise keeps the reference's order of float
// operations: the row statistics feed every element, and tensor parallelism's equivalence tests
// compare runs whose inputs differ in the last bits, where float row sums drift further apart.
void layernorm_forward(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                       float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    __m512d slo = _mm512_setzero_pd(), shi = _mm512_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) add_pd(load(row + j, span_mask(j, d)), slo, shi);
    const float mu = static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(slo, shi)) / static_cast<double>(d));
    const __m512 vmu = _mm512_set1_ps(mu);
    __m512d qlo = _mm512_setzero_pd(), qhi = _mm512_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 c = _mm512_maskz_sub_ps(k, load(row + j, k), vmu);
      __m512d clo = _mm512_cvtps_pd(_mm512_castps512_ps256(c)), chi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(c, 1));
      qlo = _mm512_fmadd_pd(clo, clo, qlo);
      qhi = _mm512_fmadd_pd(chi, chi, qhi);
    }
    const double var = _mm512_reduce_add_pd(_mm512_add_pd(qlo, qhi)) / static_cast<double>(d);
    const float r = static_cast<float>(1.0 / std::sqrt(var + eps));
    mean[i] = mu;
    rstd[i] = r;
    const __m512 vr = _mm512_set1_ps(r);
    float* out = y + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(load(row + j, k), vmu), vr);
      store(out + j, _mm512_add_ps(_mm512_mul_ps(xhat, load(gamma + j, k)), load(beta + j, k)), k);
    }
  }
}

void layernorm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    const __m512 vmu = _mm512_set1_ps(mean[i]), vr = _mm512_set1_ps(rstd[i]);
    __m512d s1lo = _mm512_setzero_pd(), s1hi = _mm512_setzero_pd(), s2lo = _mm512_setzero_pd(),
            s2hi = _mm512_setzero_pd();
    // One pass: the parameter gradients and the two row sums dx needs (masked lanes add 0).
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(load(row + j, k), vmu), vr);
      __m512 g = load(drow + j, k);
      if (dgamma) {
        store(dgamma + j, _mm512_add_ps(load(dgamma + j, k), _mm512_mul_ps(g, xhat)), k);
        store(dbeta + j, _mm512_add_ps(load(dbeta + j, k), g), k);
      }
      __m512 dxh = _mm512_mul_ps(g, load(gamma + j, k));
      add_pd(dxh, s1lo, s1hi);
      add_pd(_mm512_mul_ps(dxh, xhat), s2lo, s2hi);
    }
    if (!dx) continue;
    const double dd = static_cast<double>(d);
    const __m512 mean1 = _mm512_set1_ps(static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(s1lo, s1hi)) / dd));
    const __m512 mean2 = _mm512_set1_ps(static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(s2lo, s2hi)) / dd));
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(load(row + j, k), vmu), vr);
      __m512 dxh = _mm512_mul_ps(load(drow + j, k), load(gamma + j, k));
      __m512 v = _mm512_sub_ps(_mm512_sub_ps(dxh, mean1), _mm512_mul_ps(xhat, mean2));
      store(out + j, _mm512_mul_ps(vr, v), k);
    }
  }
}

// Sums of squares in double lanes, as layernorm_forward's; the scaling in the reference's float order.
void rmsnorm_forward(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    __m512d qlo = _mm512_setzero_pd(), qhi = _mm512_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __m512 v = load(row + j, span_mask(j, d));
      __m512d vlo = _mm512_cvtps_pd(_mm512_castps512_ps256(v)), vhi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
      qlo = _mm512_fmadd_pd(vlo, vlo, qlo);
      qhi = _mm512_fmadd_pd(vhi, vhi, qhi);
    }
    const double ms = _mm512_reduce_add_pd(_mm512_add_pd(qlo, qhi)) / static_cast<double>(d);
    const float r = static_cast<float>(1.0 / std::sqrt(ms + eps));
    rstd[i] = r;
    const __m512 vr = _mm512_set1_ps(r);
    float* out = y + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      store(out + j, _mm512_mul_ps(_mm512_mul_ps(load(row + j, k), vr), load(gamma + j, k)), k);
    }
  }
}

void rmsnorm_backward(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx, float* dgamma,
                      int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    const float* drow = dy + i * d;
    const __m512 vr = _mm512_set1_ps(rstd[i]);
    __m512d slo = _mm512_setzero_pd(), shi = _mm512_setzero_pd();
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 xv = load(row + j, k), g = load(drow + j, k);
      if (dgamma) store(dgamma + j, _mm512_add_ps(load(dgamma + j, k), _mm512_mul_ps(_mm512_mul_ps(g, xv), vr)), k);
      if (!dx) continue;
      __m512 dxh = _mm512_mul_ps(g, load(gamma + j, k));
      slo = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(dxh)), _mm512_cvtps_pd(_mm512_castps512_ps256(xv)),
                            slo);
      shi = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(dxh, 1)),
                            _mm512_cvtps_pd(_mm512_extractf32x8_ps(xv, 1)), shi);
    }
    if (!dx) continue;
    const float r = rstd[i];
    const __m512 vk = _mm512_set1_ps(
        static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(slo, shi)) / static_cast<double>(d)) * r * r);
    float* out = dx + i * d;
    for (int64_t j = 0; j < d; j += kW) {
      __mmask16 k = span_mask(j, d);
      __m512 dxh = _mm512_mul_ps(load(drow + j, k), load(gamma + j, k));
      store(out + j, _mm512_mul_ps(vr, _mm512_sub_ps(dxh, _mm512_mul_ps(load(row + j, k), vk))), k);
    }
  }
}

// Zeroes row[from, t).
inline void zero_tail(float* row, int64_t from, int64_t t) {
  int64_t j = from;
  // Up to the next multiple of 16 with a mask, then whole registers.
  if (j % kW && j < t) {
    const int64_t next = (j / kW + 1) * kW;
    const int64_t end = next < t ? next : t;
    store(row + j, _mm512_setzero_ps(), head_mask(end - j));
    j = end;
  }
  for (; j < t; j += kW) store(row + j, _mm512_setzero_ps(), span_mask(j, t));
}

void attention_softmax_forward(const float* ps, float* pp, int64_t row0, int64_t rows, int64_t t, float scale,
                               bool causal) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = causal ? (row0 + r) % t + 1 : t;  // visible keys
    const float* s = ps + r * t;
    float* p = pp + r * t;
    __m512 mx = neg_inf;
    for (int64_t j = 0; j < len; j += kW)
      mx = _mm512_mask_max_ps(mx, span_mask(j, len), mx, _mm512_mul_ps(load(s + j, span_mask(j, len)), vs));
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    // The normaliser is summed in double, as the reference does (see layernorm_forward).
    __m512d slo = _mm512_setzero_pd(), shi = _mm512_setzero_pd();
    for (int64_t j = 0; j < len; j += kW) {
      __mmask16 k = span_mask(j, len);
      __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_mul_ps(load(s + j, k), vs), vmax)));
      store(p + j, e, k);
      add_pd(e, slo, shi);
    }
    const __m512 inv = _mm512_set1_ps(static_cast<float>(1.0 / _mm512_reduce_add_pd(_mm512_add_pd(slo, shi))));
    for (int64_t j = 0; j < len; j += kW) {
      __mmask16 k = span_mask(j, len);
      store(p + j, _mm512_mul_ps(load(p + j, k), inv), k);
    }
    zero_tail(p, len, t);
  }
}

void attention_softmax_backward(const float* pp, const float* pd, float* pg, int64_t row0, int64_t rows, int64_t t,
                                float scale, bool causal) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = causal ? (row0 + r) % t + 1 : t;
    const float* p = pp + r * t;
    const float* dp = pd + r * t;
    float* g = pg + r * t;
    // sum(p * dp) in double: dp - dot cancels, and float rounding there is what tensor-parallel
    // runs would see differ (see layernorm_forward).
    __m512d dlo = _mm512_setzero_pd(), dhi = _mm512_setzero_pd();
    for (int64_t j = 0; j < len; j += kW) {
      __mmask16 k = span_mask(j, len);
      __m512 a = load(p + j, k), b = load(dp + j, k);
      dlo =
          _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(a)), _mm512_cvtps_pd(_mm512_castps512_ps256(b)), dlo);
      dhi = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(a, 1)),
                            _mm512_cvtps_pd(_mm512_extractf32x8_ps(b, 1)), dhi);
    }
    const __m512 vdot = _mm512_set1_ps(static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(dlo, dhi))));
    for (int64_t j = 0; j < len; j += kW) {
      __mmask16 k = span_mask(j, len);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(vs, load(p + j, k)), _mm512_sub_ps(load(dp + j, k), vdot));
      store(g + j, v, k);
    }
    zero_tail(g, len, t);
  }
}

inline void adam_lanes(float* p, const float* g, float* m, float* v, __mmask16 k, const fn::AdamStep& f) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 b1 = _mm512_set1_ps(f.beta1), b2 = _mm512_set1_ps(f.beta2);
  __m512 vp = load(p, k), vg = load(g, k);
  if (f.decoupled)
    vp = _mm512_fnmadd_ps(_mm512_set1_ps(f.lr * f.weight_decay), vp, vp);
  else
    vg = _mm512_fmadd_ps(_mm512_set1_ps(f.weight_decay), vp, vg);
  __m512 vm = _mm512_fmadd_ps(b1, load(m, k), _mm512_mul_ps(_mm512_sub_ps(one, b1), vg));
  __m512 vv = _mm512_fmadd_ps(b2, load(v, k), _mm512_mul_ps(_mm512_sub_ps(one, b2), _mm512_mul_ps(vg, vg)));
  __m512 mhat = _mm512_div_ps(vm, _mm512_set1_ps(f.bias1));
  __m512 vhat = _mm512_div_ps(vv, _mm512_set1_ps(f.bias2));
  __m512 step = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(f.lr), mhat),
                              _mm512_add_ps(_mm512_sqrt_ps(vhat), _mm512_set1_ps(f.eps)));
  store(p, _mm512_sub_ps(vp, step), k);
  store(m, vm, k);
  store(v, vv, k);
}

void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const fn::AdamStep& f) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) adam_lanes(p + i, g + i, m + i, v + i, static_cast<__mmask16>(0xffff), f);
  if (i < n) adam_lanes(p + i, g + i, m + i, v + i, head_mask(n - i), f);
}

double sum_squares(const float* x, int64_t n) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    __m512d b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

}  // namespace

const Kernels& avx512_table() {
  static const Kernels k{.name = "avx512",
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

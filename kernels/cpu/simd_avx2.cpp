// The AVX2 kernel table (see simd.h) for processors with AVX2 and FMA but not AVX-512: the GELU
// forward and backward in 8-float registers (on such a machine perf put a fifth of a GPT step in the
// reference GELU's scalar expf); every other entry is the reference kernel. This file alone is
// compiled with -mavx2 -mfma; nothing here runs before simd::avx2() has checked the processor.
#include <immintrin.h>

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

}  // namespace

const Kernels& avx2_table() {
  static const Kernels k = [] {
    Kernels t = reference();
    t.name = "avx2";
    t.gelu_forward = gelu_forward;
    t.gelu_backward = gelu_backward;
    return t;
  }();
  return k;
}

}  // namespace dtrain::cpu::simd

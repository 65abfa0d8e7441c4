#pragma once
// The CPU engine's inner loops as a table of plain-pointer kernels, built three times: `reference`
// is portable C++ over the shared functors (the fallback, and the oracle the tests compare
// against), `avx512` is the same math written with AVX-512 intrinsics in simd_avx512.cpp (the one
// file compiled with -mavx512f/bw/vl/dq), `avx2` the same again in 8-float registers in
// simd_avx2.cpp (-mavx2 -mfma). active() picks the widest table the processor can run. The engine checks shapes and
// splits rows or elements across OpenMP threads; a kernel only sees its own slice, so the kernels never start threads.
// Private to kernels/.
#include <cstdint>

#include "dtrain/kernels/functors.h"

namespace dtrain::cpu::simd {

struct Kernels {
  const char* name;
  // GELU, tanh approximation: y = gelu(x); dx = dy * gelu'(x). n elements.
  void (*gelu_forward)(const float* x, float* y, int64_t n);
  void (*gelu_backward)(const float* x, const float* dy, float* dx, int64_t n);
  // SwiGLU over `rows` rows of gu [rows, 2f] (gate in the first f, up in the last f):
  // y [rows, f] = silu(gate) * up; dgu [rows, 2f] = (d gate, d up) for dy [rows, f].
  void (*swiglu_forward)(const float* gu, float* y, int64_t rows, int64_t f);
  void (*swiglu_backward)(const float* gu, const float* dy, float* dgu, int64_t rows, int64_t f);
  // y = a + b; y = a * b; y += alpha * x; y *= alpha. n elements; y may alias an input.
  void (*add)(const float* a, const float* b, float* y, int64_t n);
  void (*mul)(const float* a, const float* b, float* y, int64_t n);
  void (*axpy)(float alpha, const float* x, float* y, int64_t n);
  void (*scale)(float* y, float alpha, int64_t n);
  // y [m, n] += bias [n] on every row; dbias [n] += column sums of dy [m, n].
  void (*add_row_bias)(float* y, const float* bias, int64_t m, int64_t n);
  void (*row_bias_grad)(const float* dy, float* dbias, int64_t m, int64_t n);
  // LayerNorm over the last axis of x [m, d]: mean, rstd [m]; y = (x - mean) * rstd * gamma + beta.
  void (*layernorm_forward)(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                            float* y, int64_t m, int64_t d);
  // Its backward for rows [m, d]: dx (overwritten) when dx is not null; dgamma, dbeta [d]
  // (accumulated) when dgamma is not null. The engine runs the accumulation on one thread.
  void (*layernorm_backward)(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                             float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d);
  // RMSNorm over the last axis of x [m, d]: rstd [m] = 1 / sqrt(mean(x^2) + eps) (the mean in
  // double); y = x * rstd * gamma.
  void (*rmsnorm_forward)(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d);
  // Its backward: dx = rstd * (dy * gamma - x * rstd^2 * mean(dy * gamma * x)) (overwritten) when dx
  // is not null; dgamma [d] += dy * x * rstd (accumulated) when dgamma is not null.
  void (*rmsnorm_backward)(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx,
                           float* dgamma, int64_t m, int64_t d);
  // Attention softmax of `rows` rows of length t, the first being row `row0` of [N*T, T]. Causal:
  // row r is query position r % t, keys 0..r%t are visible, the rest of the row is written as 0;
  // otherwise every key is. scale is fused: p = softmax(scale * s); ds = scale * p * (dp - sum(p * dp)).
  void (*attention_softmax_forward)(const float* s, float* p, int64_t row0, int64_t rows, int64_t t, float scale,
                                    bool causal);
  void (*attention_softmax_backward)(const float* p, const float* dp, float* ds, int64_t row0, int64_t rows, int64_t t,
                                     float scale, bool causal);
  // Adam/AdamW on n elements (fn::AdamStep's arithmetic).
  void (*adam_update)(float* p, const float* g, float* m, float* v, int64_t n, const fn::AdamStep& f);
  // Sum of squares with a double accumulator (gradient clipping).
  double (*sum_squares)(const float* x, int64_t n);
};

const Kernels& reference();
// The AVX-512 table, or null when the processor lacks AVX-512 F/BW/VL/DQ.
const Kernels* avx512();
// The AVX2 table (the same kernels in AVX2 + FMA), or null without AVX2 and FMA.
const Kernels* avx2();
// avx512() when available, else avx2(), else reference(); decided once.
const Kernels& active();

}  // namespace dtrain::cpu::simd

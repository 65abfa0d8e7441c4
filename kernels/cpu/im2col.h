#pragma once
// Convolution backward-weights as im2col + GEMM: the alternative to oneDNN's primitive that
// benchmarks/micro/bench_conv measures for the models' shapes. oneDNN wins on all of them (by 4x to
// 9x at batch 64, one core, C = 1..16), so the engine uses oneDNN and this stays the benchmark's
// comparison point.
#include "dtrain/kernels/engine.h"

namespace dtrain::cpu {

// dw [K, C, R, S] += sum_n dy_n [K, PQ] . cols_n^T [PQ, CRS]; dbias [K] += sum dy (if defined).
// `cols` is scratch of C*R*S*P*Q floats.
void conv2d_backward_weights_im2col(const Conv2dGeom& g, const float* x, const float* dy, float* dw, float* dbias,
                                    float* cols);

// cols [C*R*S, P*Q] of one image x [C, H, W] (zero padding).
void im2col(const Conv2dGeom& g, const float* x, float* cols);

}  // namespace dtrain::cpu

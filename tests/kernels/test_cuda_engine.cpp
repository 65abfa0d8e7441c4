// The CUDA engine against the CPU engine (the reference) on the same inputs: every operation of
// the Engine contract, mixed-precision GEMM/conv, the caching allocator and the stream events.
// Without a GPU every test skips and says so.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "../train/lm_test_util.h"
#include "../train/train_test_util.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/text.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/train/lm_trainer.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include <cuda_runtime.h>

#include "dtrain/kernels/cuda.h"
#endif

using namespace dtrain;

namespace {

Tensor random(const Shape& s, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Rng rng(seed);
  Tensor t = Tensor::empty(s);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.uniform(lo, hi);
  return t;
}

class CudaEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if !defined(DTRAIN_WITH_CUDA_ENGINE)
    GTEST_SKIP() << "dtrain was built without CUDA (DTRAIN_CUDA=OFF or no toolkit): CUDA engine tests skipped";
#else
    if (enable_cuda() == 0)
      GTEST_SKIP() << "no GPU visible (cudaGetDeviceCount found none): CUDA engine tests skipped, they run where a "
                      "GPU is present";
    gpu = &engine_for(Device::cuda(0));
    gpu->set_math_precision(MathPrecision::F32);
#endif
  }
  void TearDown() override {
    if (gpu) gpu->set_math_precision(MathPrecision::F32);
  }
  Tensor dev(const Tensor& host) {
    Tensor d = Tensor::empty(host.shape(), host.dtype(), Device::cuda(0));
    gpu->copy(host, d);
    return d;
  }
  Tensor host(const Tensor& d) {
    Tensor h = Tensor::empty(d.shape(), d.dtype());
    gpu->copy(d, h);
    return h;
  }
  // max |gpu - cpu| / max(1, max |cpu|)
  static double rel_diff(const Tensor& got, const Tensor& want) {
    EXPECT_EQ(got.numel(), want.numel());
    double d = 0, m = 1;
    for (int64_t i = 0; i < want.numel(); ++i) {
      d = std::max(d, static_cast<double>(std::abs(got.f32()[i] - want.f32()[i])));
      m = std::max(m, static_cast<double>(std::abs(want.f32()[i])));
    }
    return d / m;
  }
  void expect_close(const Tensor& gpu_result, const Tensor& cpu_result, double tol, const char* what) {
    EXPECT_LE(rel_diff(host(gpu_result), cpu_result), tol) << what;  // tol 0: bit-exact
  }
  Engine& cpu = cpu_engine();
  Engine* gpu = nullptr;
};

}  // namespace

TEST_F(CudaEngineTest, GemmF32AllTransposesAndBatched) {
  const int64_t m = 33, n = 65, k = 47;
  for (int t = 0; t < 4; ++t) {
    bool ta = t & 1, tb = t & 2;
    Tensor a = random({m * k}, 1), b = random({k * n}, 2), c = random({m * n}, 3);
    Tensor gc = dev(c);
    cpu.gemm(ta, tb, m, n, k, 0.5f, a, b, 1.f, c);
    gpu->gemm(ta, tb, m, n, k, 0.5f, dev(a), dev(b), 1.f, gc);
    expect_close(gc, c, 1e-5, "fp32 gemm");
  }
  const int64_t batch = 4;
  Tensor a = random({batch * m * k}, 4), b = random({batch * k * n}, 5), c = Tensor::zeros({batch * m * n});
  Tensor gc = dev(c);
  cpu.gemm_batched(batch, false, true, m, n, k, 1.f, a, m * k, b, k * n, 0.f, c, m * n);
  gpu->gemm_batched(batch, false, true, m, n, k, 1.f, dev(a), m * k, dev(b), k * n, 0.f, gc, m * n);
  expect_close(gc, c, 1e-5, "batched gemm");
}

TEST_F(CudaEngineTest, GemmMixedPrecisionMatchesCpuRounding) {
  const int64_t m = 64, n = 96, k = 128;
  Tensor a = random({m * k}, 6), b = random({k * n}, 7);
  for (MathPrecision p : {MathPrecision::TF32, MathPrecision::BF16, MathPrecision::F16}) {
    Tensor c = Tensor::zeros({m * n});
    Tensor gc = dev(c);
    // The CPU reference computes TF32 exactly, BF16/F16 with the same operand rounding.
    cpu.set_math_precision(p == MathPrecision::TF32 ? MathPrecision::F32 : p);
    cpu.gemm(false, true, m, n, k, 1.f, a, b, 0.f, c);
    cpu.set_math_precision(MathPrecision::F32);
    gpu->set_math_precision(p);
    gpu->gemm(false, true, m, n, k, 1.f, dev(a), dev(b), 0.f, gc);
    expect_close(gc, c, p == MathPrecision::TF32 ? 1e-2 : 1e-4, math_precision_name(p));
  }
  // bf16 tensors directly.
  Tensor a16 = Tensor::empty(a.shape(), DType::BF16), b16 = Tensor::empty(b.shape(), DType::BF16);
  cpu.cast(a, a16);
  cpu.cast(b, b16);
  Tensor c = Tensor::zeros({m * n});
  Tensor gc = dev(c);
  cpu.gemm(false, true, m, n, k, 1.f, a16, b16, 0.f, c);
  gpu->gemm(false, true, m, n, k, 1.f, dev(a16), dev(b16), 0.f, gc);
  expect_close(gc, c, 1e-4, "bf16 tensors");
  // A bf16/f16 weight copy beside an f32 operand (mixed precision's working copies), against the
  // CPU engine's all-f32 GEMM under the same precision.
  for (MathPrecision p : {MathPrecision::BF16, MathPrecision::F16}) {
    Tensor b_low = Tensor::empty(b.shape(), p == MathPrecision::BF16 ? DType::BF16 : DType::F16);
    cpu.cast(b, b_low);
    Tensor cr = Tensor::zeros({m * n});
    cpu.set_math_precision(p);
    cpu.gemm(false, true, m, n, k, 1.f, a, b, 0.f, cr);
    cpu.set_math_precision(MathPrecision::F32);
    Tensor gm = dev(Tensor::zeros({m * n}));
    gpu->set_math_precision(p);
    gpu->gemm(false, true, m, n, k, 1.f, dev(a), dev(b_low), 0.f, gm);
    expect_close(gm, cr, 1e-4, (std::string("f32 x low-precision copy, ") + math_precision_name(p)).c_str());
  }
  gpu->set_math_precision(MathPrecision::F32);
}

// Attention's products under mixed precision: batched GEMMs with bf16/f16 operands (the heads
// held in low precision) beside an f32 one, transposed either way, against the CPU engine.
TEST_F(CudaEngineTest, BatchedGemmLowPrecisionMatchesTheCpu) {
  const int64_t batch = 6, m = 40, n = 24, k = 32;
  Tensor a = random({batch * m * k}, 41), b = random({batch * k * n}, 42);
  for (MathPrecision p : {MathPrecision::BF16, MathPrecision::F16}) {
    const DType low = p == MathPrecision::BF16 ? DType::BF16 : DType::F16;
    Tensor b_low = Tensor::empty(b.shape(), low);
    cpu.cast(b, b_low);
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      Tensor c = random({batch * m * n}, 43), gc = dev(c);
      cpu.set_math_precision(p);
      cpu.gemm_batched(batch, ta, tb, m, n, k, 0.5f, a, m * k, b_low, k * n, 1.f, c, m * n);
      cpu.set_math_precision(MathPrecision::F32);
      gpu->set_math_precision(p);
      gpu->gemm_batched(batch, ta, tb, m, n, k, 0.5f, dev(a), m * k, dev(b_low), k * n, 1.f, gc, m * n);
      gpu->set_math_precision(MathPrecision::F32);
      expect_close(
          gc, c, 1e-4,
          (std::string("batched ") + math_precision_name(p) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb))
              .c_str());
    }
  }
}

TEST_F(CudaEngineTest, ConvolutionForwardBackward) {
  Conv2dGeom g{4, 3, 14, 14, 8, 3, 3, 2, 1};
  Tensor x = random({g.n, g.c, g.h, g.w}, 8), w = random({g.k, g.c, g.r, g.s}, 9), bias = random({g.k}, 10);
  Tensor dy = random({g.n, g.k, g.out_h(), g.out_w()}, 11);
  // bf16: both engines round the same operands to bf16 and write f32 results, so only the summation
  // order differs; fp16 convolutions stay fp32 on both (the CPU engine has no fast fp16).
  for (MathPrecision p : {MathPrecision::F32, MathPrecision::BF16, MathPrecision::F16}) {
    cpu.set_math_precision(p);
    gpu->set_math_precision(p);
    Tensor y = Tensor::zeros(dy.shape()), dx = Tensor::zeros(x.shape());
    Tensor dw = random(w.shape(), 12), db = random({g.k}, 13);  // accumulated into
    Tensor gy = dev(y), gdx = dev(dx), gdw = dev(dw), gdb = dev(db);
    cpu.conv2d_forward(g, x, w, bias, y);
    cpu.conv2d_backward_data(g, dy, w, dx);
    cpu.conv2d_backward_weights(g, x, dy, dw, db);
    gpu->conv2d_forward(g, dev(x), dev(w), dev(bias), gy);
    gpu->conv2d_backward_data(g, dev(dy), dev(w), gdx);
    gpu->conv2d_backward_weights(g, dev(x), dev(dy), gdw, gdb);
    const std::string at = std::string(" (") + math_precision_name(p) + ")";
    expect_close(gy, y, 1e-4, ("conv forward" + at).c_str());
    expect_close(gdx, dx, 1e-4, ("conv backward data" + at).c_str());
    expect_close(gdw, dw, 1e-4, ("conv backward weights, accumulated" + at).c_str());
    // oneDNN's bf16 backward sums the bias gradient from the rounded dy, cuDNN from dy itself.
    expect_close(gdb, db, p == MathPrecision::BF16 ? 1e-2 : 1e-4, ("conv bias gradient" + at).c_str());
  }
  cpu.set_math_precision(MathPrecision::F32);
  gpu->set_math_precision(MathPrecision::F32);
}

TEST_F(CudaEngineTest, Pooling) {
  Pool2dGeom g{2, 3, 8, 8, 2, 2, 0};
  for (PoolKind kind : {PoolKind::Max, PoolKind::Avg}) {
    Tensor x = random({g.n, g.c, g.h, g.w}, 14), dy = random({g.n, g.c, g.out_h(), g.out_w()}, 15);
    Tensor y = Tensor::zeros(dy.shape()), dx = Tensor::zeros(x.shape()), state;
    Tensor gy = dev(y), gdx = dev(dx), gstate;
    cpu.pool2d_forward(g, kind, x, y, &state);
    cpu.pool2d_backward(g, kind, dy, state, dx);
    gpu->pool2d_forward(g, kind, dev(x), gy, &gstate);
    gpu->pool2d_backward(g, kind, dev(dy), gstate, gdx);
    expect_close(gy, y, 1e-6, "pool forward");
    expect_close(gdx, dx, 1e-6, "pool backward");
  }
}

TEST_F(CudaEngineTest, BatchNormTrainInferBackward) {
  const int64_t n = 8, c = 4, hw = 25;
  Tensor x = random({n, c, 5, 5}, 16), dy = random({n, c, 5, 5}, 17);
  Tensor gamma = random({c}, 18, 0.5f, 1.5f), beta = random({c}, 19);
  Tensor rm = Tensor::zeros({c}), rv = Tensor::full({c}, 1.f), sm = Tensor::zeros({c}), si = Tensor::zeros({c});
  Tensor y = Tensor::zeros(x.shape()), dx = Tensor::zeros(x.shape()), dg = Tensor::zeros({c}), db = Tensor::zeros({c});
  Tensor grm = dev(rm), grv = dev(rv), gsm = dev(sm), gsi = dev(si), gy = dev(y), gdx = dev(dx), gdg = dev(dg),
         gdb = dev(db);
  cpu.batchnorm_forward_train(x, c, gamma, beta, 1e-5f, 0.1f, rm, rv, sm, si, y);
  gpu->batchnorm_forward_train(dev(x), c, dev(gamma), dev(beta), 1e-5f, 0.1f, grm, grv, gsm, gsi, gy);
  expect_close(gy, y, 1e-5, "bn forward");
  expect_close(grm, rm, 1e-6, "running mean");
  expect_close(grv, rv, 1e-5, "running variance (unbiased)");
  expect_close(gsi, si, 1e-5, "saved inverse std");
  cpu.batchnorm_backward(x, dy, c, gamma, sm, si, dx, dg, db);
  gpu->batchnorm_backward(dev(x), dev(dy), c, dev(gamma), gsm, gsi, gdx, gdg, gdb);
  expect_close(gdx, dx, 1e-4, "bn dx");
  expect_close(gdg, dg, 1e-4, "bn dgamma");
  expect_close(gdb, db, 1e-4, "bn dbeta");
  cpu.batchnorm_forward_infer(x, c, gamma, beta, 1e-5f, rm, rv, y);
  gpu->batchnorm_forward_infer(dev(x), c, dev(gamma), dev(beta), 1e-5f, grm, grv, gy);
  expect_close(gy, y, 1e-5, "bn inference");
  (void)hw;
}

TEST_F(CudaEngineTest, ChannelReductionsAndAffine) {
  const int64_t n = 3, c = 5;
  Tensor x = random({n, c, 4, 6}, 40), b = random({n, c, 4, 6}, 41);
  Tensor s = Tensor::zeros({c}), q = Tensor::zeros({c}), d = Tensor::zeros({c}), y = Tensor::zeros(x.shape());
  Tensor gs = dev(s), gq = dev(q), gd = dev(d), gy = dev(y);
  Tensor sc = random({c}, 42), sh = random({c}, 43);
  cpu.channel_sums(x, c, s, q);
  cpu.channel_dot(x, b, c, d);
  cpu.channel_affine(x, c, sc, sh, y);
  gpu->channel_sums(dev(x), c, gs, gq);
  gpu->channel_dot(dev(x), dev(b), c, gd);
  gpu->channel_affine(dev(x), c, dev(sc), dev(sh), gy);
  expect_close(gs, s, 1e-6, "channel sums");
  expect_close(gq, q, 1e-6, "channel sums of squares");
  expect_close(gd, d, 1e-6, "channel dot");
  expect_close(gy, y, 1e-6, "channel affine");
}

TEST_F(CudaEngineTest, LayerNorm) {
  const int64_t m = 10, d = 300;
  Tensor x = random({m, d}, 20), dy = random({m, d}, 21), g = random({d}, 22), bt = random({d}, 23);
  Tensor mean = Tensor::zeros({m}), rstd = Tensor::zeros({m}), y = Tensor::zeros({m, d});
  Tensor dx = Tensor::zeros({m, d}), dg = random({d}, 24), db = random({d}, 25);
  Tensor gmean = dev(mean), grstd = dev(rstd), gy = dev(y), gdx = dev(dx), gdg = dev(dg), gdb = dev(db);
  cpu.layernorm_forward(x, g, bt, 1e-5f, mean, rstd, y);
  gpu->layernorm_forward(dev(x), dev(g), dev(bt), 1e-5f, gmean, grstd, gy);
  expect_close(gy, y, 1e-5, "layernorm forward");
  expect_close(grstd, rstd, 1e-5, "layernorm rstd");
  cpu.layernorm_backward(x, dy, g, mean, rstd, dx, dg, db);
  gpu->layernorm_backward(dev(x), dev(dy), dev(g), gmean, grstd, gdx, gdg, gdb);
  expect_close(gdx, dx, 1e-5, "layernorm dx");
  expect_close(gdg, dg, 1e-5, "layernorm dgamma (accumulated)");
  expect_close(gdb, db, 1e-5, "layernorm dbeta (accumulated)");
}

// The Llama family's pieces: RMSNorm, rotary positions (from position 3 on, and back) and SwiGLU.
TEST_F(CudaEngineTest, RmsNormRotaryAndSwiGlu) {
  const int64_t m = 12, d = 300;
  Tensor x = random({m, d}, 40), dy = random({m, d}, 41), g = random({d}, 42);
  Tensor rstd = Tensor::zeros({m}), y = Tensor::zeros({m, d}), dx = Tensor::zeros({m, d}), dg = random({d}, 43);
  Tensor grstd = dev(rstd), gy = dev(y), gdx = dev(dx), gdg = dev(dg);
  cpu.rmsnorm_forward(x, g, 1e-5f, rstd, y);
  gpu->rmsnorm_forward(dev(x), dev(g), 1e-5f, grstd, gy);
  expect_close(gy, y, 1e-5, "rmsnorm forward");
  expect_close(grstd, rstd, 1e-5, "rmsnorm rstd");
  cpu.rmsnorm_backward(x, dy, g, rstd, dx, dg);
  gpu->rmsnorm_backward(dev(x), dev(dy), dev(g), grstd, gdx, gdg);
  expect_close(gdx, dx, 1e-5, "rmsnorm dx");
  expect_close(gdg, dg, 1e-5, "rmsnorm dgamma (accumulated)");

  const int64_t t = 4, hd = 6;  // 3 heads of 4 positions from position 3 of a table of 8
  Tensor table = random({8, hd}, 44), q = random({3, t, hd}, 45), rq = Tensor::zeros({3, t, hd});
  Tensor grq = dev(rq);
  cpu.rotary(q, t, table, 3, false, rq);
  gpu->rotary(dev(q), t, dev(table), 3, false, grq);
  expect_close(grq, rq, 1e-6, "rotary");
  cpu.rotary(rq, t, table, 3, true, rq);  // in place, back
  gpu->rotary(grq, t, dev(table), 3, true, grq);
  expect_close(grq, rq, 1e-6, "rotary inverse in place");

  Tensor gu = random({m, 2 * d}, 46), sy = Tensor::zeros({m, d}), dgu = Tensor::zeros({m, 2 * d});
  Tensor gsy = dev(sy), gdgu = dev(dgu);
  cpu.swiglu_forward(gu, sy);
  gpu->swiglu_forward(dev(gu), gsy);
  expect_close(gsy, sy, 1e-6, "swiglu forward");
  cpu.swiglu_backward(gu, dy, dgu);
  gpu->swiglu_backward(dev(gu), dev(dy), gdgu);
  expect_close(gdgu, dgu, 1e-6, "swiglu backward");
}

TEST_F(CudaEngineTest, ElementwiseOps) {
  const int64_t n = 100003;  // not a multiple of the block size
  Tensor a = random({n}, 26, -3.f, 3.f), b = random({n}, 27);
  Tensor ga = dev(a), gb = dev(b);
  for (Unary op : {Unary::Relu, Unary::Gelu, Unary::GeluExact}) {
    Tensor y = Tensor::zeros({n}), dx = Tensor::zeros({n});
    Tensor gy = dev(y), gdx = dev(dx);
    cpu.unary_forward(op, a, y);
    cpu.unary_backward(op, a, b, dx);
    gpu->unary_forward(op, ga, gy);
    gpu->unary_backward(op, ga, gb, gdx);
    expect_close(gy, y, 1e-6, "unary forward");
    expect_close(gdx, dx, 1e-6, "unary backward");
  }
  Tensor y = Tensor::zeros({n}), gy = dev(y);
  cpu.mul(a, b, y);
  gpu->mul(ga, gb, gy);
  expect_close(gy, y, 0, "mul");
  cpu.add(a, b, y);
  gpu->add(ga, gb, gy);
  expect_close(gy, y, 0, "add");
  cpu.axpy(0.25f, a, y);
  gpu->axpy(0.25f, ga, gy);
  expect_close(gy, y, 1e-7, "axpy");
  cpu.scale(y, -3.f);
  gpu->scale(gy, -3.f);
  expect_close(gy, y, 1e-7, "scale");
  cpu.fill(y, 2.5f);
  gpu->fill(gy, 2.5f);
  expect_close(gy, y, 0, "fill");
  Tensor mask = Tensor::zeros({n}), gmask = dev(mask);
  cpu.dropout_forward(a, 0.3f, 99, mask, y);
  gpu->dropout_forward(ga, 0.3f, 99, gmask, gy);
  expect_close(gmask, mask, 0, "dropout mask (same hash on both devices)");
  expect_close(gy, y, 0, "dropout output");
  EXPECT_NEAR(gpu->sum_squares(ga), cpu.sum_squares(a), 1e-9 * cpu.sum_squares(a));
  EXPECT_TRUE(gpu->all_finite(ga));
}

TEST_F(CudaEngineTest, CastsRowBiasAndCopies) {
  const int64_t m = 37, n = 129;
  Tensor x = random({m, n}, 28, -100.f, 100.f), bias = random({n}, 29);
  for (DType t : {DType::BF16, DType::F16}) {
    Tensor lo = Tensor::empty({m, n}, t), back = Tensor::zeros({m, n});
    cpu.cast(x, lo);
    cpu.cast(lo, back);
    Tensor glo = Tensor::empty({m, n}, t, Device::cuda(0)), gback = dev(Tensor::zeros({m, n}));
    gpu->cast(dev(x), glo);
    gpu->cast(glo, gback);
    expect_close(gback, back, 0, dtype_name(t));  // identical rounding to nearest even
  }
  Tensor y = x.clone(), gy = dev(x), db = Tensor::zeros({n}), gdb = dev(db);
  cpu.add_row_bias(y, bias);
  gpu->add_row_bias(gy, dev(bias));
  expect_close(gy, y, 1e-6, "add_row_bias");
  cpu.row_bias_grad(x, db);
  gpu->row_bias_grad(dev(x), gdb);
  expect_close(gdb, db, 1e-5, "row_bias_grad");
  Tensor g2 = Tensor::empty({m, n}, DType::F32, Device::cuda(0));
  gpu->copy(gy, g2);
  expect_close(g2, y, 0, "device-to-device copy");
}

TEST_F(CudaEngineTest, SoftmaxCrossEntropy) {
  const int64_t m = 50, c = 1000;
  Tensor logits = random({m, c}, 30, -5.f, 5.f), probs = Tensor::zeros({m, c}), d = Tensor::zeros({m, c});
  Tensor labels = Tensor::empty({m}, DType::I32);
  for (int64_t i = 0; i < m; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 37) % c);
  int64_t hits = 0, ghits = 0;
  double loss = cpu.softmax_xent_forward(logits, labels, probs, &hits);
  Tensor glabels = dev(labels), gprobs = dev(probs), gd = dev(d);
  double gloss = gpu->softmax_xent_forward(dev(logits), glabels, gprobs, &ghits);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  EXPECT_EQ(ghits, hits);
  expect_close(gprobs, probs, 1e-6, "probabilities");
  cpu.softmax_xent_backward(probs, labels, 1.f / m, d);
  gpu->softmax_xent_backward(gprobs, glabels, 1.f / m, gd);
  expect_close(gd, d, 1e-7, "dlogits");
  // The deferred form: two batches add into one stats row on the device, read once.
  Tensor gstats = dev(Tensor::zeros({kXentStatsFloats}));
  gpu->softmax_xent_accumulate(dev(logits), glabels, gprobs, gstats);
  gpu->softmax_xent_accumulate(dev(logits), glabels, gprobs, gstats);
  XentStats st = xent_stats(to_host(gstats));
  EXPECT_NEAR(st.loss_sum, 2 * loss, 1e-5 * std::abs(loss));
  EXPECT_EQ(st.hits, static_cast<uint64_t>(2 * hits));
  EXPECT_EQ(st.bad_label, 0);
  expect_close(gprobs, probs, 1e-6, "probabilities (accumulate)");
  labels.data<int32_t>()[3] = static_cast<int32_t>(c);
  EXPECT_THROW(gpu->softmax_xent_forward(dev(logits), dev(labels), gprobs, nullptr), Error);
  gpu->softmax_xent_accumulate(dev(logits), dev(labels), gprobs, gstats);  // flagged, not thrown
  st = xent_stats(to_host(gstats));
  EXPECT_NE(st.bad_label, 0);
}

TEST_F(CudaEngineTest, VocabParallelCrossEntropyPieces) {
  const int64_t m = 40, n = 300, offset = 600;  // this slice: columns [600, 900) of a larger vocabulary
  Tensor logits = random({m, n}, 31, -5.f, 5.f), labels = Tensor::empty({m}, DType::I32);
  for (int64_t i = 0; i < m; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 53) % 1200);
  Tensor mx = Tensor::zeros({m}), se = Tensor::zeros({m}), tg = Tensor::zeros({m}), d = Tensor::zeros({m, n});
  Tensor glogits = dev(logits), glabels = dev(labels), gmx = dev(mx), gse = dev(se), gtg = dev(tg), gd = dev(d);
  cpu.row_max(logits, mx);
  gpu->row_max(glogits, gmx);
  expect_close(gmx, mx, 0, "row max");
  cpu.vocab_xent_partials(logits, labels, offset, mx, se, tg);
  gpu->vocab_xent_partials(glogits, glabels, offset, gmx, gse, gtg);
  expect_close(gse, se, 1e-6, "sum of exponentials");
  expect_close(gtg, tg, 0, "target logits");
  cpu.vocab_xent_backward(logits, labels, offset, mx, se, 0.5f, d);
  gpu->vocab_xent_backward(glogits, glabels, offset, gmx, gse, 0.5f, gd);
  expect_close(gd, d, 1e-6, "dlogits");
}

TEST_F(CudaEngineTest, TransformerPieces) {
  // Attention head permutation [2,5,6,4] -> [2,6,5,4], causal softmax over [3, 70, 70] (rows longer
  // than a warp), embedding gather/scatter-add with an offset (ids outside the table give zeros).
  Tensor x = random({2, 5, 6, 4}, 40), y = Tensor::zeros({2, 6, 5, 4}), gy = dev(y);
  cpu.permute_0213(x, 2, 5, 6, 4, y);
  gpu->permute_0213(dev(x), 2, 5, 6, 4, gy);
  expect_close(gy, y, 0, "permute_0213");
  const int64_t t = 70;
  Tensor s = random({3, t, t}, 41, -4.f, 4.f), dp = random({3, t, t}, 42);
  Tensor p = Tensor::zeros({3, t, t}), ds = Tensor::zeros({3, t, t}), gp = dev(p), gds = dev(ds);
  for (bool causal : {true, false}) {
    cpu.attention_softmax_forward(s, t, 0.5f, causal, p);
    gpu->attention_softmax_forward(dev(s), t, 0.5f, causal, gp);
    expect_close(gp, p, 1e-6, causal ? "causal softmax" : "bidirectional softmax");
    cpu.attention_softmax_backward(p, dp, t, 0.5f, causal, ds);
    gpu->attention_softmax_backward(gp, dev(dp), t, 0.5f, causal, gds);
    expect_close(gds, ds, 1e-5, causal ? "causal softmax backward" : "bidirectional softmax backward");
  }
  Tensor ids = Tensor::empty({9}, DType::I32);
  for (int64_t i = 0; i < 9; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>((i * 5) % 12);
  Tensor table = random({6, 8}, 43), e = Tensor::zeros({9, 8}), ge = dev(e);
  cpu.embedding_forward(ids, table, 3, e);
  Tensor gids = dev(ids);
  gpu->embedding_forward(gids, dev(table), 3, ge);
  expect_close(ge, e, 0, "embedding forward");
  Tensor dy = random({9, 8}, 44), dt = random({6, 8}, 45), gdt = dev(dt);
  cpu.embedding_backward(ids, dy, 3, dt);
  gpu->embedding_backward(gids, dev(dy), 3, gdt);
  expect_close(gdt, dt, 1e-6, "embedding backward (accumulated)");
}

TEST_F(CudaEngineTest, OptimizerUpdatesAndLossScaleCheck) {
  const int64_t n = 4097;
  Tensor p = random({n}, 31), g = random({n}, 32), buf = Tensor::zeros({n}), m = Tensor::zeros({n}),
         v = Tensor::zeros({n});
  Tensor gp = dev(p), gg = dev(g), gbuf = dev(buf), gm = dev(m), gv = dev(v);
  for (int step = 1; step <= 3; ++step) {
    cpu.sgd_update(p, g, buf, 0.1f, 0.9f, 0.f, 1e-4f, true);
    gpu->sgd_update(gp, gg, gbuf, 0.1f, 0.9f, 0.f, 1e-4f, true);
  }
  expect_close(gp, p, 1e-6, "sgd");
  for (int step = 1; step <= 3; ++step) {
    cpu.adam_update(p, g, m, v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, step);
    gpu->adam_update(gp, gg, gm, gv, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, step);
  }
  expect_close(gp, p, 1e-6, "adamw");
  // The other branches of the functors: SGD without momentum (no buffer), with plain momentum and
  // dampening, and Adam with L2 decay folded into the gradient.
  Tensor none, gnone;
  cpu.sgd_update(p, g, none, 0.1f, 0.f, 0.f, 1e-4f, false);
  gpu->sgd_update(gp, gg, gnone, 0.1f, 0.f, 0.f, 1e-4f, false);
  expect_close(gp, p, 1e-6, "sgd without momentum");
  for (int step = 1; step <= 2; ++step) {
    cpu.sgd_update(p, g, buf, 0.1f, 0.8f, 0.1f, 0.f, false);
    gpu->sgd_update(gp, gg, gbuf, 0.1f, 0.8f, 0.1f, 0.f, false);
  }
  expect_close(gp, p, 1e-6, "sgd with momentum and dampening");
  for (int step = 4; step <= 5; ++step) {
    cpu.adam_update(p, g, m, v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, false, step);
    gpu->adam_update(gp, gg, gm, gv, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, false, step);
  }
  expect_close(gp, p, 1e-6, "adam with L2");
  Tensor flag = dev(Tensor::zeros({1}));
  gpu->unscale_and_check(gg, 0.5f, flag);
  Tensor cpu_flag = Tensor::zeros({1});
  cpu.unscale_and_check(g, 0.5f, cpu_flag);
  expect_close(gg, g, 0, "unscaled");
  EXPECT_EQ(host(flag).f32()[0], 0.f);
  g.f32()[77] = std::numeric_limits<float>::quiet_NaN();
  Tensor gbad = dev(g);
  EXPECT_FALSE(gpu->all_finite(gbad));
  gpu->unscale_and_check(gbad, 1.f, flag);
  EXPECT_EQ(host(flag).f32()[0], 1.f);
}

TEST_F(CudaEngineTest, TopKSelectionGatherAndScatterMatchTheCpu) {
  // Magnitudes with many ties (values from 16 levels, both signs), so the lower-index tie-break
  // decides which of the equal ones are kept; the same idx array on both engines.
  const int64_t n = 100003;
  Rng rng(41);
  Tensor x = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i)
    x.f32()[i] =
        static_cast<float>(static_cast<int>(rng.uniform(0.f, 16.f))) * (rng.uniform(0.f, 1.f) < 0.5f ? -1.f : 1.f);
  for (int64_t k : {int64_t{1}, int64_t{1000}, int64_t{6250}, n}) {
    Tensor idx = Tensor::empty({k}, DType::I32), gidx = Tensor::empty({k}, DType::I32, Device::cuda(0));
    cpu.topk_abs(x, k, idx);
    Tensor gx = dev(x);
    gpu->topk_abs(gx, k, gidx);
    Tensor got = host(gidx);
    for (int64_t j = 0; j < k; ++j)
      ASSERT_EQ(got.data<int32_t>()[j], idx.data<int32_t>()[j]) << "k=" << k << " j=" << j;
    Tensor vals = Tensor::empty({k}), gvals = Tensor::empty({k}, DType::F32, Device::cuda(0));
    Tensor cx = x.clone();
    cpu.gather_and_clear(cx, idx, vals);
    gpu->gather_and_clear(gx, gidx, gvals);
    expect_close(gvals, vals, 0, "gathered values");
    expect_close(gx, cx, 0, "cleared residual");
    Tensor y = random({n}, 42), gy = dev(y);
    cpu.scatter_add(idx, vals, y);
    gpu->scatter_add(gidx, gvals, gy);
    expect_close(gy, y, 0, "scatter_add");
  }
}

// The other compressors' encodings against the CPU engine: the sign bits and QSGD's levels exactly
// (the scale and the norm are f64 sums in another order, so within float rounding; a level could
// differ where a value sits on a rounding edge, which this data avoids), the decodings and the
// orthonormalisation within 1e-6.
TEST_F(CudaEngineTest, SignQsgdAndOrthonormalisationMatchTheCpu) {
  const int64_t n = 100003;
  Tensor x = random({n}, 51);
  Tensor px = Tensor::empty({4 + (n + 7) / 8}, DType::U8),
         gpx = Tensor::empty({4 + (n + 7) / 8}, DType::U8, Device::cuda(0));
  Tensor cx = x.clone(), gx = dev(x);
  cpu.sign_encode(cx, px);
  gpu->sign_encode(gx, gpx);
  Tensor gbits = host(gpx);
  float cs, gs;
  std::memcpy(&cs, px.raw(), 4);
  std::memcpy(&gs, gbits.raw(), 4);
  EXPECT_NEAR(gs, cs, 1e-6 * std::abs(cs));
  EXPECT_EQ(std::memcmp(gbits.data<uint8_t>() + 4, px.data<uint8_t>() + 4, static_cast<size_t>((n + 7) / 8)), 0);
  expect_close(gx, cx, 1e-6, "sign residual");
  Tensor y = random({n}, 52), gy = dev(y);
  cpu.sign_decode_add(px, y);
  gpu->sign_decode_add(gpx, gy);
  expect_close(gy, y, 1e-6, "sign_decode_add");

  Tensor q = Tensor::empty({4 + n}, DType::U8), gq = Tensor::empty({4 + n}, DType::U8, Device::cuda(0));
  cpu.qsgd_encode(x, 16, 77, q);
  gpu->qsgd_encode(dev(x), 16, 77, gq);
  Tensor gqh = host(gq);
  int64_t differ = 0;
  for (int64_t i = 4; i < 4 + n; ++i) differ += gqh.data<uint8_t>()[i] != q.data<uint8_t>()[i];
  EXPECT_LE(differ, 2) << "QSGD levels that differ (rounding edges only)";
  Tensor z = random({n}, 53), gz = dev(z);
  cpu.qsgd_decode_add(q, 16, z);
  gpu->qsgd_decode_add(dev(q), 16, gz);
  expect_close(gz, z, 1e-6, "qsgd_decode_add");

  // Rank 1's payload in a gathered buffer starts at an odd byte offset here (n is odd): the
  // decoders read its head byte by byte.
  for (const Tensor* payload : {&px, &q}) {
    const int64_t b = payload->numel();
    Tensor two = Tensor::empty({2 * b}, DType::U8);
    std::memcpy(two.data<uint8_t>(), payload->raw(), static_cast<size_t>(b));
    std::memcpy(two.data<uint8_t>() + b, payload->raw(), static_cast<size_t>(b));
    Tensor gtwo = dev(two), w = random({n}, 55), gw = dev(w);
    Tensor second = two.slice0(b, 2 * b), gsecond = gtwo.slice0(b, 2 * b);
    if (payload == &px) {
      cpu.sign_decode_add(second, w);
      gpu->sign_decode_add(gsecond, gw);
    } else {
      cpu.qsgd_decode_add(second, 16, w);
      gpu->qsgd_decode_add(gsecond, 16, gw);
    }
    expect_close(gw, w, 1e-6, payload == &px ? "sign decode at an odd offset" : "qsgd decode at an odd offset");
  }

  Tensor m = random({300, 4}, 54), gm = dev(m);
  cpu.orthonormalize_columns(m);
  gpu->orthonormalize_columns(gm);
  expect_close(gm, m, 1e-5, "orthonormalize_columns");
}

TEST_F(CudaEngineTest, SoftmaxRowsAndVocabLossMatchTheCpu) {
  Tensor x = random({64, 1000}, 61, -8.f, 8.f), y = Tensor::empty({64, 1000});
  Tensor gy = Tensor::empty({64, 1000}, DType::F32, Device::cuda(0));
  cpu.softmax_rows(x, 0.5f, y);
  gpu->softmax_rows(dev(x), 0.5f, gy);
  expect_close(gy, y, 1e-6, "softmax_rows");
  Tensor rowmax = random({64}, 62), sumexp = random({64}, 63, 1.f, 5.f), target = random({64}, 64);
  Tensor stats = Tensor::zeros({kXentStatsFloats}), gstats = dev(stats);
  Tensor labels = Tensor::zeros({64}, DType::I32);  // every third row without a loss (kIgnoreLabel)
  for (int64_t i = 0; i < 64; i += 3) labels.data<int32_t>()[i] = kIgnoreLabel;
  cpu.vocab_xent_loss_accumulate(rowmax, sumexp, target, labels, stats);
  gpu->vocab_xent_loss_accumulate(dev(rowmax), dev(sumexp), dev(target), dev(labels), gstats);
  EXPECT_NEAR(xent_stats(host(gstats)).loss_sum, xent_stats(stats).loss_sum, 1e-9 * 64);
  EXPECT_EQ(xent_stats(host(gstats)).hits, xent_stats(stats).hits);  // target logits at their row's maximum
  EXPECT_GT(xent_stats(stats).hits, 0u);
  // The gradient of the rows without a loss is zero on both.
  Tensor d = Tensor::empty({64, 1000}), gd = Tensor::empty({64, 1000}, DType::F32, Device::cuda(0));
  cpu.vocab_xent_backward(x, labels, 0, rowmax, sumexp, 0.5f, d);
  gpu->vocab_xent_backward(dev(x), dev(labels), 0, dev(rowmax), dev(sumexp), 0.5f, gd);
  expect_close(gd, d, 1e-6, "vocab_xent_backward with ignored rows");
  EXPECT_EQ(d.f32()[3 * 1000 + 5], 0.f);
}

#if defined(DTRAIN_WITH_CUDA_ENGINE)
TEST_F(CudaEngineTest, CachingAllocatorNoMallocAfterWarmup) {
  const int64_t m = 256, n = 256, k = 256;
  Tensor a = dev(random({m * k}, 33)), b = dev(random({k * n}, 34));
  auto step = [&] {
    // A "step": temporaries of several sizes created and freed, GEMMs in two precisions.
    Tensor c = Tensor::empty({m * n}, DType::F32, Device::cuda(0));
    Tensor t = Tensor::empty({m * n}, DType::F32, Device::cuda(0));
    for (MathPrecision p : {MathPrecision::F32, MathPrecision::BF16}) {
      gpu->set_math_precision(p);
      gpu->gemm(false, false, m, n, k, 1.f, a, b, 0.f, c);
    }
    gpu->unary_forward(Unary::Gelu, c, t);
    gpu->synchronize();
  };
  step();
  cuda::AllocatorStats warm = cuda::allocator_stats(0);
  for (int i = 0; i < 5; ++i) step();
  cuda::AllocatorStats after = cuda::allocator_stats(0);
  EXPECT_EQ(after.device_mallocs, warm.device_mallocs) << cuda::format_stats(after);
  EXPECT_GT(after.cache_hits, warm.cache_hits);
  EXPECT_GE(after.peak_allocated, after.allocated);
  EXPECT_GE(after.reserved, after.allocated);
}

TEST_F(CudaEngineTest, StreamsOrderedByEvents) {
  // Work queued on compute, then a copy on the comm stream after an event wait, then compute waits
  // for comm: the result must be the computed value without any host sync in between.
  const int64_t n = 1 << 20;
  Tensor x = dev(Tensor::full({n}, 1.f)), y = Tensor::empty({n}, DType::F32, Device::cuda(0));
  gpu->scale(x, 3.f);
  cuda::comm_waits_for_compute(0);
  auto comm = static_cast<cudaStream_t>(cuda::comm_stream(0));
  ASSERT_EQ(cudaMemcpyAsync(y.device_raw(), x.device_raw(), x.nbytes(), cudaMemcpyDeviceToDevice, comm), cudaSuccess);
  cuda::compute_waits_for_comm(0);
  gpu->scale(y, 2.f);
  Tensor h = host(y);
  EXPECT_EQ(h.f32()[0], 6.f);
  EXPECT_EQ(h.f32()[n - 1], 6.f);
  cuda::DeviceInfo info = cuda::device_info(0);
  EXPECT_GT(info.sms, 0);
}

// The trainers' batch prefetch: each batch's upload is queued on the copy stream before the
// compute that reads the one before it, in two alternating slots, with no host sync in between;
// every batch arrives whole and an upload never overwrites a slot that queued compute still reads.
TEST_F(CudaEngineTest, StagedUploadsOnTheCopyStream) {
  const int64_t n = 1 << 20;
  StagedTensor slot[2];
  Tensor acc = dev(Tensor::zeros({n})), tmp = Tensor::empty({n}, DType::F32, Device::cuda(0));
  stage_async(Tensor::full({n}, 1.f), Device::cuda(0), slot[0]);
  float want = 0;
  for (int i = 0; i < 8; ++i) {
    stage_async(Tensor::full({n}, static_cast<float>(i + 2)), Device::cuda(0), slot[(i + 1) % 2]);  // ahead
    Tensor x = take_staged(slot[i % 2]);
    for (int r = 0; r < 4; ++r) gpu->unary_forward(Unary::Relu, x, tmp);  // keep the compute stream busy
    gpu->axpy(1.f, x, acc);
    want += static_cast<float>(i + 1);
  }
  Tensor h = host(acc);
  EXPECT_EQ(h.f32()[0], want);
  EXPECT_EQ(h.f32()[n / 2], want);
  EXPECT_EQ(h.f32()[n - 1], want);
  // On the CPU the staged tensor is the batch itself.
  StagedTensor on_cpu;
  Tensor batch = Tensor::full({4}, 3.f);
  stage_async(batch, Device::cpu(), on_cpu);
  EXPECT_EQ(take_staged(on_cpu).raw(), batch.raw());
}
#endif

// Training on the GPU end to end: the language-model trainer with --device cuda gives, step for
// step, the losses of the CPU engine (fp32 on both; the GEMMs sum in different orders), and its
// checkpoint, written from the device, evaluates on the CPU to the validation loss it reported.
TEST_F(CudaEngineTest, GptTrainsOnTheGpuLikeOnTheCpu) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("dtrain-gpu-gpt-" + std::to_string(::getpid()));
  test::write_lm_corpus(dir, "a gpu trains the same model", 800);
  nn::GptConfig small;
  small.context = 32;
  small.layers = 2;
  small.heads = 2;
  small.width = 32;
  train::TrainConfig c = test::small_lm_config(dir / "tok", small);
  c.steps = 12;
  c.log_every = 0;
  train::TrainResult cpu_run = train::train_lm(c, nullptr);
  c.device = "cuda";
  c.checkpoint_dir = (dir / "ckpt").string();
  train::TrainResult gpu_run = train::train_lm(c, nullptr);
  ASSERT_EQ(gpu_run.step_losses.size(), cpu_run.step_losses.size());
  for (size_t i = 0; i < cpu_run.step_losses.size(); ++i)
    EXPECT_NEAR(gpu_run.step_losses[i], cpu_run.step_losses[i], 1e-4 * cpu_run.step_losses[i]) << "step " << i;
  EXPECT_NEAR(gpu_run.last_eval.loss, cpu_run.last_eval.loss, 1e-4 * cpu_run.last_eval.loss);
  EXPECT_EQ(gpu_run.gpu_mallocs_after_warmup, 0)
      << "the caching allocator went to cudaMalloc inside a step after warm-up";
  auto model = train::gpt_from_checkpoint(train::load_checkpoint_set(gpu_run.checkpoint));
  double reloaded =
      train::evaluate_lm(*model, (dir / "tok" / "val.h5").string(), c.batch_size, c.context, c.eval_batches);
  EXPECT_NEAR(reloaded, gpu_run.last_eval.loss, 1e-4 * gpu_run.last_eval.loss);
  // And back onto the GPU: resuming the GPU checkpoint there continues from the step it holds.
  c.resume = gpu_run.checkpoint;
  c.steps = 14;
  c.checkpoint_dir.clear();
  train::TrainResult more = train::train_lm(c, nullptr);
  EXPECT_EQ(more.step_losses.size(), 2u);
  // fp16 with loss scaling (half operands with the weights' working copies, f32 accumulation) on
  // both engines: the same operand rounding, only the summation order differs.
  c.resume.clear();
  c.steps = 12;
  c.precision = "fp16";
  c.device = "cpu";
  train::TrainResult cpu16 = train::train_lm(c, nullptr);
  c.device = "cuda";
  train::TrainResult gpu16 = train::train_lm(c, nullptr);
  ASSERT_EQ(gpu16.step_losses.size(), cpu16.step_losses.size());
  for (size_t i = 0; i < cpu16.step_losses.size(); ++i)
    EXPECT_NEAR(gpu16.step_losses[i], cpu16.step_losses[i], 1e-3 * cpu16.step_losses[i]) << "fp16 step " << i;
  EXPECT_EQ(gpu16.skipped_steps, cpu16.skipped_steps);
  cpu.set_math_precision(MathPrecision::F32);
  std::filesystem::remove_all(dir);
}

namespace {
// Every "loss" of a metrics file (JSON lines), in order.
std::vector<double> logged_losses(const std::string& file) {
  std::vector<double> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    auto p = line.find("\"loss\":");
    if (p != std::string::npos) out.push_back(std::stod(line.substr(p + 7)));
  }
  return out;
}
}  // namespace

// The image trainer on the GPU (`dtrain train --device cuda`, SimpleCNN with dropout off, SGD with
// momentum) logs the CPU engine's losses (cuDNN's and oneDNN's convolutions sum in different orders).
TEST_F(CudaEngineTest, ImageTrainerOnTheGpuLikeOnTheCpu) {
  const char* exe_env = std::getenv("DTRAIN_EXE");
  const std::string exe = exe_env ? exe_env : std::string(DTRAIN_BINARY_DIR) + "/dtrain";
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("dtrain-gpu-cnn-" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  auto train = [&](const std::string& device) {
    const std::string metrics = dir + "/" + device + ".jsonl";
    const std::string cmd = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + exe +
                            " train --synthetic --model simple_cnn --dropout 0 --steps 40 --batch-size 32 "
                            "--optimizer sgd --lr 0.05 --momentum 0.9 --log-every 10 --device " +
                            device + " --metrics " + metrics + " --checkpoint-dir " + dir + "/" + device + " > " + dir +
                            "/" + device + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return logged_losses(metrics);
  };
  std::vector<double> cpu_losses = train("cpu"), gpu_losses = train("cuda");
  ASSERT_GE(cpu_losses.size(), 4u);
  ASSERT_EQ(gpu_losses.size(), cpu_losses.size());
  for (size_t i = 0; i < cpu_losses.size(); ++i)
    EXPECT_NEAR(gpu_losses[i], cpu_losses[i], 1e-3 * std::max(1.0, cpu_losses[i])) << "log line " << i;
  EXPECT_LT(gpu_losses.back(), gpu_losses.front());  // it learns the fixed batches
  std::filesystem::remove_all(dir);
}

// The same with a data loader over HDF5 shards, so the next batch is read and uploaded on the copy
// stream while the step runs (three epochs of 10 full batches: the prefetch crosses an epoch's end),
// and the run reports the allocator's figures: no cudaMalloc inside a step after the first two. (A
// short last batch is a new size: the trainer counts each size's steps after its first two, but the
// allocator does not split blocks, so a short batch can still leave a later step short of one.)
TEST_F(CudaEngineTest, ImageTrainerPrefetchesBatchesOnTheGpu) {
  const char* exe_env = std::getenv("DTRAIN_EXE");
  const std::string exe = exe_env ? exe_env : std::string(DTRAIN_BINARY_DIR) + "/dtrain";
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("dtrain-gpu-loader-" + std::to_string(::getpid()))).string();
  const std::string data = test::make_band_dataset(dir + "/data", 400, 8, 4, 128);
  auto train = [&](const std::string& device) {
    const std::string metrics = dir + "/" + device + ".jsonl";
    const std::string cmd = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + exe + " train --data " +
                            data + " --model mlp --hidden 32 --epochs 3 --batch-size 40 --optimizer sgd --lr 0.05 " +
                            "--log-every 4 --progress off --device " + device + " --metrics " + metrics + " > " + dir +
                            "/" + device + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return metrics;
  };
  const std::string cpu_m = train("cpu"), gpu_m = train("cuda");
  std::vector<double> cpu_losses = logged_losses(cpu_m), gpu_losses = logged_losses(gpu_m);
  ASSERT_GE(cpu_losses.size(), 4u);
  ASSERT_EQ(gpu_losses.size(), cpu_losses.size());
  for (size_t i = 0; i < cpu_losses.size(); ++i)
    EXPECT_NEAR(gpu_losses[i], cpu_losses[i], 1e-3 * std::max(1.0, cpu_losses[i])) << "log line " << i;
  std::ifstream in(gpu_m);
  std::string line, summary;
  while (std::getline(in, line))
    if (line.find("\"summary\"") != std::string::npos) summary = line;
  EXPECT_TRUE(std::regex_search(summary, std::regex("\"gpu_mallocs_after_warmup\": 0[,}]"))) << summary;
  EXPECT_NE(summary.find("\"gpu_peak_allocated_mib\""), std::string::npos) << summary;
  std::filesystem::remove_all(dir);
}

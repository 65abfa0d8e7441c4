// The AVX-512 kernels of the CPU engine against the reference kernels (kernels/cpu/simd.h) on
// lengths with vector tails, forward and backward; the engine's slicing across threads; and the
// batched GEMM (one oneDNN matmul over the batch) against a loop of plain GEMMs, fp32 and bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "../../kernels/cpu/simd.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/engine.h"

using namespace dtrain;
namespace simd = dtrain::cpu::simd;

namespace {

const std::vector<int64_t> kSizes = {1, 15, 17, 33, 1000};

std::vector<float> random_vec(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

// |got - want| <= tol * max(1, |want|) everywhere.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const char* what,
                  int64_t size) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err =
        std::abs(static_cast<double>(got[i]) - want[i]) / std::max(1.0, std::abs(static_cast<double>(want[i])));
    if (!(err <= worst)) worst = err, at = i;
  }
  EXPECT_LE(worst, tol) << what << " size " << size << ": element " << at << " is " << got[at] << ", reference "
                        << want[at];
}

// Each vectorised table (the parameter: "avx512" or "avx2") against the reference kernels; a table
// the processor cannot run skips.
class Vectorised : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    vec_ = GetParam() == "avx512" ? simd::avx512() : simd::avx2();
    if (!vec_) GTEST_SKIP() << "this processor cannot run the " << GetParam() << " kernels";
  }
  const simd::Kernels& ref_ = simd::reference();
  const simd::Kernels* vec_ = nullptr;
};

constexpr double kTight = 2e-6;  // fp32: a few ulps (polynomial exp, float instead of double sums)

}  // namespace

TEST(VectorisedDispatch, ActiveTableMatchesTheProcessor) {
  EXPECT_STREQ(simd::active().name, simd::avx512() ? "avx512" : simd::avx2() ? "avx2" : "reference");
}

TEST_P(Vectorised, GeluForwardAndBackward) {
  for (int64_t n : kSizes) {
    // Wide enough to reach both saturated ends of tanh.
    std::vector<float> x = random_vec(n, 1 + n, -9.f, 9.f), dy = random_vec(n, 2 + n);
    std::vector<float> y0(n), y1(n), d0(n), d1(n);
    ref_.gelu_forward(x.data(), y0.data(), n);
    vec_->gelu_forward(x.data(), y1.data(), n);
    expect_close(y1, y0, kTight, "gelu forward", n);
    ref_.gelu_backward(x.data(), dy.data(), d0.data(), n);
    vec_->gelu_backward(x.data(), dy.data(), d1.data(), n);
    expect_close(d1, d0, kTight, "gelu backward", n);
  }
}

// SwiGLU rows of several widths (tails of both register sizes), gates reaching both saturated ends
// of the sigmoid.
TEST_P(Vectorised, SwiGluForwardAndBackward) {
  for (int64_t f : {1, 7, 16, 33, 704}) {
    const int64_t rows = 3;
    std::vector<float> gu = random_vec(rows * 2 * f, 5 + f, -30.f, 30.f), dy = random_vec(rows * f, 6 + f);
    std::vector<float> y0(rows * f), y1(rows * f), d0(rows * 2 * f), d1(rows * 2 * f);
    ref_.swiglu_forward(gu.data(), y0.data(), rows, f);
    vec_->swiglu_forward(gu.data(), y1.data(), rows, f);
    expect_close(y1, y0, kTight, "swiglu forward", f);
    ref_.swiglu_backward(gu.data(), dy.data(), d0.data(), rows, f);
    vec_->swiglu_backward(gu.data(), dy.data(), d1.data(), rows, f);
    expect_close(d1, d0, kTight, "swiglu backward", f);
  }
}

TEST_P(Vectorised, ElementWise) {
  for (int64_t n : kSizes) {
    std::vector<float> a = random_vec(n, 3 + n), b = random_vec(n, 4 + n);
    std::vector<float> y0(n), y1(n);
    ref_.add(a.data(), b.data(), y0.data(), n);
    vec_->add(a.data(), b.data(), y1.data(), n);
    expect_close(y1, y0, 0, "add", n);
    ref_.mul(a.data(), b.data(), y0.data(), n);
    vec_->mul(a.data(), b.data(), y1.data(), n);
    expect_close(y1, y0, 0, "mul", n);
    y0 = b, y1 = b;
    ref_.axpy(0.37f, a.data(), y0.data(), n);
    vec_->axpy(0.37f, a.data(), y1.data(), n);
    expect_close(y1, y0, kTight, "axpy", n);
    ref_.scale(y0.data(), -1.5f, n);
    vec_->scale(y1.data(), -1.5f, n);
    expect_close(y1, y0, kTight, "scale", n);
    EXPECT_NEAR(vec_->sum_squares(a.data(), n), ref_.sum_squares(a.data(), n), 1e-12 * n) << "sum_squares " << n;
  }
}

TEST_P(Vectorised, RowBiasAndItsGradient) {
  const int64_t m = 5;
  for (int64_t n : kSizes) {
    std::vector<float> y = random_vec(m * n, 5 + n), bias = random_vec(n, 6 + n);
    std::vector<float> y0 = y, y1 = y;
    ref_.add_row_bias(y0.data(), bias.data(), m, n);
    vec_->add_row_bias(y1.data(), bias.data(), m, n);
    expect_close(y1, y0, 0, "add_row_bias", n);
    std::vector<float> g0 = bias, g1 = bias;  // accumulates into what is there
    ref_.row_bias_grad(y.data(), g0.data(), m, n);
    vec_->row_bias_grad(y.data(), g1.data(), m, n);
    expect_close(g1, g0, kTight, "row_bias_grad", n);
  }
}

TEST_P(Vectorised, LayerNormForwardAndBackward) {
  const int64_t m = 4;
  for (int64_t d : kSizes) {
    std::vector<float> x = random_vec(m * d, 7 + d, -3.f, 5.f), dy = random_vec(m * d, 8 + d);
    std::vector<float> gamma = random_vec(d, 9 + d, 0.5f, 1.5f), beta = random_vec(d, 10 + d);
    std::vector<float> mean0(m), rstd0(m), y0(m * d), mean1(m), rstd1(m), y1(m * d);
    ref_.layernorm_forward(x.data(), gamma.data(), beta.data(), 1e-5f, mean0.data(), rstd0.data(), y0.data(), m, d);
    vec_->layernorm_forward(x.data(), gamma.data(), beta.data(), 1e-5f, mean1.data(), rstd1.data(), y1.data(), m, d);
    expect_close(mean1, mean0, kTight, "layernorm mean", d);
    expect_close(rstd1, rstd0, 1e-5, "layernorm rstd", d);
    expect_close(y1, y0, 1e-5, "layernorm forward", d);

    std::vector<float> dx0(m * d), dx1(m * d);
    std::vector<float> dg0 = random_vec(d, 11 + d), db0 = random_vec(d, 12 + d);
    std::vector<float> dg1 = dg0, db1 = db0;
    ref_.layernorm_backward(x.data(), dy.data(), gamma.data(), mean0.data(), rstd0.data(), dx0.data(), dg0.data(),
                            db0.data(), m, d);
    vec_->layernorm_backward(x.data(), dy.data(), gamma.data(), mean0.data(), rstd0.data(), dx1.data(), dg1.data(),
                             db1.data(), m, d);
    // With one feature every row normalises to 0 and dx is rounding noise times rstd = 1/sqrt(eps).
    expect_close(dx1, dx0, d == 1 ? 1e-4 : 1e-5, "layernorm dx", d);
    expect_close(dg1, dg0, kTight, "layernorm dgamma", d);
    expect_close(db1, db0, kTight, "layernorm dbeta", d);
    // dx alone and the parameter gradients alone, as the engine calls them on several threads.
    std::vector<float> dx2(m * d), dg2 = dg1, db2 = db1;
    vec_->layernorm_backward(x.data(), dy.data(), gamma.data(), mean0.data(), rstd0.data(), dx2.data(), nullptr,
                             nullptr, m, d);
    expect_close(dx2, dx1, 0, "layernorm dx only", d);
    EXPECT_EQ(dg2, dg1);
    vec_->layernorm_backward(x.data(), dy.data(), gamma.data(), mean0.data(), rstd0.data(), nullptr, dg2.data(),
                             db2.data(), m, d);
    ref_.layernorm_backward(x.data(), dy.data(), gamma.data(), mean0.data(), rstd0.data(), nullptr, dg0.data(),
                            db0.data(), m, d);
    expect_close(dg2, dg0, kTight, "layernorm dgamma only", d);
  }
}

TEST_P(Vectorised, RMSNormForwardAndBackward) {
  const int64_t m = 4;
  for (int64_t d : kSizes) {
    std::vector<float> x = random_vec(m * d, 17 + d, -3.f, 5.f), dy = random_vec(m * d, 18 + d);
    std::vector<float> gamma = random_vec(d, 19 + d, 0.5f, 1.5f);
    std::vector<float> rstd0(m), y0(m * d), rstd1(m), y1(m * d);
    ref_.rmsnorm_forward(x.data(), gamma.data(), 1e-5f, rstd0.data(), y0.data(), m, d);
    vec_->rmsnorm_forward(x.data(), gamma.data(), 1e-5f, rstd1.data(), y1.data(), m, d);
    expect_close(rstd1, rstd0, kTight, "rmsnorm rstd", d);
    expect_close(y1, y0, kTight, "rmsnorm forward", d);

    std::vector<float> dx0(m * d), dx1(m * d), dg0 = random_vec(d, 20 + d), dg1 = dg0;
    ref_.rmsnorm_backward(x.data(), dy.data(), gamma.data(), rstd0.data(), dx0.data(), dg0.data(), m, d);
    vec_->rmsnorm_backward(x.data(), dy.data(), gamma.data(), rstd0.data(), dx1.data(), dg1.data(), m, d);
    expect_close(dx1, dx0, kTight, "rmsnorm dx", d);
    expect_close(dg1, dg0, 0, "rmsnorm dgamma", d);  // the reference's float operations, element by element
    // dx alone and the gain's gradient alone, as the engine calls them on several threads.
    std::vector<float> dx2(m * d), dg2 = dg1;
    vec_->rmsnorm_backward(x.data(), dy.data(), gamma.data(), rstd0.data(), dx2.data(), nullptr, m, d);
    expect_close(dx2, dx1, 0, "rmsnorm dx only", d);
    vec_->rmsnorm_backward(x.data(), dy.data(), gamma.data(), rstd0.data(), nullptr, dg2.data(), m, d);
    ref_.rmsnorm_backward(x.data(), dy.data(), gamma.data(), rstd0.data(), nullptr, dg0.data(), m, d);
    expect_close(dg2, dg0, 0, "rmsnorm dgamma only", d);
  }
}

TEST_P(Vectorised, AttentionSoftmaxForwardAndBackward) {
  for (bool causal : {true, false})
    for (int64_t t : kSizes) {
      // Rows 3..(2t+3) of a [2, t, t] block: slices start mid-sequence and cross into the next one.
      const int64_t row0 = std::min<int64_t>(3, t - 1), rows = std::min<int64_t>(2 * t, 70);
      const std::string what = causal ? "causal softmax" : "bidirectional softmax";
      std::vector<float> s = random_vec(rows * t, 13 + t, -8.f, 8.f), dp = random_vec(rows * t, 14 + t);
      std::vector<float> p0(rows * t, 7.f), p1(rows * t, 7.f);  // the masked part must be written
      ref_.attention_softmax_forward(s.data(), p0.data(), row0, rows, t, 0.35f, causal);
      vec_->attention_softmax_forward(s.data(), p1.data(), row0, rows, t, 0.35f, causal);
      expect_close(p1, p0, kTight, (what + " forward").c_str(), t);
      // Every row sums to 1 over its visible keys; causal rows are 0 past their position.
      const int64_t last = (row0 + 1) % t;  // the second row's query position
      double sum = 0;
      for (int64_t j = 0; j < t; ++j) sum += p0[t + j];
      EXPECT_NEAR(sum, 1.0, 1e-5) << what;
      if (last + 1 < t) {
        EXPECT_EQ(p0[t + last + 1] == 0.f, causal) << what;
      }
      std::vector<float> g0(rows * t, 7.f), g1(rows * t, 7.f);
      ref_.attention_softmax_backward(p0.data(), dp.data(), g0.data(), row0, rows, t, 0.35f, causal);
      vec_->attention_softmax_backward(p0.data(), dp.data(), g1.data(), row0, rows, t, 0.35f, causal);
      expect_close(g1, g0, kTight, (what + " backward").c_str(), t);
    }
}

TEST_P(Vectorised, AdamUpdate) {
  for (bool decoupled : {true, false})
    for (int64_t n : kSizes) {
      std::vector<float> p = random_vec(n, 15 + n), g = random_vec(n, 16 + n), m = random_vec(n, 17 + n, -0.1f, 0.1f);
      std::vector<float> v = random_vec(n, 18 + n, 0.f, 0.01f);
      const float beta1 = 0.9f, beta2 = 0.95f;
      fn::AdamStep f{1e-3f,    beta1, beta2, 1e-8f, 0.1f, 1.f - beta1 * beta1 * beta1, 1.f - beta2 * beta2 * beta2,
                     decoupled};
      std::vector<float> p0 = p, m0 = m, v0 = v, p1 = p, m1 = m, v1 = v;
      ref_.adam_update(p0.data(), g.data(), m0.data(), v0.data(), n, f);
      vec_->adam_update(p1.data(), g.data(), m1.data(), v1.data(), n, f);
      expect_close(p1, p0, kTight, decoupled ? "adamw param" : "adam param", n);
      expect_close(m1, m0, kTight, "adam m", n);
      expect_close(v1, v0, kTight, "adam v", n);
    }
}

INSTANTIATE_TEST_SUITE_P(Tables, Vectorised, ::testing::Values("avx512", "avx2"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The engine slices rows and elements across threads; with two threads and sizes past the
// parallel grain its results must equal one call of the active kernel on the whole range.
TEST(VectorisedEngine, ThreadSlicesMatchOneCall) {
  Engine& e = cpu_engine();
  const int saved = e.threads();
  const simd::Kernels& k = simd::active();
  const int64_t m = 300, d = 257;  // rows not a multiple of the thread count, d not of 16
  std::vector<float> xv = random_vec(m * d, 21, -2.f, 2.f), dyv = random_vec(m * d, 22);
  std::vector<float> gv = random_vec(d, 23, 0.5f, 1.5f), bv = random_vec(d, 24);
  auto tensor = [](const std::vector<float>& v, Shape s) {
    Tensor t = Tensor::empty(s);
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  };
  auto vec = [](const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); };
  for (int threads : {1, 2}) {
    e.set_threads(threads);
    Tensor x = tensor(xv, {m, d}), dy = tensor(dyv, {m, d}), gamma = tensor(gv, {d}), beta = tensor(bv, {d});
    Tensor mean = Tensor::empty({m}), rstd = Tensor::empty({m}), y = Tensor::empty({m, d});
    e.layernorm_forward(x, gamma, beta, 1e-5f, mean, rstd, y);
    std::vector<float> mean0(m), rstd0(m), y0(m * d);
    k.layernorm_forward(xv.data(), gv.data(), bv.data(), 1e-5f, mean0.data(), rstd0.data(), y0.data(), m, d);
    expect_close(vec(y), y0, 0, "engine layernorm", threads);

    Tensor dx = Tensor::empty({m, d}), dg = Tensor::zeros({d}), db = Tensor::zeros({d});
    e.layernorm_backward(x, dy, gamma, mean, rstd, dx, dg, db);
    std::vector<float> dx0(m * d), dg0(d), db0(d);
    k.layernorm_backward(xv.data(), dyv.data(), gv.data(), mean0.data(), rstd0.data(), dx0.data(), dg0.data(),
                         db0.data(), m, d);
    expect_close(vec(dx), dx0, 0, "engine layernorm dx", threads);
    expect_close(vec(dg), dg0, 0, "engine layernorm dgamma", threads);

    Tensor rs = Tensor::empty({m}), ry = Tensor::empty({m, d});
    e.rmsnorm_forward(x, gamma, 1e-5f, rs, ry);
    std::vector<float> rs0(m), ry0(m * d);
    k.rmsnorm_forward(xv.data(), gv.data(), 1e-5f, rs0.data(), ry0.data(), m, d);
    expect_close(vec(ry), ry0, 0, "engine rmsnorm", threads);
    Tensor rdx = Tensor::empty({m, d}), rdg = Tensor::zeros({d});
    e.rmsnorm_backward(x, dy, gamma, rs, rdx, rdg);
    std::vector<float> rdx0(m * d), rdg0(d);
    k.rmsnorm_backward(xv.data(), dyv.data(), gv.data(), rs0.data(), rdx0.data(), rdg0.data(), m, d);
    expect_close(vec(rdx), rdx0, 0, "engine rmsnorm dx", threads);
    expect_close(vec(rdg), rdg0, 0, "engine rmsnorm dgamma", threads);

    Tensor g = Tensor::empty({m, d});
    e.unary_forward(Unary::Gelu, x, g);
    std::vector<float> g0(m * d);
    k.gelu_forward(xv.data(), g0.data(), m * d);
    expect_close(vec(g), g0, 0, "engine gelu", threads);

    const int64_t t = 128;  // [3, t, t] scores
    std::vector<float> sv = random_vec(3 * t * t, 25, -4.f, 4.f);
    Tensor s = tensor(sv, {3, t, t}), p = Tensor::empty({3, t, t});
    e.attention_softmax_forward(s, t, 0.2f, true, p);
    std::vector<float> p0(3 * t * t);
    k.attention_softmax_forward(sv.data(), p0.data(), 0, 3 * t, t, 0.2f, true);
    expect_close(vec(p), p0, 0, "engine causal softmax", threads);
  }
  e.set_threads(saved);
}

namespace {

struct GemmCase {
  bool ta, tb;
  int64_t batch, m, n, k;
  float alpha, beta;
  int64_t pad;  // extra elements between consecutive GEMMs of the batch (0: dense)
};

// gemm_batched against a loop of gemm over the same operands, at the engine's current precision.
void check_batched(const GemmCase& g, double tol) {
  Engine& e = cpu_engine();
  const int64_t sa = g.m * g.k + g.pad, sb = g.k * g.n + g.pad, sc = g.m * g.n + g.pad;
  auto make = [](int64_t n, uint64_t seed) {
    Tensor t = Tensor::empty({n});
    std::vector<float> v = random_vec(n, seed);
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  };
  Tensor a = make(g.batch * sa, 31), b = make(g.batch * sb, 32), c0 = make(g.batch * sc, 33);
  Tensor c1 = c0.clone();
  e.gemm_batched(g.batch, g.ta, g.tb, g.m, g.n, g.k, g.alpha, a, sa, b, sb, g.beta, c1, sc);
  double worst = 0;
  for (int64_t i = 0; i < g.batch; ++i) {
    Tensor ai = a.slice0(i * sa, i * sa + g.m * g.k), bi = b.slice0(i * sb, i * sb + g.k * g.n);
    Tensor ci = c0.slice0(i * sc, i * sc + g.m * g.n).clone();
    e.gemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, ai, bi, g.beta, ci);
    for (int64_t j = 0; j < g.m * g.n; ++j)
      worst = std::max(worst, static_cast<double>(std::abs(ci.f32()[j] - c1.f32()[i * sc + j])));
    // What lies between the GEMMs of a padded batch is left alone.
    for (int64_t j = g.m * g.n; j < sc; ++j) ASSERT_EQ(c1.f32()[i * sc + j], c0.f32()[i * sc + j]);
  }
  EXPECT_LE(worst, tol) << "batch " << g.batch << " ta " << g.ta << " tb " << g.tb << " " << g.m << "x" << g.n << "x"
                        << g.k << " pad " << g.pad;
}

const std::vector<GemmCase> kGemmCases = {
    {false, true, 8, 128, 128, 32, 1.f, 0.f, 0},                                              // attention scores q k^T
    {false, false, 8, 128, 32, 128, 1.f, 0.f, 0},                                             // att v
    {true, false, 8, 128, 32, 128, 1.f, 0.f, 0},                                              // att^T dy
    {false, false, 3, 17, 33, 15, 0.5f, 1.f, 0},                                              // tails, alpha and beta
    {true, true, 5, 33, 17, 1, 1.f, 0.25f, 0},    {false, true, 4, 40, 24, 20, 1.f, 0.f, 7},  // non-dense batch stride
};

struct PrecisionGuard {
  ~PrecisionGuard() { cpu_engine().set_math_precision(MathPrecision::F32); }
};

}  // namespace

TEST(VectorisedGemm, BatchedMatchesLoopFp32) {
  for (const GemmCase& g : kGemmCases) check_batched(g, 1e-5);
}

TEST(VectorisedGemm, BatchedMatchesLoopBf16) {
  PrecisionGuard guard;
  cpu_engine().set_math_precision(MathPrecision::BF16);
  // Both sides round the operands to bf16 and accumulate in f32; only the summation order differs
  // (and GEMMs under 16 rows or columns stay fp32 on the loop's side).
  for (const GemmCase& g : kGemmCases) check_batched(g, g.m >= 16 && g.n >= 16 ? 1e-3 : 0.1);
}

// More shapes than the primitive cache holds: evicted shapes are rebuilt and stay correct.
TEST(VectorisedGemm, ManyShapesThroughTheBoundedCache) {
  for (int64_t m = 1; m <= 80; ++m) check_batched({false, true, 2, m, 9, 5, 1.f, 0.f, 0}, 1e-5);
  check_batched({false, true, 8, 128, 128, 32, 1.f, 0.f, 0}, 1e-5);
}

// Tensor parallelism splits attention heads across ranks, so a rank batches fewer GEMMs than one
// rank does; each head's result must not depend on how many heads share the call.
TEST(VectorisedGemm, ResultDoesNotDependOnBatchCount) {
  Engine& e = cpu_engine();
  for (GemmCase g :
       {GemmCase{false, true, 4, 8, 8, 4, 1.f, 0.f, 0}, GemmCase{false, false, 4, 8, 4, 8, 1.f, 0.f, 0},
        GemmCase{true, false, 4, 8, 4, 8, 1.f, 0.f, 0}, GemmCase{false, true, 8, 128, 128, 32, 1.f, 0.f, 0},
        GemmCase{false, false, 8, 128, 32, 128, 1.f, 0.f, 0}}) {
    const int64_t sa = g.m * g.k, sb = g.k * g.n, sc = g.m * g.n;
    Tensor a = Tensor::empty({g.batch * sa}), b = Tensor::empty({g.batch * sb});
    std::vector<float> av = random_vec(a.numel(), 41), bv = random_vec(b.numel(), 42);
    std::copy(av.begin(), av.end(), a.f32());
    std::copy(bv.begin(), bv.end(), b.f32());
    Tensor all = Tensor::zeros({g.batch * sc}), half = Tensor::zeros({g.batch * sc});
    e.gemm_batched(g.batch, g.ta, g.tb, g.m, g.n, g.k, 1.f, a, sa, b, sb, 0.f, all, sc);
    for (int64_t h = 0; h < g.batch; h += g.batch / 2) {
      Tensor ah = a.slice0(h * sa, (h + g.batch / 2) * sa), bh = b.slice0(h * sb, (h + g.batch / 2) * sb);
      Tensor ch = half.slice0(h * sc, (h + g.batch / 2) * sc);
      e.gemm_batched(g.batch / 2, g.ta, g.tb, g.m, g.n, g.k, 1.f, ah, sa, bh, sb, 0.f, ch, sc);
    }
    int64_t differ = 0;
    for (int64_t i = 0; i < all.numel(); ++i) differ += all.f32()[i] != half.f32()[i];
    EXPECT_EQ(differ, 0) << g.m << "x" << g.n << "x" << g.k << " ta " << g.ta << " tb " << g.tb;
  }
}

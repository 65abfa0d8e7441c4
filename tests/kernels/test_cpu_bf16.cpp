// Mixed precision on the CPU engine: bf16 GEMM/conv against exact references, fp16 rounding, the
// loss-scale check, and the functors shared with the CUDA engine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../../kernels/cpu/cpu_engine.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/kernels/functors.h"

using namespace dtrain;

namespace {

Tensor random(const Shape& s, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty(s);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.uniform(-1.f, 1.f);
  return t;
}

float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }
float round_f16(float x) { return f16_to_float(float_to_f16(x)); }

// C = alpha op(A) op(B) + beta C in double, operands first passed through `round`.
template <typename Round>
std::vector<double> ref_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                             const Tensor& b, float beta, const Tensor& c0, Round round) {
  std::vector<double> c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        float av = ta ? a.f32()[p * m + i] : a.f32()[i * k + p];
        float bv = tb ? b.f32()[j * k + p] : b.f32()[p * n + j];
        s += static_cast<double>(round(av)) * round(bv);
      }
      c[static_cast<size_t>(i * n + j)] = alpha * s + beta * c0.f32()[i * n + j];
    }
  return c;
}

double max_abs_diff(const Tensor& c, const std::vector<double>& ref) {
  double d = 0;
  for (size_t i = 0; i < ref.size(); ++i) d = std::max(d, std::abs(c.f32()[i] - ref[i]));
  return d;
}

struct PrecisionGuard {  // restores fp32 math even when a test fails
  ~PrecisionGuard() { cpu_engine().set_math_precision(MathPrecision::F32); }
};

}  // namespace

TEST(MathPrecision, NamesRoundTrip) {
  for (MathPrecision p : {MathPrecision::F32, MathPrecision::TF32, MathPrecision::BF16, MathPrecision::F16})
    EXPECT_EQ(math_precision_from_name(math_precision_name(p)), p);
  EXPECT_THROW(math_precision_from_name("fp8"), InputError);
}

TEST(CpuBf16, GemmAllTransposesMatchBf16RoundedReference) {
  Engine& e = cpu_engine();
  PrecisionGuard guard;
  const int64_t m = 37, n = 53, k = 70;
  for (int t = 0; t < 4; ++t) {
    bool ta = t & 1, tb = t & 2;
    Tensor a = random({m * k}, 1 + t), b = random({k * n}, 11 + t), c0 = random({m * n}, 21 + t);
    for (auto [alpha, beta] : {std::pair{1.f, 0.f}, std::pair{0.5f, 1.f}}) {
      Tensor c = c0.clone();
      e.set_math_precision(MathPrecision::BF16);
      e.gemm(ta, tb, m, n, k, alpha, a, b, beta, c);
      // Only the summation order differs from a reference fed the same bf16-rounded operands.
      EXPECT_LT(max_abs_diff(c, ref_gemm(ta, tb, m, n, k, alpha, a, b, beta, c0, round_bf16)), 1e-4)
          << "ta " << ta << " tb " << tb << " alpha " << alpha << " beta " << beta;
      // And it is within bf16 tolerance of the fp32 product: |err| <~ 2^-8 * sqrt(k) for values in [-1, 1].
      EXPECT_LT(max_abs_diff(c, ref_gemm(ta, tb, m, n, k, alpha, a, b, beta, c0, [](float x) { return x; })),
                4.0 / 256 * std::sqrt(static_cast<double>(k)));
    }
  }
}

TEST(CpuBf16, Bf16TensorsAndBatchedGemm) {
  Engine& e = cpu_engine();
  const int64_t batch = 3, m = 16, n = 24, k = 40;
  Tensor a = random({batch * m * k}, 5), b = random({batch * k * n}, 6);
  Tensor a16 = Tensor::empty(a.shape(), DType::BF16), b16 = Tensor::empty(b.shape(), DType::BF16);
  e.cast(a, a16);
  e.cast(b, b16);
  Tensor c = Tensor::zeros({batch * m * n});
  e.gemm_batched(batch, false, true, m, n, k, 1.f, a16, m * k, b16, k * n, 0.f, c, m * n);
  for (int64_t i = 0; i < batch; ++i) {
    Tensor ai = a.slice0(i * m * k, (i + 1) * m * k), bi = b.slice0(i * k * n, (i + 1) * k * n);
    Tensor ci = c.slice0(i * m * n, (i + 1) * m * n);
    EXPECT_LT(max_abs_diff(ci, ref_gemm(false, true, m, n, k, 1.f, ai, bi, 0.f, Tensor::zeros({m * n}), round_bf16)),
              1e-4)
        << "batch " << i;
  }
}

TEST(CpuBf16, Fp16MathRoundsOperandsToHalf) {
  Engine& e = cpu_engine();
  PrecisionGuard guard;
  const int64_t m = 8, n = 9, k = 300;
  Tensor a = random({m * k}, 7), b = random({k * n}, 8), c = Tensor::zeros({m * n});
  e.set_math_precision(MathPrecision::F16);
  e.gemm(false, false, m, n, k, 1.f, a, b, 0.f, c);
  EXPECT_LT(max_abs_diff(c, ref_gemm(false, false, m, n, k, 1.f, a, b, 0.f, Tensor::zeros({m * n}), round_f16)), 1e-4);
}

// A weight's working copy (bf16 or f16) beside f32 activations gives the products the all-f32 GEMM
// gives under that math precision, bit for bit: the copy holds exactly what the rounding would.
TEST(CpuBf16, LowPrecisionWeightBesideF32OperandEqualsRoundingTheMaster) {
  Engine& e = cpu_engine();
  PrecisionGuard guard;
  const int64_t m = 40, n = 48, k = 72;
  for (MathPrecision p : {MathPrecision::BF16, MathPrecision::F16}) {
    const DType low = p == MathPrecision::BF16 ? DType::BF16 : DType::F16;
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      Tensor x = random({m * k}, 31 + t), w = random({k * n}, 41 + t);
      Tensor w_low = Tensor::empty(w.shape(), low), x_low = Tensor::empty(x.shape(), low);
      e.cast(w, w_low);
      e.cast(x, x_low);
      e.set_math_precision(p);
      ASSERT_TRUE(e.rounds_gemm(m, n));
      Tensor masters = Tensor::zeros({m * n}), weight_low = Tensor::zeros({m * n}), act_low = Tensor::zeros({m * n});
      e.gemm(ta, tb, m, n, k, 1.f, x, w, 0.f, masters);
      e.gemm(ta, tb, m, n, k, 1.f, x, w_low, 0.f, weight_low);  // the working copy as B
      e.gemm(ta, tb, m, n, k, 1.f, x_low, w, 0.f, act_low);     // and a low-precision A
      for (int64_t i = 0; i < m * n; ++i) {
        ASSERT_EQ(masters.f32()[i], weight_low.f32()[i]) << math_precision_name(p) << " ta " << ta << " tb " << tb;
        ASSERT_EQ(masters.f32()[i], act_low.f32()[i]) << math_precision_name(p) << " ta " << ta << " tb " << tb;
      }
      // Not the fp32 product: the copy really is low precision.
      e.set_math_precision(MathPrecision::F32);
      Tensor exact = Tensor::zeros({m * n});
      e.gemm(ta, tb, m, n, k, 1.f, x, w, 0.f, exact);
      EXPECT_GT(max_abs_diff(weight_low, std::vector<double>(exact.f32(), exact.f32() + m * n)), 1e-4);
    }
  }
  // Small products stay fp32 under bf16 (the classifier): a layer must then read the master.
  e.set_math_precision(MathPrecision::BF16);
  EXPECT_FALSE(e.rounds_gemm(64, 10));
  e.set_math_precision(MathPrecision::F32);
  EXPECT_FALSE(e.rounds_gemm(64, 64));
  // bf16 beside f16 is no multiply at all.
  Tensor b16 = Tensor::empty({16 * 16}, DType::BF16), h16 = Tensor::empty({16 * 16}, DType::F16);
  Tensor c = Tensor::zeros({16 * 16});
  EXPECT_THROW(e.gemm(false, false, 16, 16, 16, 1.f, b16, h16, 0.f, c), Error);
}

TEST(CpuBf16, ConvolutionForwardAndBackwardWithinBf16Tolerance) {
  Engine& e = cpu_engine();
  PrecisionGuard guard;
  Conv2dGeom g{4, 3, 12, 12, 8, 3, 3, 1, 1};
  Tensor x = random({g.n, g.c, g.h, g.w}, 31), w = random({g.k, g.c, g.r, g.s}, 32), bias = random({g.k}, 33);
  Tensor dy = random({g.n, g.k, g.out_h(), g.out_w()}, 34);
  struct Out {
    Tensor y, dx, dw, db;
  };
  auto run = [&](MathPrecision p) {
    e.set_math_precision(p);
    Out o{Tensor::zeros(dy.shape()), Tensor::zeros(x.shape()), Tensor::zeros(w.shape()), Tensor::zeros({g.k})};
    e.conv2d_forward(g, x, w, bias, o.y);
    e.conv2d_backward_data(g, dy, w, o.dx);
    e.conv2d_backward_weights(g, x, dy, o.dw, o.db);
    return o;
  };
  Out f = run(MathPrecision::F32), h = run(MathPrecision::BF16);
  auto rel = [](const Tensor& got, const Tensor& want) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      num = std::max(num, static_cast<double>(std::abs(got.f32()[i] - want.f32()[i])));
      den = std::max(den, static_cast<double>(std::abs(want.f32()[i])));
    }
    return num / den;
  };
  // bf16 keeps 8 significant bits: relative errors of a few 2^-8 over sums of ~100 products.
  EXPECT_LT(rel(h.y, f.y), 2e-2);
  EXPECT_LT(rel(h.dx, f.dx), 2e-2);
  EXPECT_LT(rel(h.dw, f.dw), 2e-2);
  EXPECT_LT(rel(h.db, f.db), 1e-2) << "the bias gradient sums the bf16-rounded dy in f32";
  EXPECT_GT(rel(h.y, f.y), 0.0) << "bf16 math should actually round";
}

TEST(LossScaleCheck, UnscalesAndFlagsNonFinite) {
  Engine& e = cpu_engine();
  Tensor x = Tensor::from({4}, {2.f, -4.f, 8.f, 1e30f});
  Tensor flag = Tensor::zeros({1});
  e.unscale_and_check(x, 0.5f, flag);
  EXPECT_FLOAT_EQ(x.f32()[1], -2.f);
  EXPECT_EQ(flag.f32()[0], 0.f);
  Tensor y = Tensor::from({3}, {1.f, std::numeric_limits<float>::infinity(), 0.f});
  e.unscale_and_check(y, 1.f, flag);
  EXPECT_EQ(flag.f32()[0], 1.f);
  Tensor z = Tensor::from({2}, {1.f, 2.f});
  e.unscale_and_check(z, 1.f, flag);
  EXPECT_EQ(flag.f32()[0], 1.f) << "the flag is sticky across tensors";
}

TEST(Functors, SharedArithmetic) {
  EXPECT_FLOAT_EQ(fn::Axpy{2.f}(3.f, 1.f), 7.f);
  EXPECT_FLOAT_EQ(fn::Scale{0.5f}(3.f), 1.5f);
  EXPECT_TRUE(fn::is_finite(1e38f));
  EXPECT_FALSE(fn::is_finite(std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(fn::is_finite(std::numeric_limits<float>::quiet_NaN()));
  // The dropout mask keeps about 1-p of the elements, scaled by 1/(1-p).
  fn::DropoutMask mask{0.25f, 1.f / 0.75f, 42};
  int kept = 0;
  for (uint64_t i = 0; i < 100000; ++i) {
    float v = mask(i);
    ASSERT_TRUE(v == 0.f || v == 1.f / 0.75f);
    kept += v != 0.f;
  }
  EXPECT_NEAR(kept / 100000.0, 0.75, 0.01);
}

TEST(CudaAvailability, EnableCudaIsSafeWithoutGpu) {
  int n = enable_cuda();
  EXPECT_GE(n, 0);
  EXPECT_EQ(enable_cuda(), n) << "idempotent";
}

// The vectorised conversions (AVX2 bf16 rounding, F16C half conversions) against dtype.h's scalar
// functions, bit for bit, over random bit patterns and the edge cases (ties, the largest half,
// overflow to infinity, half subnormals, signed zeros, infinities), on lengths with vector tails.
// NaN must stay NaN. On an AVX512-BF16 processor f32_to_bf16 may flush f32 subnormals to zero, so
// those are left out of its comparison.
TEST(CpuConversions, VectorisedMatchScalarBitForBit) {
  Rng rng(17);
  std::vector<float> v;
  for (float x : {0.f, -0.f, 1.f, -1.f, 65504.f, 65519.f, 65520.f, -65520.f, 1e-5f, 6e-8f, 3e-8f, 1e-40f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), 1.00390625f, 1.01171875f, 2049.f, 2051.f})
    v.push_back(x);
  for (int i = 0; i < 5000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng.next());
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
    v.push_back(rng.uniform(-70000.f, 70000.f));
    v.push_back(rng.uniform(-1e-4f, 1e-4f));
  }
  auto same = [](float a, float b) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    uint32_t x, y;
    std::memcpy(&x, &a, 4);
    std::memcpy(&y, &b, 4);
    return x == y;
  };
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{15}, int64_t{17}, int64_t{33},
                    static_cast<int64_t>(v.size())}) {
    std::vector<float> r(static_cast<size_t>(n)), w(static_cast<size_t>(n));
    std::vector<uint16_t> h(static_cast<size_t>(n));
    cpu::round_to_bf16(v.data(), r.data(), n);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_TRUE(same(r[i], bf16_to_float(float_to_bf16(v[i])))) << "round_to_bf16 of " << v[i] << " n " << n;
    cpu::f32_to_bf16(v.data(), h.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      if (std::fpclassify(v[i]) == FP_SUBNORMAL) continue;
      ASSERT_TRUE(same(bf16_to_float(h[i]), bf16_to_float(float_to_bf16(v[i])))) << "f32_to_bf16 of " << v[i];
    }
    cpu::round_to_f16(v.data(), r.data(), n);
    cpu::f32_to_f16(v.data(), h.data(), n);
    cpu::f16_to_f32(h.data(), w.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float want = f16_to_float(float_to_f16(v[i]));
      ASSERT_TRUE(same(r[i], want)) << "round_to_f16 of " << v[i] << " n " << n;
      ASSERT_TRUE(same(w[i], want)) << "f32_to_f16 then f16_to_f32 of " << v[i] << " n " << n;
      if (!std::isnan(v[i])) {
        ASSERT_EQ(h[i], float_to_f16(v[i])) << "f32_to_f16 of " << v[i];
      }
    }
  }
}

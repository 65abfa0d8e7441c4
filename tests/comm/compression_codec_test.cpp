// The compression encodings as plain functions (no MPI).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

using namespace dtrain;
using namespace dtrain::comm;

TEST(CompressionCodec, TopKPicksLargestMagnitudesTiesToLowerIndex) {
  std::vector<float> x = {0.5f, -9.0f, 3.0f, 3.0f, -3.0f, 0.0f, 7.0f, 1.0f};
  EXPECT_EQ(codec::topk_indices(x.data(), 8, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(codec::topk_indices(x.data(), 8, 2), (std::vector<int32_t>{1, 6}));
  // |3| three times (indices 2, 3, 4): the lower indices win.
  EXPECT_EQ(codec::topk_indices(x.data(), 8, 4), (std::vector<int32_t>{1, 2, 3, 6}));
  EXPECT_EQ(codec::topk_indices(x.data(), 8, 0).size(), 0u);
  EXPECT_EQ(codec::topk_indices(x.data(), 8, 99).size(), 8u);
}

// The compute engine's top-k pieces (what buckets on a GPU go through; the CPU engine here) pick
// exactly what the compressor's codec picks, ties included.
TEST(CompressionCodec, EngineTopKAgreesWithTheCodec) {
  Engine& e = cpu_engine();
  const int64_t n = 5000;
  Rng rng(7);
  Tensor x = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) x.f32()[i] = std::round(rng.uniform(-8.f, 8.f));  // many equal magnitudes
  for (int64_t k : {int64_t{1}, int64_t{50}, int64_t{777}, n}) {
    Tensor idx = Tensor::empty({k}, DType::I32);
    e.topk_abs(x, k, idx);
    std::vector<int32_t> got(idx.data<int32_t>(), idx.data<int32_t>() + k);
    EXPECT_EQ(got, codec::topk_indices(x.f32(), n, k)) << "k=" << k;
  }
  Tensor small = Tensor::from({8}, {0.5f, -9.0f, 3.0f, 3.0f, -3.0f, 0.0f, 7.0f, 1.0f});
  Tensor idx = Tensor::empty({4}, DType::I32), vals = Tensor::empty({4});
  e.topk_abs(small, 4, idx);
  e.gather_and_clear(small, idx, vals);
  EXPECT_EQ(std::vector<float>(vals.f32(), vals.f32() + 4), (std::vector<float>{-9.0f, 3.0f, 3.0f, 7.0f}));
  EXPECT_EQ(std::vector<float>(small.f32(), small.f32() + 8),
            (std::vector<float>{0.5f, 0.0f, 0.0f, 0.0f, -3.0f, 0.0f, 0.0f, 1.0f}));
  Tensor y = Tensor::from({8}, {1, 1, 1, 1, 1, 1, 1, 1});
  e.scatter_add(idx, vals, y);
  EXPECT_EQ(std::vector<float>(y.f32(), y.f32() + 8), (std::vector<float>{1, -8, 4, 4, 1, 1, 8, 1}));
  Tensor too_many = Tensor::empty({9}, DType::I32);
  EXPECT_THROW(e.topk_abs(small, 9, too_many), Error);
}

TEST(CompressionCodec, SignBitsRoundTrip) {
  std::vector<float> x(37);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 == 0) ? -1.0f * static_cast<float>(i) : static_cast<float>(i);
  std::vector<uint8_t> bits((x.size() + 7) / 8);
  codec::pack_signs(x.data(), static_cast<int64_t>(x.size()), bits.data());
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(codec::signed_unit(bits.data(), static_cast<int64_t>(i)), x[i] >= 0 ? 1.0f : -1.0f) << i;
  // -0 is x >= 0: sends +1 (its residual keeps the difference).
  float z = -0.0f;
  uint8_t b = 0;
  codec::pack_signs(&z, 1, &b);
  EXPECT_EQ(codec::signed_unit(&b, 0), 1.0f);
}

TEST(CompressionCodec, QsgdIsExactOnIntegerLevels) {
  // norm(3, -4) = 5; with s = 5 the levels are exactly 3 and -4: no rounding, any seed.
  std::vector<float> x = {0.75f, -1.0f, 0.0f};  // = 0.25 * (3, -4, 0)
  std::vector<int8_t> q(3);
  Rng rng(123);
  float norm = codec::qsgd_encode(x.data(), 3, 5, rng, q.data());
  EXPECT_EQ(norm, 1.25f);
  EXPECT_EQ(q, (std::vector<int8_t>{3, -4, 0}));
}

TEST(CompressionCodec, QsgdIsUnbiased) {
  std::vector<float> x = {0.3f, -0.1f, 0.7f, 0.05f};
  const int trials = 20000;
  std::vector<double> mean(x.size(), 0.0);
  Rng rng(7);
  std::vector<int8_t> q(x.size());
  for (int t = 0; t < trials; ++t) {
    float norm = codec::qsgd_encode(x.data(), 4, 4, rng, q.data());
    for (size_t i = 0; i < x.size(); ++i) mean[i] += norm * q[i] / 4.0 / trials;
  }
  // Standard error per element is below 0.004 here; 0.02 leaves a wide margin and still fails on a bias.
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(mean[i], x[i], 0.02) << i;
}

TEST(CompressionCodec, OrthonormalizeColumns) {
  // 4 x 2, row-major; the second column has a component along the first.
  std::vector<float> m = {1, 1, 1, 2, 1, 3, 1, 4};
  codec::orthonormalize_columns(m.data(), 4, 2);
  auto dot = [&](int a, int b) {
    double s = 0;
    for (int i = 0; i < 4; ++i) s += m[static_cast<size_t>(i * 2 + a)] * m[static_cast<size_t>(i * 2 + b)];
    return s;
  };
  EXPECT_NEAR(dot(0, 0), 1, 1e-6);
  EXPECT_NEAR(dot(1, 1), 1, 1e-6);
  EXPECT_NEAR(dot(0, 1), 0, 1e-6);
  std::vector<float> zero(6, 0.0f);
  codec::orthonormalize_columns(zero.data(), 3, 2);
  for (float v : zero) EXPECT_EQ(v, 0.0f);  // no NaN from a null column
}

TEST(CompressionCodec, FactoryParsesSpecsAndNamesBadOnes) {
  EXPECT_EQ(make_compressor("none")->name(), "none");
  EXPECT_EQ(make_compressor("fp16")->name(), "fp16");
  EXPECT_EQ(make_compressor("bf16")->name(), "bf16");
  EXPECT_EQ(make_compressor("topk:0.1")->name(), "topk(0.1)");
  EXPECT_EQ(make_compressor("topk")->name(), "topk(0.01)");
  EXPECT_EQ(make_compressor("powersgd:2")->name(), "powersgd(2)");
  EXPECT_EQ(make_compressor("sign")->name(), "sign");
  EXPECT_EQ(make_compressor("qsgd:8")->name(), "qsgd(8)");
  EXPECT_TRUE(make_compressor("topk")->has_error_feedback());
  EXPECT_FALSE(make_compressor("qsgd")->has_error_feedback());
  for (const char* bad : {"zip", "topk:2", "topk:x", "powersgd:0", "qsgd:500", "fp16:3"}) {
    try {
      make_compressor(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TEST(CompressionCodec, PowerSgdMatrixShapeCoversTheBucket) {
  for (int64_t n : {1, 2, 10, 100, 1000, 12345}) {
    auto [rows, cols] = PowerSgdCompressor::matrix_shape(n);
    EXPECT_GE(rows * cols, n);
    EXPECT_LT(rows * cols - n, cols) << n;  // at most one partial row of padding
  }
}

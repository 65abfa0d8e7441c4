// The compression encodings: the Engine ops every compressor runs through, on the CPU engine (the
// oracle of the CUDA engine's, which tests/kernels/test_cuda_engine.cpp holds against it). No MPI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "dtrain/comm/compression.h"
#include "dtrain/core/topk.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/kernels/functors.h"

using namespace dtrain;
using namespace dtrain::comm;

TEST(CompressionCodec, TopKPicksLargestMagnitudesTiesToLowerIndex) {
  std::vector<float> x = {0.5f, -9.0f, 3.0f, 3.0f, -3.0f, 0.0f, 7.0f, 1.0f};
  EXPECT_EQ(topk_abs_indices(x.data(), 8, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(topk_abs_indices(x.data(), 8, 2), (std::vector<int32_t>{1, 6}));
  // |3| three times (indices 2, 3, 4): the lower indices win.
  EXPECT_EQ(topk_abs_indices(x.data(), 8, 4), (std::vector<int32_t>{1, 2, 3, 6}));
}

// The compute engine's top-k pieces pick exactly what the shared selection picks, ties included.
TEST(CompressionCodec, EngineTopKAgreesWithTheSelection) {
  Engine& e = cpu_engine();
  const int64_t n = 5000;
  Rng rng(7);
  Tensor x = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) x.f32()[i] = std::round(rng.uniform(-8.f, 8.f));  // many equal magnitudes
  for (int64_t k : {int64_t{1}, int64_t{50}, int64_t{777}, n}) {
    Tensor idx = Tensor::empty({k}, DType::I32);
    e.topk_abs(x, k, idx);
    std::vector<int32_t> got(idx.data<int32_t>(), idx.data<int32_t>() + k);
    EXPECT_EQ(got, topk_abs_indices(x.f32(), n, k)) << "k=" << k;
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

// 1-bit: the scale is mean |x|, bit i says x[i] >= 0 (-0 too), x keeps what was not sent, and the
// decoding adds scale * sign into y.
TEST(CompressionCodec, SignEncodeKeepsTheResidualAndDecodes) {
  Engine& e = cpu_engine();
  const int64_t n = 37;
  Tensor x = Tensor::empty({n});
  double l1 = 0;
  for (int64_t i = 0; i < n; ++i) {
    x.f32()[i] = (i % 3 == 0) ? -1.0f * static_cast<float>(i) : static_cast<float>(i);
    l1 += std::fabs(x.f32()[i]);
  }
  x.f32()[0] = -0.0f;
  const Tensor before = x.clone();
  Tensor payload = Tensor::empty({4 + (n + 7) / 8}, DType::U8);
  e.sign_encode(x, payload);
  float scale;
  std::memcpy(&scale, payload.raw(), 4);
  EXPECT_FLOAT_EQ(scale, static_cast<float>(l1 / n));
  Tensor y = Tensor::zeros({n});
  e.sign_decode_add(payload, y);
  for (int64_t i = 0; i < n; ++i) {
    const float sign = before.f32()[i] >= 0 ? 1.f : -1.f;  // -0 >= 0: +1
    EXPECT_EQ(fn::sign_unit(payload.data<uint8_t>() + 4, i), sign) << i;
    EXPECT_EQ(y.f32()[i], scale * sign) << i;
    EXPECT_EQ(x.f32()[i], before.f32()[i] - scale * sign) << i;  // what is left for the next step
  }
  Tensor wrong = Tensor::empty({4}, DType::U8);
  EXPECT_THROW(e.sign_encode(x, wrong), Error);
  // Rank 1's payload in a gathered buffer starts at an odd byte here (4 + 5 bytes each).
  const int64_t b = payload.numel();
  Tensor two = Tensor::empty({2 * b}, DType::U8);
  std::memcpy(two.data<uint8_t>(), payload.raw(), static_cast<size_t>(b));
  std::memcpy(two.data<uint8_t>() + b, payload.raw(), static_cast<size_t>(b));
  Tensor again = Tensor::zeros({n});
  e.sign_decode_add(two.slice0(b, 2 * b), again);
  EXPECT_EQ(std::memcmp(again.raw(), y.raw(), y.nbytes()), 0);
}

namespace {
std::vector<int8_t> levels_of(const Tensor& payload) {
  const auto* q = reinterpret_cast<const int8_t*>(payload.data<uint8_t>() + 4);
  return std::vector<int8_t>(q, q + payload.numel() - 4);
}
}  // namespace

TEST(CompressionCodec, QsgdIsExactOnIntegerLevels) {
  // norm(3, -4) = 5; with s = 5 the levels are exactly 3 and -4: no rounding, any seed.
  Tensor x = Tensor::from({3}, {0.75f, -1.0f, 0.0f});  // = 0.25 * (3, -4, 0)
  Tensor payload = Tensor::empty({7}, DType::U8);
  cpu_engine().qsgd_encode(x, 5, 123, payload);
  float norm;
  std::memcpy(&norm, payload.raw(), 4);
  EXPECT_EQ(norm, 1.25f);
  EXPECT_EQ(levels_of(payload), (std::vector<int8_t>{3, -4, 0}));
  Tensor y = Tensor::from({3}, {1, 1, 1});
  cpu_engine().qsgd_decode_add(payload, 5, y);
  EXPECT_EQ(std::vector<float>(y.f32(), y.f32() + 3), (std::vector<float>{1.75f, 0.f, 1.f}));
}

TEST(CompressionCodec, QsgdIsUnbiasedOverSeeds) {
  Tensor x = Tensor::from({4}, {0.3f, -0.1f, 0.7f, 0.05f});
  const int trials = 20000;
  Tensor sum = Tensor::zeros({4}), payload = Tensor::empty({8}, DType::U8);
  for (int t = 0; t < trials; ++t) {
    cpu_engine().qsgd_encode(x, 4, derive_seed(7, static_cast<uint64_t>(t)), payload);
    cpu_engine().qsgd_decode_add(payload, 4, sum);
  }
  // Standard error per element is below 0.004 here; 0.02 leaves a wide margin and still fails on a bias.
  for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(sum.f32()[i] / trials, x.f32()[i], 0.02) << i;
  // One seed gives one draw: the same levels again.
  Tensor again = Tensor::empty({8}, DType::U8), once = Tensor::empty({8}, DType::U8);
  cpu_engine().qsgd_encode(x, 4, 99, once);
  cpu_engine().qsgd_encode(x, 4, 99, again);
  EXPECT_EQ(levels_of(once), levels_of(again));
}

TEST(CompressionCodec, OrthonormalizeColumns) {
  // 4 x 2, row-major; the second column has a component along the first.
  Tensor m = Tensor::from({4, 2}, {1, 1, 1, 2, 1, 3, 1, 4});
  cpu_engine().orthonormalize_columns(m);
  auto dot = [&](int a, int b) {
    double s = 0;
    for (int i = 0; i < 4; ++i) s += m.f32()[i * 2 + a] * m.f32()[i * 2 + b];
    return s;
  };
  EXPECT_NEAR(dot(0, 0), 1, 1e-6);
  EXPECT_NEAR(dot(1, 1), 1, 1e-6);
  EXPECT_NEAR(dot(0, 1), 0, 1e-6);
  EXPECT_NEAR(m.f32()[0], 0.5, 1e-6);  // the first column is (1, 1, 1, 1) / 2
  Tensor zero = Tensor::zeros({3, 2});
  cpu_engine().orthonormalize_columns(zero);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(zero.f32()[i], 0.0f);  // no NaN from a null column
}

// The simulated device runs the same CPU code behind the device checks: each encoding gives the
// host's bytes there.
TEST(CompressionCodec, EncodingsOnTheSimulatedDeviceEqualTheHost) {
  const int64_t n = 1000;
  Rng rng(5);
  Tensor x = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) x.f32()[i] = rng.normal();
  auto on_sim = [](const Tensor& h) {
    Tensor d = Tensor::empty(h.shape(), h.dtype(), Device::sim());
    copy_any(h, d);
    return d;
  };
  Tensor xs = on_sim(x), ph = Tensor::empty({4 + n}, DType::U8), ps = Tensor::empty({4 + n}, DType::U8, Device::sim());
  cpu_engine().qsgd_encode(x, 16, 3, ph);
  engine_for(Device::sim()).qsgd_encode(xs, 16, 3, ps);
  EXPECT_EQ(levels_of(to_host(ps)), levels_of(ph));
  Tensor sh = Tensor::empty({4 + (n + 7) / 8}, DType::U8),
         ss = Tensor::empty({4 + (n + 7) / 8}, DType::U8, Device::sim());
  cpu_engine().sign_encode(x, sh);
  engine_for(Device::sim()).sign_encode(xs, ss);
  EXPECT_EQ(std::memcmp(to_host(ss).raw(), sh.raw(), sh.nbytes()), 0);
  EXPECT_EQ(std::memcmp(to_host(xs).raw(), x.raw(), x.nbytes()), 0);
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

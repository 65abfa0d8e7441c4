// Compressors across real ranks: exact results where the encoding is exact, the error-feedback
// invariant, and SGD on a quadratic driven to its minimum through each compressor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "dtrain/comm/compression.h"
#include "dtrain/comm/runtime.h"

using namespace dtrain;
using namespace dtrain::comm;

namespace {

Communicator& world() { return Runtime::get().world(); }

Tensor filled(int64_t n, const std::function<float(int64_t)>& f) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = f(i);
  return t;
}

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

TEST(Compression, HalfCastsAreExactOnRepresentableValues) {
  Communicator& c = world();
  const int n = c.size();
  if (!power_of_two(n)) GTEST_SKIP() << "averages are exact in fp16 only for power-of-two rank counts";
  for (const char* spec : {"fp16", "bf16"}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      auto comp = make_compressor(spec);
      Tensor g = filled(1000, [&](int64_t i) { return (c.rank() + 1) * (i % 5) * 0.25f; });
      comp->reduce(g, c, op)->wait();
      for (int64_t i = 0; i < 1000; ++i) {
        float sum = (i % 5) * 0.25f * n * (n + 1) / 2;
        ASSERT_EQ(g.f32()[i], op == ReduceOp::Sum ? sum : sum / n) << spec << " " << reduce_op_name(op) << " i=" << i;
      }
      EXPECT_EQ(comp->stats().last_bytes_sent, 2000);
    }
  }
}

TEST(Compression, TopKOfCraftedInputsWithErrorFeedbackAndTies) {
  Communicator& c = world();
  if (c.size() > 4) GTEST_SKIP() << "crafted for at most 4 ranks";
  const int n = c.size();
  TopKCompressor comp(4.0 / 64);  // k = 4 of 64
  // Rank r: four large values at 4r..4r+3, 0.5 elsewhere.
  auto big = [](int r, int64_t i) { return 100.0f + static_cast<float>(i) + 10.0f * r; };
  Tensor g = filled(64, [&](int64_t i) { return i / 4 == c.rank() ? big(c.rank(), i) : 0.5f; });
  comp.reduce(g, c, ReduceOp::Sum)->wait();
  for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(g.f32()[i], i / 4 < n ? big(static_cast<int>(i / 4), i) : 0.0f) << i;
  EXPECT_EQ(comp.stats().last_bytes_sent, 4 * 8);
  Tensor res = comp.residual();
  for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(res.f32()[i], i / 4 == c.rank() ? 0.0f : 0.5f) << i;
  // Step 2, zero gradient: only the residual is left, all ties at 0.5, so indices 0..3 go on
  // every rank except rank 0, whose 0..3 were sent in step 1: it sends 4..7.
  Tensor z = Tensor::zeros({64});
  comp.reduce(z, c, ReduceOp::Avg)->wait();
  for (int64_t i = 0; i < 64; ++i) {
    float want = 0;
    if (i < 4) want = 0.5f * (n - 1) / n;
    if (i >= 4 && i < 8) want = 0.5f / n;
    ASSERT_FLOAT_EQ(z.f32()[i], want) << i;
  }
}

// Momentum correction (DGC), worked by hand with m = 0.5 and k = 1 of 4, the same on every rank:
//   g1 = [1 2 3 4]: u = [1 2 3 4], v = u, sends v[3] = 4; u and v cleared there.
//   g2 = [1 1 1 1]: u = [1.5 2 2.5 1], v = [2.5 4 5.5 1], sends v[2] = 5.5; cleared there.
//   g3 = 0:         u = [0.75 1 0 0.5], v = [3.25 5 0 1.5], sends v[1] = 5.
TEST(Compression, TopKMomentumCorrectionAccumulatesMomentumAndMasksSentCoordinates) {
  Communicator& c = world();
  TopKCompressor comp(0.25, 0.5f);
  const float grads[3][4] = {{1, 2, 3, 4}, {1, 1, 1, 1}, {0, 0, 0, 0}};
  const int sent_index[3] = {3, 2, 1};
  const float sent_value[3] = {4.0f, 5.5f, 5.0f};
  const float residual_after[3][4] = {{1, 2, 3, 0}, {2.5f, 4, 0, 1}, {3.25f, 0, 0, 1.5f}};
  for (int s = 0; s < 3; ++s) {
    Tensor g = filled(4, [&](int64_t i) { return grads[s][i]; });
    comp.reduce(g, c, ReduceOp::Avg)->wait();
    for (int64_t i = 0; i < 4; ++i) {
      ASSERT_FLOAT_EQ(g.f32()[i], i == sent_index[s] ? sent_value[s] : 0.0f) << "step " << s + 1 << " i=" << i;
      ASSERT_FLOAT_EQ(comp.residual().f32()[i], residual_after[s][i]) << "step " << s + 1 << " i=" << i;
    }
  }
  // Without the correction the residual holds raw gradients: step 2 would send 3 + 1 = 4 at index 2.
  TopKCompressor plain(0.25);
  for (int s = 0; s < 2; ++s) {
    Tensor g = filled(4, [&](int64_t i) { return grads[s][i]; });
    plain.reduce(g, c, ReduceOp::Avg)->wait();
    if (s == 1) {
      EXPECT_FLOAT_EQ(g.f32()[2], 4.0f);
    }
  }
  EXPECT_THROW(TopKCompressor(0.25, 1.0f), Error);
}

TEST(Compression, SignIsExactWhenMagnitudesAreEqual) {
  Communicator& c = world();
  const int n = c.size();
  SignCompressor comp;
  float mag = std::ldexp(1.0f, -c.rank());  // 2^-r: the scale mean|x| is exactly mag
  auto sgn = [](int r, int64_t i) { return (i + r) % 3 == 0 ? -1.0f : 1.0f; };
  Tensor g = filled(24, [&](int64_t i) { return mag * sgn(c.rank(), i); });
  comp.reduce(g, c, ReduceOp::Sum)->wait();
  for (int64_t i = 0; i < 24; ++i) {
    float want = 0;
    for (int r = 0; r < n; ++r) want += std::ldexp(1.0f, -r) * sgn(r, i);
    ASSERT_EQ(g.f32()[i], want) << i;
  }
  for (int64_t i = 0; i < 24; ++i) ASSERT_EQ(comp.residual().f32()[i], 0.0f);
  EXPECT_EQ(comp.stats().last_bytes_sent, 4 + 3);  // scale + 24 bits
}

TEST(Compression, QsgdIsExactOnIntegerLevels) {
  Communicator& c = world();
  const int n = c.size();
  QsgdCompressor comp(5);
  float scale = (c.rank() + 1) * 0.25f;
  Tensor g = filled(16, [&](int64_t i) { return i == 0 ? 3 * scale : i == 1 ? -4 * scale : 0.0f; });
  comp.reduce(g, c, ReduceOp::Sum)->wait();
  float tri = n * (n + 1) / 2.0f * 0.25f;
  EXPECT_EQ(g.f32()[0], 3 * tri);
  EXPECT_EQ(g.f32()[1], -4 * tri);
  for (int64_t i = 2; i < 16; ++i) EXPECT_EQ(g.f32()[i], 0.0f);
  EXPECT_EQ(comp.stats().last_bytes_sent, 4 + 16);
}

TEST(Compression, PowerSgdRecoversARankOneGradient) {
  Communicator& c = world();
  PowerSgdCompressor comp(1);
  auto [rows, cols] = PowerSgdCompressor::matrix_shape(64);
  ASSERT_EQ(rows * cols, 64);
  auto x = [cols = cols](int64_t e) { return (e / cols + 1) * ((e % cols) % 3 - 1 + 0.5f); };
  Tensor g = filled(64, x);
  comp.reduce(g, c, ReduceOp::Avg)->wait();
  for (int64_t e = 0; e < 64; ++e) EXPECT_NEAR(g.f32()[e], x(e), 1e-4f * 12) << e;
  EXPECT_EQ(comp.stats().last_bytes_sent, (rows + cols) * 1 * 4);
}

// Over steps: sum of results + mean residual == sum of mean gradients (for op Avg).
class ErrorFeedback : public ::testing::TestWithParam<const char*> {};

TEST_P(ErrorFeedback, TransmittedPlusResidualEqualsTheTrueSum) {
  Communicator& c = world();
  auto comp = make_compressor(GetParam());
  ASSERT_TRUE(comp->has_error_feedback());
  const int64_t n = 300;
  Tensor sent = Tensor::zeros({n}), truth = Tensor::zeros({n});
  for (int t = 0; t < 6; ++t) {
    Rng rng(derive_seed(42, static_cast<uint64_t>(c.rank() * 100 + t)));
    Tensor g = filled(n, [&](int64_t) { return rng.normal(); });
    Tensor mean = g.clone();
    c.allreduce(mean, ReduceOp::Avg)->wait();
    comp->reduce(g, c, ReduceOp::Avg)->wait();
    for (int64_t i = 0; i < n; ++i) {
      sent.f32()[i] += g.f32()[i];
      truth.f32()[i] += mean.f32()[i];
    }
  }
  Tensor res = comp->residual().clone();
  c.allreduce(res, ReduceOp::Avg)->wait();
  double worst = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::fabs(double(sent.f32()[i]) + res.f32()[i] - truth.f32()[i]));
    scale = std::max(scale, std::fabs(double(truth.f32()[i])));
  }
  EXPECT_LT(worst, 1e-5 * scale * 10) << GetParam();
  // And the residual is not trivially zero: the compressor did drop something.
  double res_norm = 0;
  for (int64_t i = 0; i < n; ++i) res_norm += std::fabs(comp->residual().f32()[i]);
  EXPECT_GT(res_norm, 1e-3) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Compressors, ErrorFeedback, ::testing::Values("topk:0.1", "sign", "powersgd:2"),
                         [](const auto& info) {
                           std::string s = info.param;
                           return s.substr(0, s.find(':'));
                         });

// Rank r minimises f_r(x) = 1/2 sum_j a_rj (x_j - c_j)^2: the curvature differs per rank, the
// minimum x* = c is shared, so every rank's gradient vanishes there and a compressor whose error
// shrinks with the gradient (or is fed back) must get SGD to x*, the same x on every rank.
class QuadraticSgd : public ::testing::TestWithParam<const char*> {};

TEST_P(QuadraticSgd, ReachesTheMinimum) {
  Communicator& c = world();
  auto comp = make_compressor(GetParam(), 1234);
  const int64_t n = 200;
  auto a = [](int r, int64_t j) { return 0.5f + static_cast<float>((j + 3 * r) % 10) / 10; };
  std::vector<float> x(n, 0.0f), xstar(n);
  for (int64_t j = 0; j < n; ++j) xstar[static_cast<size_t>(j)] = std::sin(static_cast<float>(j));
  const float lr = 0.3f;
  // The scaled sign moves small coordinates slowly (one scale for the whole bucket).
  const int steps = std::string(GetParam()) == "sign" ? 1500 : 600;
  double err = 0;
  for (int s = 0; s < steps; ++s) {
    Tensor g = filled(
        n, [&](int64_t j) { return a(c.rank(), j) * (x[static_cast<size_t>(j)] - xstar[static_cast<size_t>(j)]); });
    comp->reduce(g, c, ReduceOp::Avg)->wait();
    for (int64_t j = 0; j < n; ++j) x[static_cast<size_t>(j)] -= lr * g.f32()[j];
  }
  for (int64_t j = 0; j < n; ++j)
    err = std::max(err, static_cast<double>(std::fabs(x[static_cast<size_t>(j)] - xstar[static_cast<size_t>(j)])));
  EXPECT_LT(err, 1e-4) << GetParam() << " after " << steps << " steps";
  if (c.rank() == 0) std::printf("%s: max |x - x*| = %.3g after %d steps\n", GetParam(), err, steps);
  // Every rank holds the same parameters, bit for bit.
  Tensor mine = filled(n, [&](int64_t j) { return x[static_cast<size_t>(j)]; });
  Tensor r0 = mine.clone();
  c.broadcast(r0, 0)->wait();
  EXPECT_EQ(std::memcmp(mine.raw(), r0.raw(), mine.nbytes()), 0) << GetParam() << ": ranks diverged";
}

INSTANTIATE_TEST_SUITE_P(Compressors, QuadraticSgd,
                         ::testing::Values("none", "fp16", "bf16", "topk:0.1", "powersgd:2", "sign", "qsgd:16"),
                         [](const auto& info) {
                           std::string s = info.param;
                           return s.substr(0, s.find(':'));
                         });

}  // namespace

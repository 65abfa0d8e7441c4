// GemmRecording: the CPU engine notes each GEMM it runs on the recording's thread once, with the
// entry point, batch, shape and transposes it was called with.
#include <gtest/gtest.h>

#include <thread>

#include "dtrain/kernels/engine.h"
#include "dtrain/kernels/gemm_record.h"

using namespace dtrain;

namespace {

void expect_call(const GemmCall& c, bool batched, int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  EXPECT_EQ(c.batched, batched);
  EXPECT_EQ(c.batch, batch);
  EXPECT_EQ(c.ta, ta);
  EXPECT_EQ(c.tb, tb);
  EXPECT_EQ(c.m, m);
  EXPECT_EQ(c.n, n);
  EXPECT_EQ(c.k, k);
  EXPECT_GE(c.seconds, 0.0);
  EXPECT_DOUBLE_EQ(c.flop(), 2.0 * batch * m * n * k);
}

}  // namespace

TEST(GemmRecording, NotesEachCallOnceWithItsShape) {
  Engine& e = cpu_engine();
  Tensor a = Tensor::zeros({3 * 24 * 40}), b = Tensor::zeros({3 * 40 * 16}), c = Tensor::zeros({3 * 24 * 16});
  e.gemm(false, true, 24, 16, 40, 1.f, a, b, 0.f, c);  // before any recording: not noted anywhere
  GemmRecording rec;
  e.gemm(false, true, 24, 16, 40, 1.f, a, b, 0.f, c);
  e.gemm(true, false, 40, 16, 24, 1.f, a, b, 0.f, c);
  e.gemm_batched(3, false, false, 24, 16, 40, 1.f, a, 24 * 40, b, 40 * 16, 0.f, c, 24 * 16);
  // Under bf16 math gemm() hands the call to gemm_batched: still one call, noted where it ran.
  e.set_math_precision(MathPrecision::BF16);
  e.gemm(false, false, 24, 16, 40, 1.f, a, b, 0.f, c);
  e.set_math_precision(MathPrecision::F32);
  // Another thread's GEMMs belong to that thread's recording (it has none).
  std::thread([&] { e.gemm(false, false, 8, 8, 8, 1.f, a, b, 0.f, c); }).join();
  ASSERT_EQ(rec.calls().size(), 4u);
  expect_call(rec.calls()[0], false, 1, false, true, 24, 16, 40);
  expect_call(rec.calls()[1], false, 1, true, false, 40, 16, 24);
  expect_call(rec.calls()[2], true, 3, false, false, 24, 16, 40);
  expect_call(rec.calls()[3], true, 1, false, false, 24, 16, 40);
  EXPECT_TRUE(rec.calls()[0].same_shape(rec.calls()[0]));
  EXPECT_FALSE(rec.calls()[0].same_shape(rec.calls()[1]));
  EXPECT_FALSE(rec.calls()[2].same_shape(rec.calls()[3]));
}

TEST(GemmRecording, OneAtATimeOnAThread) {
  {
    GemmRecording rec;
    EXPECT_THROW(GemmRecording second, Error);
  }
  GemmRecording again;  // the first one has ended
  EXPECT_TRUE(again.calls().empty());
}

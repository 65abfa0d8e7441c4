#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "dtrain/optim/loss_scaler.h"

using namespace dtrain;

namespace {
struct OneParam {
  nn::Parameter p{"w", Tensor::full({4}, 1.f), Tensor::zeros({4})};
  void set_grad(float v) { p.grad.fill_(v); }
};
}  // namespace

TEST(LossScaler, UnscalesFiniteGradientsAndSteps) {
  OneParam w;
  optim::SGD opt({&w.p}, {});
  optim::LossScaler s({.init_scale = 1024.f, .growth_interval = 3});
  w.set_grad(2048.f);  // a true gradient of 2, scaled by 1024
  EXPECT_TRUE(s.step(opt, 0.5f));
  EXPECT_FLOAT_EQ(w.p.grad.f32()[0], 2.f);
  EXPECT_FLOAT_EQ(w.p.value.f32()[0], 1.f - 0.5f * 2.f);
  EXPECT_EQ(s.skipped_steps(), 0);
  EXPECT_EQ(s.good_steps(), 1);
  EXPECT_FLOAT_EQ(s.scale(), 1024.f);
}

TEST(LossScaler, SkipsAndBacksOffOnInfOrNan) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    OneParam w;
    optim::SGD opt({&w.p}, {});
    optim::LossScaler s({.init_scale = 1024.f, .backoff_factor = 0.25f});
    w.set_grad(1.f);
    w.p.grad.f32()[2] = bad;
    EXPECT_FALSE(s.step(opt, 0.5f));
    EXPECT_FLOAT_EQ(w.p.value.f32()[0], 1.f) << "a skipped step must leave the weights alone";
    EXPECT_EQ(opt.steps(), 0);
    EXPECT_EQ(s.skipped_steps(), 1);
    EXPECT_FLOAT_EQ(s.scale(), 256.f);
  }
}

TEST(LossScaler, GrowsAfterIntervalAndRespectsBounds) {
  optim::LossScaler s({.init_scale = 4.f,
                       .growth_factor = 2.f,
                       .backoff_factor = 0.5f,
                       .growth_interval = 2,
                       .min_scale = 2.f,
                       .max_scale = 16.f});
  s.update(true);
  EXPECT_FLOAT_EQ(s.scale(), 4.f);
  s.update(true);
  EXPECT_FLOAT_EQ(s.scale(), 8.f);  // 2 good steps in a row
  s.update(true);
  s.update(false);  // an overflow resets the count
  EXPECT_FLOAT_EQ(s.scale(), 4.f);
  s.update(true);
  EXPECT_FLOAT_EQ(s.scale(), 4.f);
  for (int i = 0; i < 10; ++i) s.update(true);
  EXPECT_FLOAT_EQ(s.scale(), 16.f);  // max_scale
  for (int i = 0; i < 10; ++i) s.update(false);
  EXPECT_FLOAT_EQ(s.scale(), 2.f);  // min_scale
  EXPECT_EQ(s.skipped_steps(), 11);
}

TEST(LossScaler, StateRoundTrip) {
  optim::LossScaler a({.growth_interval = 3});
  a.update(false);
  a.update(true);
  optim::LossScaler b({.growth_interval = 3});
  b.set_state(a.scale(), a.good_steps(), a.skipped_steps());
  a.update(true);
  a.update(true);
  b.update(true);
  b.update(true);
  EXPECT_FLOAT_EQ(a.scale(), b.scale());
  EXPECT_EQ(a.skipped_steps(), b.skipped_steps());
}

TEST(LossScaler, RejectsBadOptions) {
  EXPECT_THROW(optim::LossScaler({.growth_factor = 1.f}), InputError);
  EXPECT_THROW(optim::LossScaler({.backoff_factor = 1.5f}), InputError);
  EXPECT_THROW(optim::LossScaler({.growth_interval = 0}), InputError);
}

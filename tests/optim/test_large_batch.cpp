#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/optim/large_batch.h"

using namespace dtrain;

TEST(Lars, TrustRatioWorkedByHand) {
  // w = (3, 4) (norm 5), g = (0, 1) (norm 1), eta 0.1, no decay: local lr = 0.1 * 5 / 1 = 0.5.
  nn::Parameter p{"w", Tensor::from({1, 2}, {3.f, 4.f}), Tensor::from({1, 2}, {0.f, 1.f})};
  optim::LARS opt({&p}, {.momentum = 0.f, .weight_decay = 0.f, .eta = 0.1f});
  opt.step(0.2f);  // w -= 0.2 * 0.5 * g
  EXPECT_NEAR(p.value.f32()[0], 3.f, 1e-6);
  EXPECT_NEAR(p.value.f32()[1], 4.f - 0.1f, 1e-6);
  // A bias (1-D) takes the plain step.
  nn::Parameter b{"b", Tensor::from({2}, {3.f, 4.f}), Tensor::from({2}, {0.f, 1.f})};
  optim::LARS opt_b({&b}, {.momentum = 0.f, .weight_decay = 0.f, .eta = 0.1f});
  opt_b.step(0.2f);
  EXPECT_NEAR(b.value.f32()[1], 4.f - 0.2f, 1e-6);
}

TEST(Lamb, FirstStepWorkedByHand) {
  // Step 1: m_hat = g, v_hat = g^2, so the Adam direction is sign(g) (eps tiny);
  // r = sign(g) + wd * w; trust = ||w|| / ||r||; w -= lr * trust * r.
  nn::Parameter p{"w", Tensor::from({1, 2}, {3.f, 4.f}), Tensor::from({1, 2}, {2.f, -0.5f})};
  optim::LAMB opt({&p}, {.eps = 1e-12f, .weight_decay = 0.1f});
  double r0 = 1 + 0.1 * 3, r1 = -1 + 0.1 * 4;
  double trust = 5.0 / std::sqrt(r0 * r0 + r1 * r1);
  opt.step(0.01f);
  EXPECT_NEAR(p.value.f32()[0], 3 - 0.01 * trust * r0, 1e-5);
  EXPECT_NEAR(p.value.f32()[1], 4 - 0.01 * trust * r1, 1e-5);
  EXPECT_EQ(opt.state().size(), 2u);
}

TEST(LargeBatch, BothDriveAQuadraticDown) {
  for (int which = 0; which < 2; ++which) {
    nn::Parameter p{"w", Tensor::from({2, 2}, {2.f, -1.f, 0.5f, 3.f}), Tensor::zeros({2, 2})};
    std::unique_ptr<optim::Optimizer> opt;
    if (which == 0) opt = std::make_unique<optim::LARS>(std::vector<nn::Parameter*>{&p}, optim::LarsOptions{0.9f, 0.f, 0.1f});
    else opt = std::make_unique<optim::LAMB>(std::vector<nn::Parameter*>{&p}, optim::LambOptions{});
    auto loss = [&] {
      double s = 0;
      for (int i = 0; i < 4; ++i) s += 0.5 * p.value.f32()[i] * p.value.f32()[i];
      return s;
    };
    double before = loss();
    for (int it = 0; it < 100; ++it) {
      for (int i = 0; i < 4; ++i) p.grad.f32()[i] = p.value.f32()[i];  // grad of 0.5 w^2
      opt->step(0.05f);
    }
    EXPECT_LT(loss(), 0.05 * before) << opt->kind();
  }
}

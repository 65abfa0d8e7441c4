#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/optim/optimizer.h"
#include "dtrain/optim/schedule.h"

using namespace dtrain;

namespace {
// One scalar parameter with a settable gradient.
struct Scalar {
  nn::Parameter p{"w", Tensor::full({1}, 1.f), Tensor::zeros({1})};
  float& w() { return p.value.f32()[0]; }
  float& g() { return p.grad.f32()[0]; }
};
}  // namespace

TEST(Sgd, PlainStep) {
  Scalar s;
  optim::SGD opt({&s.p}, {});
  s.g() = 2.f;
  opt.step(0.1f);
  EXPECT_FLOAT_EQ(s.w(), 1.f - 0.2f);
}

TEST(Sgd, MomentumWorkedByHand) {
  // PyTorch: buf1 = g1; buf2 = 0.9*buf1 + g2; w -= lr*buf.
  Scalar s;
  optim::SGD opt({&s.p}, {.momentum = 0.9f});
  s.g() = 1.f;
  opt.step(0.1f);  // buf = 1, w = 0.9
  s.g() = 0.5f;
  opt.step(0.1f);  // buf = 0.9 + 0.5 = 1.4, w = 0.9 - 0.14 = 0.76
  EXPECT_NEAR(s.w(), 0.76f, 1e-6);
}

TEST(Sgd, NesterovAndWeightDecayWorkedByHand) {
  Scalar s;
  optim::SGD opt({&s.p}, {.momentum = 0.5f, .weight_decay = 0.1f, .nesterov = true});
  s.g() = 1.f;
  // g = 1 + 0.1*1 = 1.1; buf = 1.1; step = 1.1 + 0.5*1.1 = 1.65; w = 1 - 0.1*1.65 = 0.835
  opt.step(0.1f);
  EXPECT_NEAR(s.w(), 0.835f, 1e-6);
  // g = 1 + 0.1*0.835 = 1.0835; buf = 0.55 + 1.0835 = 1.6335; step = 1.0835 + 0.81675 = 1.90025
  opt.step(0.1f);
  EXPECT_NEAR(s.w(), 0.835f - 0.190025f, 1e-6);
  EXPECT_THROW(optim::SGD({&s.p}, {.momentum = 0.f, .nesterov = true}), InputError);
}

TEST(Adam, FirstStepsWorkedByHand) {
  // Step 1: m = 0.1 g, v = 0.001 g^2, mhat = g, vhat = g^2, w -= lr * g/(|g|+eps) = lr*sign(g).
  Scalar s;
  optim::Adam opt({&s.p}, {});
  s.g() = 3.f;
  opt.step(0.01f);
  EXPECT_NEAR(s.w(), 0.99f, 1e-6);
  // Step 2 with g = 1: m = 0.09*3*... computed directly.
  s.g() = 1.f;
  double m = 0.9 * 0.3 + 0.1 * 1, v = 0.999 * 0.009 + 0.001 * 1;
  double mhat = m / (1 - 0.81), vhat = v / (1 - 0.998001);
  double expect = 0.99 - 0.01 * mhat / (std::sqrt(vhat) + 1e-8);
  opt.step(0.01f);
  EXPECT_NEAR(s.w(), expect, 1e-6);
}

TEST(Adam, AdamWDecouplesWeightDecay) {
  Scalar a, b;
  optim::Adam adamw({&a.p}, {.weight_decay = 0.5f, .decoupled = true});
  optim::Adam adam({&b.p}, {.weight_decay = 0.5f, .decoupled = false});
  a.g() = b.g() = 2.f;
  adamw.step(0.1f);  // w = 1 - 0.1*0.5*1 = 0.95, then - 0.1*sign = 0.85
  adam.step(0.1f);   // g = 2.5, then w = 1 - 0.1 = 0.9
  EXPECT_NEAR(a.w(), 0.85f, 1e-6);
  EXPECT_NEAR(b.w(), 0.9f, 1e-6);
}

TEST(Adam, ParameterGroupsDecayEachByItsOwn) {
  // One AdamW over two groups equals one AdamW per group: the matrix decays, the bias does not.
  nn::Parameter w{"fc.weight", Tensor::full({2, 2}, 1.f), Tensor::full({2, 2}, 2.f)};
  nn::Parameter b{"fc.bias", Tensor::full({2}, 1.f), Tensor::full({2}, 2.f)};
  nn::Parameter pos{"wpe", Tensor::full({2, 2}, 1.f), Tensor::full({2, 2}, 2.f)};
  std::vector<optim::ParamGroup> groups = optim::decay_groups({&w, &b, &pos}, 0.5f, {"wpe"});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].params, std::vector<nn::Parameter*>{&w});
  EXPECT_FLOAT_EQ(groups[0].weight_decay, 0.5f);
  EXPECT_EQ(groups[1].params, (std::vector<nn::Parameter*>{&b, &pos}));
  EXPECT_FLOAT_EQ(groups[1].weight_decay, 0.f);
  optim::Adam grouped(groups, {.decoupled = true});
  EXPECT_EQ(grouped.params(), (std::vector<nn::Parameter*>{&w, &b, &pos}));
  grouped.step(0.1f);  // decayed: 1 - 0.1*0.5*1 - 0.1*sign(2) = 0.85; not decayed: 0.9
  EXPECT_NEAR(w.value.f32()[3], 0.85f, 1e-6);
  EXPECT_NEAR(b.value.f32()[1], 0.9f, 1e-6);
  EXPECT_NEAR(pos.value.f32()[0], 0.9f, 1e-6);
  EXPECT_EQ(grouped.state().size(), 6u);  // exp_avg and exp_avg_sq of each parameter, by name
  EXPECT_EQ(grouped.state()[0].name, "fc.weight.exp_avg");
}

TEST(Clip, GlobalNormScalesEverything) {
  nn::Parameter p{"a", Tensor::zeros({2}), Tensor::from({2}, {3.f, 0.f})};
  nn::Parameter q{"b", Tensor::zeros({1}), Tensor::from({1}, {4.f})};
  double n = optim::clip_grad_norm({&p, &q}, 1.0);
  EXPECT_NEAR(n, 5.0, 1e-9);
  EXPECT_NEAR(p.grad.f32()[0], 0.6f, 1e-5);
  EXPECT_NEAR(q.grad.f32()[0], 0.8f, 1e-5);
  EXPECT_NEAR(optim::clip_grad_norm({&p, &q}, 10.0), 1.0, 1e-5);  // below the limit: unchanged
  EXPECT_NEAR(q.grad.f32()[0], 0.8f, 1e-5);
}

TEST(Schedule, CosineStepConstantAndWarmup) {
  optim::LrSchedule cosine({.kind = "cosine", .base_lr = 0.1f, .total_steps = 100});
  EXPECT_FLOAT_EQ(cosine.lr(0), 0.1f);
  EXPECT_NEAR(cosine.lr(50), 0.05f, 1e-7);
  EXPECT_NEAR(cosine.lr(100), 0.f, 1e-7);
  optim::LrSchedule step({.kind = "step", .base_lr = 1.f, .step_size = 10, .gamma = 0.5f});
  EXPECT_FLOAT_EQ(step.lr(9), 1.f);
  EXPECT_FLOAT_EQ(step.lr(10), 0.5f);
  EXPECT_FLOAT_EQ(step.lr(25), 0.25f);
  optim::LrSchedule warm({.kind = "constant", .base_lr = 0.4f, .warmup_steps = 4});
  EXPECT_FLOAT_EQ(warm.lr(0), 0.1f);
  EXPECT_FLOAT_EQ(warm.lr(3), 0.4f);
  EXPECT_FLOAT_EQ(warm.lr(100), 0.4f);
  EXPECT_THROW(optim::LrSchedule({.kind = "linear-ish"}), InputError);
}

TEST(Sgd, DrivesAQuadraticToItsMinimum) {
  // f(w) = 0.5 * sum (w - c)^2, grad = w - c.
  nn::Parameter p{"w", Tensor::zeros({3}), Tensor::zeros({3})};
  float c[3] = {1.f, -2.f, 0.5f};
  optim::SGD opt({&p}, {.momentum = 0.9f, .nesterov = true});
  for (int i = 0; i < 200; ++i) {
    for (int j = 0; j < 3; ++j) p.grad.f32()[j] = p.value.f32()[j] - c[j];
    opt.step(0.05f);
  }
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(p.value.f32()[j], c[j], 1e-4);
}

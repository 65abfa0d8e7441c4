// The soft-target term of knowledge distillation: its value against a hand computation and its
// gradient against finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/nn/layers.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::random_tensor;

TEST(SoftTargetLoss, IsTheScaledKlDivergence) {
  // One row, T = 2: teacher logits (2 ln 3, 0) give soft targets (3/4, 1/4); a student at (0, 0)
  // gives (1/2, 1/2). KL = 3/4 ln(3/2) + 1/4 ln(1/2), times T^2 = 4.
  nn::SoftTargetLoss loss(2.f);
  Tensor student = Tensor::from({1, 2}, {0.f, 0.f});
  Tensor teacher = Tensor::from({1, 2}, {static_cast<float>(2 * std::log(3.0)), 0.f});
  const double kl = 0.75 * std::log(1.5) + 0.25 * std::log(0.5);
  EXPECT_NEAR(loss.forward(student, teacher), 4 * kl, 1e-6);
  EXPECT_NEAR(loss.forward(teacher, teacher), 0.0, 1e-7) << "a student equal to its teacher has no loss";
}

TEST(SoftTargetLoss, GradientMatchesFiniteDifferences) {
  Rng rng(11);
  for (float t : {1.f, 4.f}) {
    nn::SoftTargetLoss loss(t);
    Tensor student = random_tensor({5, 7}, rng, 2.f), teacher = random_tensor({5, 7}, rng, 2.f);
    loss.forward(student, teacher);
    Tensor grad = loss.backward(0.5f).clone();
    const float eps = 1e-2f;
    for (int64_t i = 0; i < student.numel(); ++i) {
      const float keep = student.f32()[i];
      student.f32()[i] = keep + eps;
      const double up = loss.forward(student, teacher);
      student.f32()[i] = keep - eps;
      const double down = loss.forward(student, teacher);
      student.f32()[i] = keep;
      EXPECT_NEAR(grad.f32()[i], 0.5 * (up - down) / (2 * eps), 2e-3) << "T " << t << " element " << i;
    }
  }
}

TEST(SoftTargetLoss, RefusesABadTemperatureAndMismatchedLogits) {
  EXPECT_THROW(nn::SoftTargetLoss(0.f), InputError);
  nn::SoftTargetLoss loss;
  EXPECT_THROW(loss.forward(Tensor::zeros({2, 3}), Tensor::zeros({2, 4})), Error);
}

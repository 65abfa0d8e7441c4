#pragma once
// Finite-difference gradient checks: L = sum(forward(x) * r) for a fixed random r, so dL/dy = r.
#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/nn/layers.h"

namespace dtrain::test {

inline Tensor random_tensor(const Shape& s, Rng& rng, float scale = 1.f) {
  Tensor t = Tensor::empty(s);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = scale * rng.normal();
  return t;
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.f32()[i]) * b.f32()[i];
  return s;
}

// Checks dL/dx and dL/dparam for up to `samples` coordinates each; central differences in float32,
// so the tolerance is relative to the gradient's scale.
inline void gradcheck(nn::Module& m, Tensor x, uint64_t seed = 7, float eps = 1e-2f, double tol = 2e-2,
                      int samples = 24) {
  Rng rng(seed);
  Tensor y0 = m.forward(x);
  Tensor r = random_tensor(y0.shape(), rng);
  auto loss = [&]() { return dot(m.forward(x), r); };
  for (nn::Parameter* p : m.parameters()) p->grad.zero_();
  m.forward(x);
  Tensor dx = m.backward(r).clone();
  auto check = [&](Tensor& t, const Tensor& analytic, const std::string& what) {
    double scale = 1e-3;
    for (int64_t i = 0; i < analytic.numel(); ++i) scale = std::max(scale, std::abs((double)analytic.f32()[i]));
    for (int s = 0; s < samples; ++s) {
      int64_t i = static_cast<int64_t>(rng.below(static_cast<uint64_t>(t.numel())));
      float keep = t.f32()[i];
      t.f32()[i] = keep + eps;
      double up = loss();
      t.f32()[i] = keep - eps;
      double down = loss();
      t.f32()[i] = keep;
      double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(numeric, analytic.f32()[i], tol * scale) << what << " at flat index " << i;
    }
  };
  check(x, dx, m.kind() + " input");
  for (nn::Parameter* p : m.parameters()) check(p->value, p->grad, m.kind() + " " + p->name);
}

}  // namespace dtrain::test

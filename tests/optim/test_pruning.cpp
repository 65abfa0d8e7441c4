// Magnitude pruning: the cubic schedule, exactly the asked-for count of zeros (global, per layer,
// whole rows with their biases), zeros that stay zero through updates, and masks that load back.
#include <gtest/gtest.h>

#include "dtrain/optim/pruning.h"

using namespace dtrain;

namespace {

nn::Parameter param(const std::string& name, const Shape& shape, float first) {
  nn::Parameter p;
  p.name = name;
  p.value = Tensor::empty(shape);
  for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] = (i % 2 ? -1.f : 1.f) * (first + static_cast<float>(i));
  p.grad = Tensor::zeros(shape);
  return p;
}

int64_t zeros(const Tensor& t) {
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += t.f32()[i] == 0.f;
  return n;
}

}  // namespace

TEST(Pruning, CubicRampFromStartToEnd) {
  nn::Parameter w = param("w", {4, 4}, 1);
  optim::MagnitudePruner p({&w}, {}, {0.8f, 10, 20, 5, false, true});
  EXPECT_EQ(p.target(0), 0.f);
  EXPECT_EQ(p.target(9), 0.f);
  EXPECT_FLOAT_EQ(p.target(15), 0.8f * (1.f - 0.125f));  // half way: 1 - (1/2)^3 of the way
  EXPECT_FLOAT_EQ(p.target(20), 0.8f);
  EXPECT_FLOAT_EQ(p.target(1000), 0.8f);
}

TEST(Pruning, GlobalThresholdPrunesTheSmallestMagnitudesOfAllLayers) {
  nn::Parameter a = param("a", {2, 5}, 1), b = param("b", {2, 5}, 100);  // every |a| below every |b|
  optim::MagnitudePruner p({&a, &b}, {}, {0.5f, 0, 0, 1, false, true});
  p.after_step(1);
  EXPECT_EQ(zeros(a.value), 10) << "the 10 smallest of 20 are all a's";
  EXPECT_EQ(zeros(b.value), 0);
  EXPECT_DOUBLE_EQ(p.sparsity(), 0.5);
}

TEST(Pruning, PerLayerScopePrunesEachLayerAlike) {
  nn::Parameter a = param("a", {2, 5}, 1), b = param("b", {2, 5}, 100);
  optim::MagnitudePruner p({&a, &b}, {}, {0.5f, 0, 0, 1, false, false});
  p.after_step(1);
  EXPECT_EQ(zeros(a.value), 5);
  EXPECT_EQ(zeros(b.value), 5);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(a.value.f32()[i], 0.f) << "the smallest magnitudes go: " << i;
}

TEST(Pruning, StructuredPrunesWholeRowsWithTheirBias) {
  nn::Parameter w = param("l.weight", {4, 3, 2}, 1), bias = param("l.bias", {4}, 1);  // row norms grow with the row
  optim::MagnitudePruner p({&w}, {&bias}, {0.5f, 0, 0, 1, true, true});
  p.after_step(1);
  for (int64_t r = 0; r < 4; ++r) {
    int64_t z = 0;
    for (int64_t j = 0; j < 6; ++j) z += w.value.f32()[r * 6 + j] == 0.f;
    EXPECT_EQ(z, r < 2 ? 6 : 0) << "row " << r;
    EXPECT_EQ(bias.value.f32()[r] == 0.f, r < 2) << "bias " << r;
  }
}

TEST(Pruning, PrunedWeightsStayZeroAndMasksLoadBack) {
  nn::Parameter w = param("w", {8, 8}, 1);
  optim::MagnitudePruner p({&w}, {}, {0.75f, 0, 0, 1, false, true});
  p.after_step(1);
  for (int64_t i = 0; i < w.value.numel(); ++i) w.value.f32()[i] += 0.5f;  // an update moves every weight
  p.after_step(2);  // after the ramp the masks stay; applying them zeroes the pruned weights again
  EXPECT_EQ(zeros(w.value), 48);
  nn::Parameter v = param("w", {8, 8}, 1);
  optim::MagnitudePruner q({&v}, {}, {0.75f, 0, 0, 1, false, true});
  q.load_masks(p.masks());
  q.apply();
  for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(v.value.f32()[i] == 0.f, w.value.f32()[i] == 0.f) << i;
  EXPECT_THROW(q.load_masks({{"w", Tensor::zeros({3})}}), InputError);
  EXPECT_THROW(q.load_masks({{"w", Tensor::zeros({8, 8}, DType::BF16)}}), InputError);  // a checkpoint's dtype
  EXPECT_THROW(optim::MagnitudePruner({&v}, {}, {1.f, 0, 0, 1, false, true}), InputError);
}

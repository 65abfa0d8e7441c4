// Post-training int8 quantization of the image models (include/dtrain/nn/quantized.h): what is
// refused, calibration's determinism, and the int8 forward against the fp32 model it came from.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "dtrain/nn/models.h"
#include "dtrain/nn/quantized.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::random_tensor;

namespace {

std::unique_ptr<nn::Sequential> model(const std::string& name, uint64_t seed = 1) {
  nn::ModelSpec s;
  s.name = name;
  s.input = {1, 28, 28};
  s.seed = seed;
  return nn::make_sequential_model(s);
}

std::vector<Tensor> batches(int count, uint64_t seed) {
  Rng rng(seed);
  std::vector<Tensor> b;
  for (int i = 0; i < count; ++i) b.push_back(random_tensor({16, 1, 28, 28}, rng));
  return b;
}

void expect_refused(nn::Sequential& m, const Shape& input, const std::string& what) {
  Shape batch{4};
  batch.insert(batch.end(), input.begin(), input.end());
  Rng rng(1);
  const nn::Int8Ranges ranges = nn::calibrate_ranges(m, {random_tensor(batch, rng)});
  try {
    nn::quantize_model(m, input, ranges);
    FAIL() << "quantized, though " << what << " is not supported";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(what + " is not supported"), std::string::npos) << e.what();
  }
}

TEST(QuantizeModel, NamesTheFirstUnsupportedLayer) {
  Rng rng(1);
  nn::Sequential bn_after_relu;  // a BatchNorm2d folds only into the Conv2d right before it
  bn_after_relu.add(std::make_unique<nn::Conv2d>(1, 4, 3, 1, 1, true, rng));
  bn_after_relu.add(nn::ReLU());
  bn_after_relu.add(std::make_unique<nn::BatchNorm2d>(4));
  bn_after_relu.add(std::make_unique<nn::Flatten>());
  bn_after_relu.add(std::make_unique<nn::Linear>(4 * 8 * 8, 3, true, rng));
  expect_refused(bn_after_relu, {1, 8, 8}, "layer 2 (BatchNorm2d(4))");
  nn::Sequential gap_last;  // a global average pool runs only as the input of a Linear
  gap_last.add(std::make_unique<nn::Conv2d>(1, 4, 3, 1, 1, true, rng));
  gap_last.add(std::make_unique<nn::GlobalAvgPool>());
  expect_refused(gap_last, {1, 8, 8}, "layer 1 (GlobalAvgPool)");
}

TEST(QuantizeModel, RefusesAReluThatNoConvolutionPrecedes) {
  nn::Sequential m;
  Rng rng(1);
  m.add(std::make_unique<nn::Flatten>());
  m.add(nn::ReLU());
  m.add(std::make_unique<nn::Linear>(784, 10, true, rng));
  expect_refused(m, {1, 28, 28}, "layer 1 (ReLU)");
}

TEST(QuantizeModel, CalibrationIsBitwiseReproducibleAndOrderFree) {
  auto m = model("simple_cnn");
  std::vector<Tensor> b = batches(3, 5);
  const nn::Int8Ranges r1 = nn::calibrate_ranges(*m, b);
  std::vector<Tensor> reversed(b.rbegin(), b.rend());
  const nn::Int8Ranges r2 = nn::calibrate_ranges(*m, reversed);
  ASSERT_EQ(r1.size(), m->size() + 1);  // every layer's output and the input
  EXPECT_EQ(r1, r2);
  for (const auto& [path, r] : r1) EXPECT_GT(r, 0.f) << path;
  const nn::Int8Spec s1 = nn::quantize_model(*m, {1, 28, 28}, r1), s2 = nn::quantize_model(*m, {1, 28, 28}, r2);
  ASSERT_EQ(s1.layers.size(), 5u);  // conv+relu, pool, conv+relu, pool, linear
  for (size_t i = 0; i < s1.layers.size(); ++i) {
    EXPECT_EQ(s1.layers[i].weights, s2.layers[i].weights);
    EXPECT_EQ(s1.layers[i].weight_scales, s2.layers[i].weight_scales);
    EXPECT_EQ(s1.layers[i].out_range, s2.layers[i].out_range);
    EXPECT_EQ(s1.layers[i].src, static_cast<int>(i % 2)) << "a chain alternates between two buffers";
  }
  EXPECT_TRUE(s1.layers[0].relu && s1.layers[2].relu && !s1.layers[4].relu);
}

// ResNet-20: BatchNorm folded (22 convolutions: the stem, two per block, two projections, the
// classifier over the average pool), each block's second convolution adding its shortcut in the
// shortcut's buffer, three buffers at most.
TEST(QuantizeModel, ResNet20FoldsBatchNormAndAddsEachShortcut) {
  auto m = model("resnet20");
  const nn::Int8Spec s = nn::quantize_model(*m, {1, 28, 28}, nn::calibrate_ranges(*m, batches(1, 3)));
  ASSERT_EQ(s.layers.size(), 22u);
  int residual = 0, most = 0;
  for (const nn::Int8Layer& l : s.layers) {
    EXPECT_EQ(l.kind, nn::Int8Layer::Kind::Conv) << l.name;
    residual += l.residual;
    most = std::max({most, l.src, l.dst});
    if (l.residual) {
      EXPECT_TRUE(l.relu) << l.name << ": the ReLU after the block is fused";
    }
  }
  EXPECT_EQ(residual, 9);
  EXPECT_LE(most, 2);
  const nn::Int8Layer& head = s.layers.back();  // Linear(64, 10) over the 7x7 average
  EXPECT_EQ(head.conv.r, 7);
  EXPECT_EQ(head.conv.c, 64);
  EXPECT_EQ(head.name, "layer 13 (Linear(64, 10))");
}

// The int8 logits of a model against its fp32 logits on calibrated data: errors of a few
// quantization steps, and (almost) the same predicted classes.
void expect_close_to_fp32(const std::string& name) {
  auto m = model(name, 7);
  std::vector<Tensor> b = batches(4, 11);
  for (int i = 0; i < 20; ++i) m->forward(b[i % 4]);  // BatchNorm statistics of the data, as after training
  nn::Int8Model q(nn::quantize_model(*m, {1, 28, 28}, nn::calibrate_ranges(*m, b)));
  m->eval();
  double err = 0, mag = 0;
  int64_t same = 0, total = 0;
  for (const Tensor& x : b) {
    Tensor want = m->forward(x).clone(), got = q.forward(x);
    ASSERT_EQ(got.shape(), want.shape());
    for (int64_t i = 0; i < x.size(0); ++i) {
      int64_t aw = 0, ag = 0;
      for (int64_t k = 0; k < want.size(1); ++k) {
        const float w = want.f32()[i * 10 + k], g = got.f32()[i * 10 + k];
        err = std::max(err, static_cast<double>(std::fabs(w - g)));
        mag = std::max(mag, static_cast<double>(std::fabs(w)));
        if (w > want.f32()[i * 10 + aw]) aw = k;
        if (g > got.f32()[i * 10 + ag]) ag = k;
      }
      same += aw == ag;
      ++total;
    }
  }
  EXPECT_LT(err, 0.05 * mag) << name << ": largest logit error " << err << " against logits up to " << mag;
  EXPECT_GE(same, total * 9 / 10) << name << ": the int8 model picks another class for " << total - same << " of "
                                  << total;
}

TEST(Int8Model, SimpleCnnFollowsItsFp32Logits) { expect_close_to_fp32("simple_cnn"); }
TEST(Int8Model, MlpFollowsItsFp32Logits) { expect_close_to_fp32("mlp"); }
TEST(Int8Model, ResNet20FollowsItsFp32Logits) { expect_close_to_fp32("resnet20"); }

// A folded BatchNorm with statistics far from (0, 1): the int8 convolution computes what the
// Conv2d and BatchNorm2d compute, to a few quantization steps.
TEST(Int8Model, FoldedBatchNormFollowsTheFp32Layers) {
  Rng rng(4);
  nn::Sequential m;
  m.add(std::make_unique<nn::Conv2d>(1, 6, 3, 1, 1, false, rng));
  m.add(std::make_unique<nn::BatchNorm2d>(6));
  m.add(nn::ReLU());
  m.add(std::make_unique<nn::Flatten>());
  m.add(std::make_unique<nn::Linear>(6 * 8 * 8, 4, true, rng));
  for (nn::Parameter* p : m.parameters())
    if (p->name.rfind("1.", 0) == 0) p->value.copy_from(random_tensor({6}, rng, 0.5f));
  for (nn::Buffer* b : m.buffers()) {
    const bool var = b->name == "1.running_var";
    for (int64_t c = 0; c < 6; ++c) b->value.f32()[c] = var ? 0.05f + 0.5f * static_cast<float>(c) : 0.3f * rng.normal();
  }
  Tensor x = random_tensor({16, 1, 8, 8}, rng);
  nn::Int8Model q(nn::quantize_model(m, {1, 8, 8}, nn::calibrate_ranges(m, {x})));
  m.eval();
  const Tensor want = m.forward(x).clone(), got = q.forward(x);
  double err = 0, mag = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(want.f32()[i] - got.f32()[i])));
    mag = std::max(mag, static_cast<double>(std::fabs(want.f32()[i])));
  }
  EXPECT_LT(err, 0.03 * mag) << "largest logit error " << err << " against logits up to " << mag;
}

}  // namespace

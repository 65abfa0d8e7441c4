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

TEST(QuantizeModel, NamesTheFirstUnsupportedLayer) {
  auto m = model("resnet20");
  std::vector<float> ranges(m->size() + 1, 1.f);
  try {
    nn::quantize_model(*m, {1, 28, 28}, ranges);
    FAIL() << "resnet20 was quantized";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1 (BatchNorm2d(16)) is not supported"), std::string::npos)
        << e.what();
  }
}

TEST(QuantizeModel, RefusesAReluThatNoConvolutionPrecedes) {
  nn::Sequential m;
  Rng rng(1);
  m.add(std::make_unique<nn::Flatten>());
  m.add(nn::ReLU());
  m.add(std::make_unique<nn::Linear>(784, 10, true, rng));
  EXPECT_THROW(nn::quantize_model(m, {1, 28, 28}, std::vector<float>(4, 1.f)), InputError);
}

TEST(QuantizeModel, CalibrationIsBitwiseReproducibleAndOrderFree) {
  auto m = model("simple_cnn");
  std::vector<Tensor> b = batches(3, 5);
  const std::vector<float> r1 = nn::calibrate_ranges(*m, b);
  std::vector<Tensor> reversed(b.rbegin(), b.rend());
  const std::vector<float> r2 = nn::calibrate_ranges(*m, reversed);
  ASSERT_EQ(r1.size(), m->size() + 1);
  EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)));
  for (float r : r1) EXPECT_GT(r, 0.f);
  const nn::Int8Spec s1 = nn::quantize_model(*m, {1, 28, 28}, r1), s2 = nn::quantize_model(*m, {1, 28, 28}, r2);
  ASSERT_EQ(s1.layers.size(), 5u);  // conv+relu, pool, conv+relu, pool, linear
  for (size_t i = 0; i < s1.layers.size(); ++i) {
    EXPECT_EQ(s1.layers[i].weights, s2.layers[i].weights);
    EXPECT_EQ(s1.layers[i].weight_scales, s2.layers[i].weight_scales);
    EXPECT_EQ(s1.layers[i].out_range, s2.layers[i].out_range);
  }
  EXPECT_TRUE(s1.layers[0].relu && s1.layers[2].relu && !s1.layers[4].relu);
}

// The int8 logits of a model against its fp32 logits on calibrated data: errors of a few
// quantization steps, and (almost) the same predicted classes.
void expect_close_to_fp32(const std::string& name) {
  auto m = model(name, 7);
  std::vector<Tensor> b = batches(4, 11);
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

}  // namespace

// Structured pruning made physical (include/dtrain/nn/shrink.h): the shrunk model computes the
// masked model's logits, has the narrower layers, and what cannot shrink is refused naming it.
#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/nn/models.h"
#include "dtrain/nn/shrink.h"
#include "dtrain/optim/pruning.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::random_tensor;

namespace {

nn::ModelSpec spec_of(const std::string& name) {
  nn::ModelSpec s;
  s.name = name;
  s.input = {1, 28, 28};
  s.hidden = {32, 16};
  s.seed = 5;
  return s;
}

// Structured pruning as the trainer runs it: every Conv2d/Linear weight but the output layer's,
// with its bias, loses `fraction` of its rows at once.
void prune_channels(nn::Sequential& m, float fraction) {
  std::vector<nn::Parameter*> weights, biases;
  for (nn::Parameter* p : m.parameters()) (p->value.dim() >= 2 ? weights : biases).push_back(p);
  weights.pop_back();
  biases.pop_back();
  optim::PruneOptions o;
  o.sparsity = fraction;
  o.structured = true;
  optim::MagnitudePruner pruner(weights, biases, o);
  pruner.after_step(0);
}

void expect_same_logits(nn::Sequential& masked, nn::Sequential& shrunk) {
  Rng rng(9);
  const Tensor x = random_tensor({32, 1, 28, 28}, rng);
  masked.eval();
  const Tensor want = masked.forward(x).clone(), got = shrunk.forward(x);
  ASSERT_EQ(got.shape(), want.shape());
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(got.f32()[i], want.f32()[i], 1e-5f) << "logit " << i;
}

TEST(ShrinkPrunedChannels, SimpleCnnKeepsItsLogitsWithHalfTheChannels) {
  const nn::ModelSpec spec = spec_of("simple_cnn");
  auto m = nn::make_sequential_model(spec);
  prune_channels(*m, 0.5f);
  nn::ShrunkModel s = nn::shrink_pruned_channels(*m, spec);
  EXPECT_EQ(s.spec.channels, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ((*s.model)[3].parameters()[0]->value.shape(), (Shape{16, 8, 3, 3}));
  EXPECT_EQ((*s.model)[7].parameters()[0]->value.shape(), (Shape{10, 16 * 7 * 7}));
  ASSERT_EQ(s.layers.size(), 3u);
  EXPECT_EQ(s.layers[0], "0 Conv2d(1, 16, k=3, s=1, p=1): 16 -> 8 output channels") << s.layers[0];
  expect_same_logits(*m, *s.model);
  // The shrunk model rebuilds from its spec: what a checkpoint of it holds is enough.
  EXPECT_EQ(nn::make_sequential_model(s.spec)->parameter_count(), s.model->parameter_count());
}

TEST(ShrinkPrunedChannels, MlpWithDropoutKeepsItsLogits) {
  nn::ModelSpec spec = spec_of("mlp");
  spec.dropout = 0.25f;
  auto m = nn::make_sequential_model(spec);
  prune_channels(*m, 0.75f);
  nn::ShrunkModel s = nn::shrink_pruned_channels(*m, spec);
  EXPECT_EQ(s.spec.hidden, (std::vector<int64_t>{8, 4}));
  expect_same_logits(*m, *s.model);
}

// A row of zero weights with a non-zero bias is a constant channel, not a pruned one: it stays.
TEST(ShrinkPrunedChannels, KeepsAChannelWhoseBiasIsNotZero) {
  const nn::ModelSpec spec = spec_of("simple_cnn");
  auto m = nn::make_sequential_model(spec);
  prune_channels(*m, 0.5f);
  auto& conv = dynamic_cast<nn::Conv2d&>((*m)[0]);
  int64_t row = 0;  // a pruned row of the first convolution, its bias made non-zero
  while (conv.bias()->value.f32()[row] != 0.f) ++row;
  conv.bias()->value.f32()[row] = 0.25f;
  nn::ShrunkModel s = nn::shrink_pruned_channels(*m, spec);
  EXPECT_EQ(s.spec.channels, (std::vector<int64_t>{9, 16}));
  expect_same_logits(*m, *s.model);
}

TEST(ShrinkPrunedChannels, RefusesWhatItCannotShrink) {
  auto dense = nn::make_sequential_model(spec_of("simple_cnn"));
  try {
    nn::shrink_pruned_channels(*dense, spec_of("simple_cnn"));
    FAIL() << "an unpruned model was shrunk";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--prune-structured"), std::string::npos) << e.what();
  }
  auto resnet = nn::make_sequential_model(spec_of("resnet20"));
  try {
    nn::shrink_pruned_channels(*resnet, spec_of("resnet20"));
    FAIL() << "resnet20 was shrunk";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1 (BatchNorm2d(16)) is not supported"), std::string::npos) << e.what();
  }
}

}  // namespace

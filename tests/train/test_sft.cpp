// Fine-tuning data: `dtrain convert sft` records into samples with a loss mask, one sample per
// window, the cross-entropy without loss on prompts and padding (label -1), and a model that learns
// completions from them.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dtrain/core/error.h"
#include "dtrain/data/text.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/nn/layers.h"
#include "dtrain/train/lm_trainer.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

fs::path fresh(const std::string& name) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / ("sft-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace

// Completion-only loss by hand: rows whose label is -1 add no loss and get a zero gradient, in the
// cross-entropy and in the vocabulary-parallel pieces (one slice: the whole vocabulary).
TEST(Sft, IgnoredTargetsAddNoLossAndNoGradient) {
  Engine& e = cpu_engine();
  Tensor logits = Tensor::from({3, 4}, {1, 2, 3, 4, 0, 0, 9, 0, -1, 2, 0.5f, 1});
  Tensor labels = Tensor::empty({3}, DType::I32);
  labels.data<int32_t>()[0] = 2;
  labels.data<int32_t>()[1] = kIgnoreLabel;
  labels.data<int32_t>()[2] = 0;
  auto nll = [&](int row, int label) {
    double z = 0;
    for (int j = 0; j < 4; ++j) z += std::exp(logits.f32()[row * 4 + j]);
    return -(logits.f32()[row * 4 + label] - std::log(z));
  };
  const double want = nll(0, 2) + nll(2, 0);
  nn::SoftmaxCrossEntropy xent;
  xent.forward(logits, labels);
  EXPECT_NEAR(xent.last_loss_sum(), want, 1e-5);
  const Tensor d = xent.backward(1.f).clone();
  for (int j = 0; j < 4; ++j) EXPECT_EQ(d.f32()[4 + j], 0.f) << "the ignored row";
  EXPECT_NE(d.f32()[0], 0.f);
  Tensor rowmax = Tensor::empty({3}), sumexp = Tensor::empty({3}), target = Tensor::empty({3});
  Tensor stats = Tensor::zeros({kXentStatsFloats}), dv = Tensor::empty({3, 4});
  e.row_max(logits, rowmax);
  e.vocab_xent_partials(logits, labels, 0, rowmax, sumexp, target);
  e.vocab_xent_loss_accumulate(rowmax, sumexp, target, labels, stats);
  EXPECT_NEAR(xent_stats(stats).loss_sum, want, 1e-5);
  e.vocab_xent_backward(logits, labels, 0, rowmax, sumexp, 1.f / 3.f, dv);
  for (int i = 0; i < 12; ++i) EXPECT_NEAR(dv.f32()[i], d.f32()[i], 1e-6) << i;
}

// Records of both forms become samples whose loss mask covers the completions (and the assistant
// turns) only; a window holds one sample, padded, its prompt and padding without targets.
TEST(Sft, ConvertMarksCompletionsAndWindowsHoldOneSample) {
  const fs::path dir = fresh("convert");
  {
    std::ofstream out(dir / "a.jsonl");
    out << R"({"prompt": "ab", "completion": "cd"})"
        << "\n\n"
        << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
        << "\n";
  }
  data::SftConvertOptions opt;
  opt.val_fraction = 0;
  const data::SftConvertSummary s = data::convert_sft({(dir / "a.jsonl").string()}, (dir / "tok").string(), opt);
  EXPECT_EQ(s.records, 2);
  EXPECT_EQ(s.train_samples, 2);
  const data::TokenStream t = data::load_tokens((dir / "tok" / "train.h5").string());
  ASSERT_TRUE(t.has_samples());
  const std::string chat = "<|user|>\nhi\n<|assistant|>\nyo\n";
  EXPECT_EQ(t.sample_offsets, (std::vector<int64_t>{0, 4, 4 + static_cast<int64_t>(chat.size())}));
  std::string text(t.tokens.begin(), t.tokens.end()), trained;
  for (size_t i = 0; i < t.tokens.size(); ++i)
    if (t.loss_mask[i]) trained += static_cast<char>(t.tokens[i]);
  EXPECT_EQ(text, "abcd" + chat);
  EXPECT_EQ(trained, "cdyo\n");
  EXPECT_EQ(s.completion_tokens, 5);
  // Sample 0 in a window of 6: "abcd" then padding; targets only where the next token is trained.
  int64_t count = 0;
  const data::TokenBatch b = data::sample_windows(t, {0, 1}, 6, &count);
  const std::vector<int32_t> ids0(b.ids.data<int32_t>(), b.ids.data<int32_t>() + 6);
  const std::vector<int32_t> tg0(b.targets.data<int32_t>(), b.targets.data<int32_t>() + 6);
  EXPECT_EQ(ids0, (std::vector<int32_t>{'a', 'b', 'c', 'd', 0, 0}));
  EXPECT_EQ(tg0, (std::vector<int32_t>{-1, 'c', 'd', -1, -1, -1}));
  // Sample 1 is cut at 7 tokens ("<|user|"): none of them trained.
  for (int j = 0; j < 6; ++j) EXPECT_EQ(b.targets.data<int32_t>()[6 + j], -1);
  EXPECT_EQ(count, 2);
  {
    std::ofstream out(dir / "bad.jsonl");
    out << R"({"prompt": "x", "completion": "y"})"
        << "\n"
        << R"({"prompt": "x"})"
        << "\n";
  }
  try {
    data::convert_sft({(dir / "bad.jsonl").string()}, (dir / "bad").string(), opt);
    ADD_FAILURE() << "a record without a completion was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl' line 2"), std::string::npos) << e.what();
  }
  {
    std::ofstream out(dir / "deep.jsonl");
    out << R"({"prompt": "x", "completion": "y"})" << "\n"
        << R"({"prompt": "x", "completion": )" << std::string(100000, '[') << std::string(100000, ']') << "}\n";
  }
  try {
    data::convert_sft({(dir / "deep.jsonl").string()}, (dir / "deep").string(), opt);
    ADD_FAILURE() << "a record 100,000 arrays deep was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("deep.jsonl' line 2 nests objects and arrays deeper"), std::string::npos)
        << e.what();
  }
}

// A Llama fine-tuned on prompt/completion samples learns the completions: the completion loss on
// held-out records falls far below the uniform ln 256 = 5.55 nats.
TEST(Sft, LlamaLearnsCompletions) {
  const fs::path dir = fresh("train");
  {
    std::ofstream out(dir / "data.jsonl");
    const char* names[] = {"red", "green", "blue", "white", "black"};
    for (int i = 0; i < 400; ++i)
      out << "{\"prompt\": \"color " << i % 5 << ": \", \"completion\": \"" << names[i % 5] << ".\"}\n";
  }
  data::SftConvertOptions opt;
  opt.val_fraction = 0.1;
  data::convert_sft({(dir / "data.jsonl").string()}, (dir / "tok").string(), opt);
  train::TrainConfig c = train::model_defaults("llama");
  c.data = (dir / "tok").string();
  c.layers = 1;
  c.heads = 2;
  c.width = 32;
  c.context = 16;
  c.batch_size = 16;
  c.steps = 150;
  c.lr = 3e-3f;
  c.warmup_steps = 10;
  c.eval_every = 0;
  c.eval_batches = 0;
  c.log_every = 50;
  c.quiet = true;
  const train::TrainResult r = train::train_lm(c, nullptr);
  EXPECT_LT(r.last_eval.loss, 0.3) << "nats per completion token";
  fs::remove_all(dir);
}

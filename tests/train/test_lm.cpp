// GPT language-model training end to end on a small periodic text: the validation loss falls far
// below the uniform 8 bits per byte, and a checkpoint reloads to the same validation loss.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "divergence_test_util.h"
#include "dtrain/data/text.h"
#include "dtrain/train/import.h"
#include "dtrain/train/lm_names.h"
#include "dtrain/train/lm_trainer.h"
#include "lm_test_util.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

// "hello, world! " 2000 times as token files in a fresh dir/tok, and a 150-step run of a 1-block
// model of width 32 (2 heads, context 16) on them.
train::TrainConfig periodic_text_run(const fs::path& dir, const std::string& model) {
  fs::remove_all(dir);
  fs::create_directories(dir / "text");
  {
    std::ofstream out(dir / "text" / "a.txt");
    for (int i = 0; i < 2000; ++i) out << "hello, world! ";
  }
  data::TextConvertOptions topt;
  topt.block_bytes = 1024;
  data::convert_text({(dir / "text").string()}, (dir / "tok").string(), topt);
  train::TrainConfig c = train::model_defaults(model);
  c.data = (dir / "tok").string();
  c.layers = 1;
  c.heads = 2;
  c.width = 32;
  c.context = 16;
  c.batch_size = 8;
  c.steps = 150;
  c.lr = 3e-3f;
  c.min_lr = 3e-4f;
  c.warmup_steps = 10;
  c.eval_every = 0;
  c.eval_batches = 8;
  c.log_every = 0;
  c.quiet = true;
  return c;
}

}  // namespace

TEST(LanguageModel, LearnsPeriodicTextAndCheckpointReloads) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "lm";
  train::TrainConfig c = periodic_text_run(dir, "gpt");
  c.checkpoint_dir = (dir / "ckpt").string();
  train::TrainResult r = train::train_lm(c, nullptr);
  EXPECT_LT(r.last_eval.loss, 0.5) << "nats per byte; uniform is ln 256 = 5.55";
  EXPECT_GT(r.units_per_s, 0);
  ASSERT_TRUE(fs::exists(r.checkpoint));

  auto model = train::gpt_from_checkpoint(train::load_checkpoint(r.checkpoint));
  EXPECT_EQ(model->config().width, 32);
  double reloaded = train::evaluate_lm(*model, (dir / "tok" / "val.h5").string(), c.batch_size, 16, c.eval_batches);
  EXPECT_NEAR(reloaded, r.last_eval.loss, 1e-6 * std::max(1.0, r.last_eval.loss));
  fs::remove_all(dir);
}

// A Llama (RMSNorm, rotary positions, SwiGLU, 1 key/value head for 2 query heads, untied) learns
// the same text; resumed from its step-75 checkpoint it ends bitwise where the uninterrupted run
// ends, and the checkpoint reloads as a Llama to the same validation loss.
TEST(LanguageModel, LlamaLearnsResumesBitwiseAndReloads) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "llama";
  train::TrainConfig c = periodic_text_run(dir, "llama");
  c.kv_heads = 1;
  c.log_every = 1;
  c.checkpoint_every = 75;
  c.checkpoint_dir = (dir / "ckpt").string();
  train::TrainResult r = train::train_lm(c, nullptr);
  EXPECT_LT(r.last_eval.loss, 0.5) << "nats per byte; uniform is ln 256 = 5.55";
  ASSERT_EQ(r.step_losses.size(), 150u);

  train::CheckpointState state = train::load_checkpoint(r.checkpoint);
  EXPECT_EQ(state.strings["model"], "llama");
  auto model = train::gpt_from_checkpoint(state);
  EXPECT_TRUE(model->config().rotary && model->config().swiglu && !model->config().tied);
  EXPECT_EQ(model->config().kv(), 1);
  double reloaded = train::evaluate_lm(*model, (dir / "tok" / "val.h5").string(), c.batch_size, 16, c.eval_batches);
  EXPECT_NEAR(reloaded, r.last_eval.loss, 1e-6 * std::max(1.0, r.last_eval.loss));
  // Evaluation scores every window: in batches that do not divide them, the last batch holds the
  // rest, and the loss is that of one window at a time.
  const data::TokenStream val = data::load_tokens((dir / "tok" / "val.h5").string());
  const int64_t windows = data::window_count(val, 16);
  int64_t b = 3;
  while (windows % b == 0) ++b;
  EXPECT_EQ(train::scored_windows(val, b, 16, 0), windows);
  EXPECT_EQ(train::scored_windows(val, b, 16, 1), b);
  EXPECT_NEAR(train::evaluate_lm(*model, val, b, 16, 0), train::evaluate_lm(*model, val, 1, 16, 0), 1e-6);

  c.resume = (dir / "ckpt" / "ckpt-step000000075.h5").string();
  c.checkpoint_dir = (dir / "resumed").string();
  train::TrainResult resumed = train::train_lm(c, nullptr);
  ASSERT_EQ(resumed.step_losses.size(), 75u);
  for (size_t i = 0; i < 75; ++i) EXPECT_EQ(resumed.step_losses[i], r.step_losses[75 + i]) << "step " << 75 + i;
  EXPECT_EQ(resumed.last_eval.loss, r.last_eval.loss);
  // A Llama checkpoint does not resume as a GPT of the same sizes.
  c.model = "gpt";
  c.kv_heads = 0;
  try {
    train::train_lm(c, nullptr);
    ADD_FAILURE() << "a llama checkpoint resumed as a gpt";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("llama"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// --freeze: the matched parameters end as they began (also under ZeRO-3, whose shards hold them,
// with an expression that cuts block 1 in two), with no optimizer state; the rest train. An expression that matches nothing or everything, or
// is not one, is refused.
TEST(LanguageModel, FrozenParametersStayAsDrawn) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "freeze";
  train::TrainConfig c = periodic_text_run(dir, "llama");
  c.steps = 10;
  c.layers = 2;
  c.freeze = "wte|blocks\\.0\\..*|blocks\\.1\\.0\\..*";  // block 1's attention half
  const nn::Gpt init(train::lm_shape(c, 256));
  for (int zero : {0, 3}) {
    c.zero = zero;
    c.checkpoint_dir = (dir / ("ckpt" + std::to_string(zero))).string();
    train::CheckpointState s = train::load_checkpoint_set(train::train_lm(c, nullptr).checkpoint);
    int frozen = 0;
    for (nn::Parameter* p : const_cast<nn::Gpt&>(init).parameters()) {
      const Tensor& now = s.tensors.at("param/" + p->name);
      const bool same = std::memcmp(now.raw(), p->value.raw(), static_cast<size_t>(p->value.nbytes())) == 0;
      const bool matched =
          p->name == "wte" || p->name.rfind("blocks.0.", 0) == 0 || p->name.rfind("blocks.1.0.", 0) == 0;
      EXPECT_EQ(same, matched) << p->name << " under --zero " << zero;
      EXPECT_EQ(s.tensors.count("optim/" + p->name + ".exp_avg"), matched ? 0u : 1u) << p->name;
      frozen += matched;
    }
    EXPECT_EQ(frozen, 10);  // wte, block 0's two norms, qkv, proj, gate/up, down; block 1's norm, qkv, proj
  }
  for (const char* bad : {"nothing", ".*", "(unclosed"}) {
    c.freeze = bad;
    try {
      train::train_lm(c, nullptr);
      ADD_FAILURE() << "--freeze " << bad << " was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--freeze"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// LoRA on a Llama started from pretrained weights: only the adapters move; their optimizer state is
// under 2 % of full fine-tuning's, the gradients the memory report counts at most 2x the adapters'
// bytes (the frozen weights have none); an export under Hugging Face's names merges them, and a plain
// Llama that imports it gives the adapted model's logits.
TEST(LanguageModel, LoraTrainsAdaptersOnlyAndExportsMerged) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "lora";
  train::TrainConfig c = periodic_text_run(dir, "llama");
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.width = 128;
  c.steps = 10;
  nn::Gpt pretrained(train::lm_shape(c, 256));
  test::write_pretrained((dir / "pretrained.safetensors").string(), pretrained);
  c.init_from = (dir / "pretrained.safetensors").string();
  c.checkpoint_dir = (dir / "full").string();
  const train::CheckpointState full = train::load_checkpoint_set(train::train_lm(c, nullptr).checkpoint);
  c.lora_rank = 4;
  c.lr = 1e-2f;
  c.checkpoint_dir = (dir / "lora").string();
  const train::TrainResult trained = train::train_lm(c, nullptr);
  train::CheckpointState lora = train::load_checkpoint_set(trained.checkpoint);
  EXPECT_GT(test::gradient_bytes(trained), 0);
  EXPECT_LE(test::gradient_bytes(trained), 2 * test::adapter_bytes(c, 256)) << "gradient bytes against the adapters'";
  auto state_floats = [](const train::CheckpointState& s) {
    int64_t n = 0;
    for (const auto& [k, t] : s.tensors) n += k.rfind("optim/", 0) == 0 ? t.numel() : 0;
    return n;
  };
  const double ratio = static_cast<double>(state_floats(lora)) / static_cast<double>(state_floats(full));
  EXPECT_GT(ratio, 0.0);
  EXPECT_LE(ratio, 0.02) << "LoRA's optimizer state against full fine-tuning's";
  int adapters = 0;
  for (nn::Parameter* p : pretrained.parameters()) {
    const Tensor& now = lora.tensors.at("param/" + p->name);
    EXPECT_EQ(std::memcmp(now.raw(), p->value.raw(), static_cast<size_t>(p->value.nbytes())), 0) << p->name;
  }
  for (const auto& [k, t] : lora.tensors) adapters += k.ends_with(".lora_B");
  EXPECT_EQ(adapters, 2) << "q and v of each block's fused projection: one pair per block";
  double moved = 0;
  for (const auto& [k, t] : lora.tensors)
    if (k.ends_with(".lora_B"))
      for (int64_t i = 0; i < t.numel(); ++i) moved += std::abs(t.f32()[i]);
  EXPECT_GT(moved, 0.0) << "the adapters trained";

  auto adapted = train::gpt_from_checkpoint(lora);
  const std::string merged = (dir / "merged.safetensors").string();
  train::write_safetensors(merged, train::export_tensors(lora, train::ExportNames::PyTorch), {});
  nn::GptConfig shape = pretrained.config();
  nn::Gpt target(shape);
  const auto files = train::list_safetensors(merged);
  train::import_pretrained(target, merged, train::lm_pretrained_names(shape, files));
  Tensor ids = Tensor::empty({2, 16}, DType::I32);
  for (int64_t i = 0; i < ids.numel(); ++i) ids.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 256);
  const Tensor want = adapted->forward(ids).clone(), got = target.forward(ids);
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(got.f32()[i], want.f32()[i], 1e-5) << i;
  fs::remove_all(dir);
}

// fp16 with dynamic loss scaling. A first scale of 2^24 makes the scaled loss gradient overflow
// half precision in the head's GEMM: those steps are skipped (no AdamW update), the scale halves
// until it fits, and training goes on. A run resumed from its step-5 checkpoint continues with the
// uninterrupted run's losses, skipped-step count and scale (the scaler's state and AdamW's own step
// count, which lags the run's by the skipped steps, are in the checkpoint). With the default scale
// nothing overflows and the losses stay close to fp32's.
TEST(LanguageModel, Fp16LossScalingSkipsOverflowsAndResumesExactly) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "lm-fp16";
  fs::remove_all(dir);
  test::write_lm_corpus(dir, "the quick brown fox", 600);
  nn::GptConfig g;
  g.layers = 2;
  g.heads = 2;
  g.width = 32;
  g.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", g);
  struct Restore {
    ~Restore() { cpu_engine().set_math_precision(MathPrecision::F32); }
  } restore;
  train::TrainResult fp32 = train::train_lm(c, nullptr);

  c.precision = "fp16";
  train::TrainResult plain = train::train_lm(c, nullptr);
  EXPECT_EQ(plain.skipped_steps, 0);
  EXPECT_EQ(plain.loss_scale, 65536.0);
  ASSERT_EQ(plain.step_losses.size(), fp32.step_losses.size());
  for (size_t i = 0; i < fp32.step_losses.size(); ++i)
    EXPECT_NEAR(plain.step_losses[i], fp32.step_losses[i], 2e-3 * fp32.step_losses[i]) << "step " << i;
  EXPECT_NEAR(plain.last_eval.loss, fp32.last_eval.loss, 2e-3 * fp32.last_eval.loss);

  c.loss_scale_init = 16777216.f;
  c.checkpoint_dir = (dir / "ckpt").string();
  c.checkpoint_every = 5;
  train::TrainResult big = train::train_lm(c, nullptr);
  EXPECT_GE(big.skipped_steps, 1);
  EXPECT_LT(big.skipped_steps, 10);
  EXPECT_EQ(big.loss_scale, 16777216.0 / std::pow(2.0, static_cast<double>(big.skipped_steps)));
  ASSERT_EQ(big.step_losses.size(), 10u);
  for (double l : big.step_losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(big.step_losses.back(), big.step_losses.front()) << "the steps taken still learn";

  c.resume = (dir / "ckpt" / "ckpt-step000000005.h5").string();
  c.checkpoint_dir = (dir / "ckpt2").string();
  train::TrainResult resumed = train::train_lm(c, nullptr);
  ASSERT_EQ(resumed.step_losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(resumed.step_losses[i], big.step_losses[5 + i], 1e-6 * big.step_losses[5 + i]) << "step " << 5 + i;
  EXPECT_EQ(resumed.skipped_steps, big.skipped_steps);
  EXPECT_EQ(resumed.loss_scale, big.loss_scale);
  EXPECT_NEAR(resumed.last_eval.loss, big.last_eval.loss, 1e-6 * big.last_eval.loss);
  fs::remove_all(dir);
}

// A run whose loss or weights turn non-finite stops with an error naming the step before a
// checkpoint could keep them: with a checkpoint after every step, none at or after the failing step
// exists and those that do hold finite weights. (The losses are read at log lines and before
// checkpoints, not at every step; the weights before each checkpoint.)
TEST(LanguageModel, NonFiniteLossStopsBeforeItsCheckpoint) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "lm-nan";
  fs::remove_all(dir);
  test::write_lm_corpus(dir, "the quick brown fox", 600);
  nn::GptConfig g;
  g.layers = 1;
  g.heads = 2;
  g.width = 32;
  g.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", g);
  c.lr = 1e30f;
  c.warmup_steps = 0;
  c.steps = 12;
  c.log_every = 0;
  c.checkpoint_dir = (dir / "ckpt").string();
  c.checkpoint_every = 1;
  std::string what;
  try {
    train::train_lm(c, nullptr);
  } catch (const DivergenceError& e) {
    what = e.what();
  }
  test::expect_stopped_before_checkpoint(what, dir / "ckpt");
  fs::remove_all(dir);
}

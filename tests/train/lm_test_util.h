#pragma once
// A small language-model run for tests: a text corpus of repeated lines converted to token files,
// and the GPT configuration the tests share (byte vocabulary, batch 4, 10 AdamW steps, evaluation at the end).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "dtrain/data/text.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/train/export.h"
#include "dtrain/train/lm_trainer.h"

namespace dtrain::test {

// Writes `lines` copies of "<line> <i % 7>. " under dir/text and converts them into dir/tok.
inline void write_lm_corpus(const std::filesystem::path& dir, const std::string& line, int lines) {
  std::filesystem::create_directories(dir / "text");
  {
    std::ofstream out(dir / "text" / "a.txt");
    for (int i = 0; i < lines; ++i) out << line << " " << i % 7 << ". ";
  }
  data::convert_text({(dir / "text").string()}, (dir / "tok").string());
}

// A GPT of 4 blocks of width 16 (4 heads), context 8, for the layout tests.
inline nn::GptConfig small_gpt() {
  nn::GptConfig c;
  c.vocab = 40;
  c.context = 8;
  c.layers = 4;
  c.heads = 4;
  c.width = 16;
  c.seed = 9;
  return c;
}

inline train::TrainConfig small_lm_config(const std::filesystem::path& tokens, const nn::GptConfig& model) {
  train::TrainConfig c = train::model_defaults(model.llama() ? "llama" : "gpt");
  c.data = tokens.string();
  c.vocab = 256;
  c.kv_heads = model.kv_heads;
  c.mlp_width = model.mlp_width;
  c.context = model.context;
  c.layers = model.layers;
  c.heads = model.heads;
  c.width = model.width;
  c.seed = model.seed;
  c.batch_size = 4;
  c.steps = 10;
  c.lr = 3e-3f;
  c.warmup_steps = 2;
  c.eval_every = 0;
  c.eval_batches = 4;
  c.log_every = 5;
  c.quiet = true;
  return c;
}

// The bytes of the LoRA adapters of the one-rank model `c` trains over `vocab` tokens, and those of
// the gradients a run's memory report gives (every kind of gradient state: whole, shard, buffers'
// peak).
inline int64_t adapter_bytes(const train::TrainConfig& c, int64_t vocab) {
  nn::Gpt model(train::lm_shape(c, vocab));
  int64_t bytes = 0;
  for (const nn::Parameter* p : model.parameters())
    if (nn::is_lora_adapter(p->name)) bytes += static_cast<int64_t>(p->value.nbytes());
  return bytes;
}
inline int64_t gradient_bytes(const train::TrainResult& r) {
  int64_t bytes = 0;
  for (const auto& [kind, n] : r.model_state_bytes)
    if (kind.find("gradient") != std::string::npos) bytes += n;
  return bytes;
}

// The parameters of `model` as a checkpoint of its shape (write_lm_shape, "param/<name>").
inline train::CheckpointState lm_state(nn::Gpt& model) {
  train::CheckpointState s;
  train::write_lm_shape(model.config(), s);
  for (nn::Parameter* p : model.parameters()) s.tensors["param/" + p->name] = p->value;
  return s;
}

// `model` as pretrained weights: a safetensors file under Hugging Face's names (or dtrain's).
inline void write_pretrained(const std::string& path, nn::Gpt& model, bool hf_names = true) {
  train::write_safetensors(
      path, train::export_tensors(lm_state(model), hf_names ? train::ExportNames::PyTorch : train::ExportNames::Dtrain),
      {});
}

// A layout's run against the one-rank run: every step's loss (where `logs_steps`: the rank that
// logs them) and the validation loss within relative 1e-5.
inline void expect_lm_losses_match(const train::TrainResult& got, const train::TrainResult& ref, bool logs_steps) {
  if (logs_steps) {
    EXPECT_EQ(got.step_losses.size(), ref.step_losses.size());
    for (size_t i = 0; i < std::min(got.step_losses.size(), ref.step_losses.size()); ++i)
      EXPECT_NEAR(got.step_losses[i], ref.step_losses[i], 1e-5 * ref.step_losses[i]) << "step " << i;
  }
  EXPECT_NEAR(got.last_eval.loss, ref.last_eval.loss, 1e-5 * ref.last_eval.loss);
}

}  // namespace dtrain::test

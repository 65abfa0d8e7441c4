// The language-model commands: `dtrain train` with model = gpt (routed here by cmd_train),
// and `dtrain generate` (samples text from a GPT checkpoint).
#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/error.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/lm_trainer.h"
#include "dtrain/train/options.h"
#include "dtrain/train/signals.h"

namespace dtrain::cli {

namespace po = boost::program_options;

namespace {

// Parses command line, then --config INI (the command line wins); false after --help.
bool parse_with_config(int argc, char** argv, const po::options_description& opts, const std::string& usage) {
  po::variables_map vm;
  return train::parse_options(argc, argv, opts, usage, vm, true);
}

}  // namespace

bool wants_lm_training(int argc, char** argv) {
  // `--model gpt` on the command line, or `model = gpt` in the --config file (unless the command
  // line names another model).
  std::string model, config;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--model" || a == "--config") && i + 1 < argc)
      (a == "--model" ? model : config) = argv[++i];
    else if (a.rfind("--model=", 0) == 0)
      model = a.substr(8);
    else if (a.rfind("--config=", 0) == 0)
      config = a.substr(9);
  }
  if (!model.empty()) return model == "gpt";
  if (config.empty()) return false;
  std::ifstream in(config);
  std::string line;
  while (std::getline(in, line)) {
    std::string s;
    for (char ch : line)
      if (ch != ' ' && ch != '\t' && ch != '\r') s += ch;
    if (s == "model=gpt") return true;
  }
  return false;
}

int cmd_train_lm(int argc, char** argv) {
  train::LmConfig c;
  std::string model = "gpt";
  po::options_description o("language model (GPT) training");
  // clang-format off
  o.add_options()
    ("model", po::value(&model)->default_value(model), "gpt")
    ("data", po::value(&c.data)->required(), "directory with train.h5 and val.h5 from dtrain convert text")
    ("layers", po::value(&c.model.layers)->default_value(c.model.layers), "transformer blocks")
    ("heads", po::value(&c.model.heads)->default_value(c.model.heads), "attention heads (divide --width)")
    ("width", po::value(&c.model.width)->default_value(c.model.width), "model width C")
    ("context", po::value(&c.model.context)->default_value(c.model.context), "longest sequence (position table rows)")
    ("vocab", po::value(&c.model.vocab)->default_value(c.model.vocab), "vocabulary (256: bytes)")
    ("batch-size", po::value(&c.batch_size)->default_value(c.batch_size), "sequences per rank per step")
    ("seq-len", po::value(&c.seq_len)->default_value(c.seq_len), "tokens per sequence (0: --context)")
    ("steps", po::value(&c.steps)->default_value(c.steps), "optimizer steps")
    ("lr", po::value(&c.lr)->default_value(c.lr), "peak learning rate (AdamW, cosine decay)")
    ("min-lr", po::value(&c.min_lr)->default_value(c.min_lr), "cosine floor")
    ("warmup-steps", po::value(&c.warmup_steps)->default_value(c.warmup_steps), "linear warm-up steps")
    ("weight-decay", po::value(&c.weight_decay)->default_value(c.weight_decay), "AdamW decay of the matrices")
    ("clip-grad-norm", po::value(&c.clip_grad_norm)->default_value(c.clip_grad_norm), "global gradient norm limit (0: off)")
    ("eval-every", po::value(&c.eval_every)->default_value(c.eval_every), "steps between validation passes")
    ("eval-batches", po::value(&c.eval_batches)->default_value(c.eval_batches), "validation batches per pass (0: all)")
    ("log-every", po::value(&c.log_every)->default_value(c.log_every), "steps between log lines")
    ("tp", po::value(&c.tp)->default_value(c.tp), "tensor-parallel ranks (heads and MLP split; dp is the rest)")
    ("pp", po::value(&c.pp)->default_value(c.pp), "pipeline stages (blocks split by cost)")
    ("pp-split", po::value(&c.pp_split), "blocks per pipeline stage, e.g. 2,4 (default: balanced by cost)")
    ("micro-batches", po::value(&c.micro_batches)->default_value(c.micro_batches), "pipeline micro-batches per step (0: 2 x --pp; divides --batch-size)")
    ("schedule", po::value(&c.schedule)->default_value(c.schedule), "pipeline schedule: 1f1b or gpipe")
    ("checkpoint-activations", po::bool_switch(&c.checkpoint_activations), "recompute each block's activations in backward (less memory)")
    ("precision", po::value(&c.precision)->default_value(c.precision), "fp32, bf16 (GEMM inputs and weight copies in bf16, f32 accumulation), fp16 (the same in half, with dynamic loss scaling) or, on a GPU, tf32")
    ("loss-scale-interval", po::value(&c.loss_scale_interval)->default_value(c.loss_scale_interval), "fp16: finite steps in a row before the loss scale doubles")
    ("loss-scale-init", po::value(&c.loss_scale_init)->default_value(c.loss_scale_init), "fp16: the first loss scale (halved on every step with inf/NaN gradients)")
    ("device", po::value(&c.device)->default_value(c.device), "cpu or cuda (one GPU per rank)")
    ("threads", po::value(&c.threads)->default_value(c.threads), "compute threads (0: default)")
    ("seed", po::value(&c.model.seed)->default_value(c.model.seed), "initialisation and sampling seed")
    ("metrics", po::value(&c.metrics), "JSON-lines metrics file (rank 0)")
    ("checkpoint-dir", po::value(&c.checkpoint_dir), "write ckpt-step<N>.h5 here (parameters and AdamW state, one-rank layout)")
    ("checkpoint-every", po::value(&c.checkpoint_every)->default_value(c.checkpoint_every), "steps between checkpoints (0: at the end only)")
    ("keep-checkpoints", po::value(&c.keep_checkpoints)->default_value(c.keep_checkpoints), "newest checkpoints kept")
    ("resume", po::value(&c.resume), "continue from a checkpoint file or the newest in a directory, written in any dp/tp/pp layout")
    ("preempt-signals", po::value(&c.preempt_signals)->default_value(c.preempt_signals), "signals that checkpoint at the next step and exit with code 42: comma list of TERM, USR1, USR2, INT, HUP, CONT, or none")
    ("preempt-check-every", po::value(&c.preempt_check_every)->default_value(c.preempt_check_every), "steps between the ranks' agreement on a received preemption signal");
  // clang-format on
  if (!parse_with_config(argc, argv, o, "usage: dtrain train --config examples/gpt_fortunes.ini [options]")) return 0;
  DT_INPUT_CHECK(model == "gpt", "--model " << model << " is not a language model");
  c.seed = c.model.seed;
  comm::Runtime& rt = comm::Runtime::get();
  train::PreemptionGuard preemption(train::parse_signal_list(c.preempt_signals, "preempt-signals"));
  DT_INPUT_CHECK(c.preempt_check_every >= 1, "option --preempt-check-every must be >= 1");
  // A preempted run has written its checkpoint; the job scripts requeue on this exit status.
  return train::train_lm(c, &rt.world()).preempted_by != 0 ? kExitPreempted : kExitDone;
}

int cmd_generate(int argc, char** argv) {
  std::string ckpt, prompt = "\n";
  int64_t tokens = 200, top_k = 0;
  float temperature = 0.8f;
  uint64_t seed = 1;
  po::options_description o("sampling");
  // clang-format off
  o.add_options()
    ("checkpoint", po::value(&ckpt)->required(), "GPT checkpoint file, or the directory of the newest")
    ("prompt", po::value(&prompt)->default_value(prompt), "text the sample continues")
    ("tokens", po::value(&tokens)->default_value(tokens), "bytes to generate")
    ("temperature", po::value(&temperature)->default_value(temperature), "softmax temperature (0: greedy)")
    ("top-k", po::value(&top_k)->default_value(top_k), "sample among the k likeliest (0: all)")
    ("seed", po::value(&seed)->default_value(seed), "sampling seed");
  // clang-format on
  if (!parse_with_config(argc, argv, o, "usage: dtrain generate --checkpoint FILE|DIR [--prompt TEXT]")) return 0;
  if (comm::Runtime::get().world().rank() != 0) return 0;
  auto model = train::gpt_from_checkpoint(train::load_gpt_checkpoint(train::resolve_checkpoint(ckpt, "checkpoint")));
  model->eval();
  const int64_t ctx = model->config().context, v = model->config().vocab;
  std::vector<int32_t> seq;
  for (unsigned char ch : prompt) seq.push_back(ch);
  DT_INPUT_CHECK(!seq.empty(), "--prompt must not be empty");
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  Rng rng(seed);
  std::vector<double> p(static_cast<size_t>(v));
  for (int64_t n = 0; n < tokens; ++n) {
    int64_t t = std::min<int64_t>(ctx, static_cast<int64_t>(seq.size()));
    Tensor ids = Tensor::empty({1, t}, DType::I32);
    std::copy(seq.end() - t, seq.end(), ids.data<int32_t>());
    Tensor logits = model->forward(ids);  // [t, V]; the last row predicts the next byte
    const float* last = logits.f32() + (t - 1) * v;
    int64_t best = 0;
    for (int64_t j = 1; j < v; ++j)
      if (last[j] > last[best]) best = j;
    int64_t next = best;
    if (temperature > 0) {
      float kth = -INFINITY;  // logits below the k-th largest are left out
      if (top_k > 0 && top_k < v) {
        std::vector<float> sorted(last, last + v);
        std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<float>());
        kth = sorted[static_cast<size_t>(top_k - 1)];
      }
      double z = 0;
      for (int64_t j = 0; j < v; ++j) {
        p[static_cast<size_t>(j)] = last[j] >= kth ? std::exp((last[j] - last[best]) / temperature) : 0.0;
        z += p[static_cast<size_t>(j)];
      }
      double u = rng.uniform() * z, acc = 0;
      for (next = 0; next < v - 1; ++next) {
        acc += p[static_cast<size_t>(next)];
        if (acc > u) break;
      }
    }
    seq.push_back(static_cast<int32_t>(next));
    std::fputc(static_cast<int>(next), stdout);
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace dtrain::cli

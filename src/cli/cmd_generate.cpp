// dtrain generate: samples text from a GPT checkpoint.
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
#include "dtrain/nn/quantized.h"
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

int cmd_generate(int argc, char** argv) {
  std::string ckpt, prompt = "\n";
  int64_t tokens = 200, top_k = 0;
  float temperature = 0.8f;
  uint64_t seed = 1;
  bool int8 = false;
  int threads = 0;
  po::options_description o("sampling");
  // clang-format off
  o.add_options()
    ("checkpoint", po::value(&ckpt)->required(), "GPT checkpoint file, or the directory of the newest")
    ("prompt", po::value(&prompt)->default_value(prompt), "text the sample continues")
    ("tokens", po::value(&tokens)->default_value(tokens), "tokens to generate (bytes, or BPE pieces)")
    ("temperature", po::value(&temperature)->default_value(temperature), "softmax temperature (0: greedy)")
    ("top-k", po::value(&top_k)->default_value(top_k), "sample among the k likeliest (0: all)")
    ("seed", po::value(&seed)->default_value(seed), "sampling seed")
    ("threads", po::value(&threads)->default_value(threads), "compute threads (0: cores / ranks on the node)")
    ("int8", po::bool_switch(&int8), "multiply by int8 weights (weight-only, one scale per output row): the Linear layers' weights in a quarter of the memory");
  // clang-format on
  if (!parse_with_config(argc, argv, o, "usage: dtrain generate --checkpoint FILE|DIR [--prompt TEXT]")) return 0;
  if (comm::Runtime::get().world().rank() != 0) return 0;
  cpu_engine().set_threads(comm::Runtime::get().topology().compute_threads(threads));
  const std::string file = train::resolve_checkpoint(ckpt, "checkpoint");
  const train::CheckpointState state = train::load_checkpoint_set(file);
  auto model = train::gpt_from_checkpoint(state);
  const data::Tokenizer tokenizer = train::tokenizer_from_checkpoint(state, file);
  model->eval();
  if (int8) {
    const nn::WeightOnlyReport w = nn::quantize_linear_weights_int8(*model);
    std::fprintf(stderr, "int8 weights in %lld Linear layers: %.2f MiB -> %.2f MiB\n", static_cast<long long>(w.layers),
                 w.f32_bytes / 1048576.0, w.int8_bytes / 1048576.0);
  }
  const int64_t ctx = model->config().context, v = model->config().vocab;
  std::vector<int32_t> seq = tokenizer.encode(prompt);
  DT_INPUT_CHECK(!seq.empty(), "--prompt must not be empty");
  DT_INPUT_CHECK(tokenizer.vocab() <= v, "'" << file << "': its tokenizer has " << tokenizer.vocab()
                                             << " tokens, its model " << v);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  Rng rng(seed);
  std::vector<double> p(static_cast<size_t>(v));
  for (int64_t n = 0; n < tokens; ++n) {
    int64_t t = std::min<int64_t>(ctx, static_cast<int64_t>(seq.size()));
    Tensor ids = Tensor::empty({1, t}, DType::I32);
    std::copy(seq.end() - t, seq.end(), ids.data<int32_t>());
    Tensor logits = model->forward(ids);  // [t, V]; the last row predicts the next token
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
    // A model wider than its tokenizer (--vocab above the data's) may pick an id it never saw.
    if (next < tokenizer.vocab()) std::fputs(tokenizer.piece_text(static_cast<int32_t>(next)).c_str(), stdout);
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace dtrain::cli

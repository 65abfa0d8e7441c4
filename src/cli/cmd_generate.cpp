// dtrain generate: samples text from a language model's checkpoint (gpt or llama), each layer's
// keys and values cached.
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
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/nn/quantized.h"
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

// The next token from the logits of the last position: the likeliest at temperature 0, else drawn
// from softmax(logits / T) restricted to the `top_k` likeliest (0: all) and then to the smallest
// set of the likeliest whose probabilities reach `top_p` (1: all).
int64_t sample_next(const float* logits, int64_t v, float temperature, int64_t top_k, float top_p, Rng& rng,
                    std::vector<double>& p) {
  int64_t best = 0;
  for (int64_t j = 1; j < v; ++j)
    if (logits[j] > logits[best]) best = j;
  if (temperature <= 0) return best;
  float kth = -INFINITY;  // logits below the k-th largest are left out
  if (top_k > 0 && top_k < v) {
    std::vector<float> sorted(logits, logits + v);
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<float>());
    kth = sorted[static_cast<size_t>(top_k - 1)];
  }
  double z = 0;
  for (int64_t j = 0; j < v; ++j) {
    p[static_cast<size_t>(j)] = logits[j] >= kth ? std::exp((logits[j] - logits[best]) / temperature) : 0.0;
    z += p[static_cast<size_t>(j)];
  }
  if (top_p < 1.f) {  // the nucleus: likeliest first until their mass reaches top_p; the rest left out
    std::vector<int64_t> order(static_cast<size_t>(v));
    for (int64_t j = 0; j < v; ++j) order[static_cast<size_t>(j)] = j;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)]; });
    double mass = 0, kept = 0;
    for (int64_t j : order) {
      if (mass >= top_p * z) {
        p[static_cast<size_t>(j)] = 0;
        continue;
      }
      mass += p[static_cast<size_t>(j)];
      kept += p[static_cast<size_t>(j)];
    }
    z = kept;
  }
  double u = rng.uniform() * z, acc = 0;
  int64_t next = 0;
  for (; next < v - 1; ++next) {
    acc += p[static_cast<size_t>(next)];
    if (acc > u) break;
  }
  return next;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  std::string ckpt, prompt = "\n";
  int64_t tokens = 200, top_k = 0;
  float temperature = 0.8f, top_p = 1.f;
  uint64_t seed = 1;
  bool int8 = false, no_cache = false;
  int threads = 0;
  po::options_description o("sampling");
  // clang-format off
  o.add_options()
    ("checkpoint", po::value(&ckpt)->required(), "language model checkpoint file (gpt or llama), or the directory of the newest")
    ("prompt", po::value(&prompt)->default_value(prompt), "text the sample continues")
    ("tokens", po::value(&tokens)->default_value(tokens), "tokens to generate (bytes, or BPE pieces)")
    ("temperature", po::value(&temperature)->default_value(temperature), "softmax temperature (0: greedy)")
    ("top-k", po::value(&top_k)->default_value(top_k), "sample among the k likeliest (0: all)")
    ("top-p", po::value(&top_p)->default_value(top_p), "then among the likeliest whose probabilities add up to p (1: all)")
    ("seed", po::value(&seed)->default_value(seed), "sampling seed")
    ("threads", po::value(&threads)->default_value(threads), "compute threads (0: cores / ranks on the node)")
    ("int8", po::bool_switch(&int8), "multiply by int8 weights (weight-only, one scale per output row): the Linear layers' weights in a quarter of the memory")
    ("no-cache", po::bool_switch(&no_cache), "recompute the whole window for every token instead of keeping each layer's keys and values (for comparison)");
  // clang-format on
  if (!parse_with_config(argc, argv, o, "usage: dtrain generate --checkpoint FILE|DIR [--prompt TEXT]")) return 0;
  DT_INPUT_CHECK(top_p > 0.f && top_p <= 1.f, "option --top-p must be in (0, 1], got " << top_p);
  DT_INPUT_CHECK(tokens >= 0 && top_k >= 0, "options --tokens and --top-k must be >= 0");
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
  DT_INPUT_CHECK(tokenizer.vocab() <= v,
                 "'" << file << "': its tokenizer has " << tokenizer.vocab() << " tokens, its model " << v);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  Rng rng(seed);
  std::vector<double> p(static_cast<size_t>(v));
  // With the cache each token is one position through the model, until the sequence fills the
  // context; from there (and with --no-cache throughout) the last `ctx` tokens are recomputed.
  bool cached = !no_cache && static_cast<int64_t>(seq.size()) < ctx;
  if (cached) model->start_decoding(ctx);
  int64_t fed = 0;  // tokens of seq the cache holds
  const double t0 = now_s();
  for (int64_t n = 0; n < tokens; ++n) {
    if (cached && static_cast<int64_t>(seq.size()) > ctx) {
      model->start_decoding(0);  // full: back to recomputing the window
      cached = false;
    }
    Tensor logits;
    int64_t rows = 0;
    if (cached) {
      rows = static_cast<int64_t>(seq.size()) - fed;
      Tensor ids = Tensor::empty({1, rows}, DType::I32);
      std::copy(seq.begin() + fed, seq.end(), ids.data<int32_t>());
      model->decode_at(fed);
      logits = model->forward(ids);
      fed = static_cast<int64_t>(seq.size());
    } else {
      rows = std::min<int64_t>(ctx, static_cast<int64_t>(seq.size()));
      Tensor ids = Tensor::empty({1, rows}, DType::I32);
      std::copy(seq.end() - rows, seq.end(), ids.data<int32_t>());
      logits = model->forward(ids);  // [rows, V]; the last row predicts the next token
    }
    const int64_t next = sample_next(logits.f32() + (rows - 1) * v, v, temperature, top_k, top_p, rng, p);
    seq.push_back(static_cast<int32_t>(next));
    // A model wider than its tokenizer (--vocab above the data's) may pick an id it never saw.
    if (next < tokenizer.vocab()) std::fputs(tokenizer.piece_text(static_cast<int32_t>(next)).c_str(), stdout);
  }
  const double seconds = now_s() - t0;
  std::fputc('\n', stdout);
  std::fflush(stdout);  // the sample first, then the figures (one stream when both are captured)
  std::fprintf(stderr, "generated %lld tokens in %.3f s: %.1f tokens/s (%s)\n", static_cast<long long>(tokens), seconds,
               seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0,
               no_cache ? "the window recomputed per token" : "keys and values cached");
  return 0;
}

}  // namespace dtrain::cli

// dtrain bench lm-gemm: the GEMM limit of a language model's training step on this processor. The
// model `dtrain train` builds from the same options runs forward and backward on random tokens
// while the CPU engine records every GEMM with its time; each distinct GEMM is then timed alone
// (warm, best of 5). Printed: the step's GEMMs with both rates, their share of the step, and
// the limit in tokens/s that the step's GEMMs alone allow at their own best rates.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "bench_timing.h"
#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/text.h"
#include "dtrain/kernels/attention.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/kernels/gemm_record.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/train/config.h"
#include "dtrain/train/lm_trainer.h"

namespace dtrain::cli {

namespace {

struct GemmShape {
  GemmCall call;       // the shape; seconds: summed over its calls in the timed steps
  int64_t calls = 0;   // in the timed steps
  double alone_s = 0;  // one call alone
};

std::vector<GemmShape> group_by_shape(const std::vector<GemmCall>& calls) {
  std::vector<GemmShape> shapes;
  for (const GemmCall& c : calls) {
    auto it = std::find_if(shapes.begin(), shapes.end(), [&](const GemmShape& s) { return s.call.same_shape(c); });
    if (it == shapes.end())
      it = shapes.insert(shapes.end(), GemmShape{c, 0, 0});
    else
      it->call.seconds += c.seconds;
    ++it->calls;
  }
  return shapes;
}

// One call of `s` alone through the same engine entry point as in the step.
double time_alone(Engine& e, const GemmCall& s, int reps, Rng& rng) {
  const int64_t sa = s.m * s.k, sb = s.k * s.n, sc = s.m * s.n;
  Tensor a = Tensor::empty({s.batch * sa}), b = Tensor::empty({s.batch * sb}), c = Tensor::zeros({s.batch * sc});
  fill_uniform(a, rng);
  fill_uniform(b, rng);
  if (s.batched)
    return time_call([&] { e.gemm_batched(s.batch, s.ta, s.tb, s.m, s.n, s.k, 1.f, a, sa, b, sb, 0.f, c, sc); }, reps);
  return time_call([&] { e.gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a, b, 0.f, c); }, reps);
}

int64_t vocab_of(const train::TrainConfig& cfg) {
  if (cfg.vocab > 0) return cfg.vocab;
  return data::load_tokens((std::filesystem::path(cfg.data) / "train.h5").string()).vocab;
}

struct StepGemms {
  std::vector<GemmShape> shapes;  // the most FLOPs first
  int steps = 3;
  double step_s = 0;  // forward + backward
};

// `steps` forward and backward passes of `model` on random tokens (after one that allocates),
// recorded.
StepGemms record_steps(nn::Gpt& model, int64_t batch, int64_t len, Rng& rng) {
  const int64_t vocab = model.config().vocab;
  Tensor ids = Tensor::empty({batch, len}, DType::I32);
  for (int64_t i = 0; i < ids.numel(); ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
  Tensor dlogits = Tensor::empty({batch * len, vocab});
  fill_uniform(dlogits, rng);
  auto step = [&] {
    model.forward(ids);
    model.backward(dlogits);
  };
  step();
  StepGemms r;
  GemmRecording rec;
  const double t0 = now_s();
  for (int i = 0; i < r.steps; ++i) step();
  r.step_s = (now_s() - t0) / r.steps;
  r.shapes = group_by_shape(rec.calls());
  std::sort(r.shapes.begin(), r.shapes.end(),
            [](const GemmShape& x, const GemmShape& y) { return x.call.flop() * x.calls > y.call.flop() * y.calls; });
  return r;
}

// One row per shape (timed alone here), then the step's totals and its GEMM limit.
void report(StepGemms& r, double tokens, Engine& e, Rng& rng) {
  std::printf("%6s %6s %6s %6s %6s  %-7s %12s %16s %14s\n", "calls", "batch", "M", "N", "K", "op", "MFLOP/call",
              "in step GFLOP/s", "alone GFLOP/s");
  double flop = 0, in_step_s = 0, alone_s = 0;
  int64_t calls = 0;
  for (GemmShape& g : r.shapes) {
    g.alone_s = time_alone(e, g.call, 5, rng);
    const GemmCall& c = g.call;
    const double n = static_cast<double>(g.calls) / r.steps;  // calls a step
    flop += n * c.flop();
    in_step_s += c.seconds / r.steps;
    alone_s += n * g.alone_s;
    calls += g.calls / r.steps;
    std::printf("%6.0f %6lld %6lld %6lld %6lld  %s%s%-5s %12.2f %16.1f %14.1f\n", n, static_cast<long long>(c.batch),
                static_cast<long long>(c.m), static_cast<long long>(c.n), static_cast<long long>(c.k), c.ta ? "T" : "N",
                c.tb ? "T" : "N", c.batched ? " bat" : "", c.flop() * 1e-6, c.flop() * g.calls / c.seconds * 1e-9,
                c.flop() / g.alone_s * 1e-9);
  }
  std::printf("GEMMs: %.2f GFLOP a step (%.6g MFLOP per token), %lld calls\n", flop * 1e-9, flop / tokens * 1e-6,
              static_cast<long long>(calls));
  std::printf("forward + backward: %.3f s a step, %.0f tokens/s; of it the GEMMs %.3f s (%.0f %%, %.1f GFLOP/s)\n",
              r.step_s, tokens / r.step_s, in_step_s, 100 * in_step_s / r.step_s, flop / in_step_s * 1e-9);
  std::printf(
      "the same GEMMs alone: %.3f s (%.1f GFLOP/s): the GEMM limit is %.0f tokens/s; forward + backward "
      "reaches %.0f %% of it\n",
      alone_s, flop / alone_s * 1e-9, tokens / alone_s, 100 * alone_s / r.step_s);
}

}  // namespace

int cmd_bench_lm_gemm(int argc, char** argv) {
  train::TrainConfig cfg;
  if (!train::parse_train_config(argc, argv, cfg)) return 0;
  DT_INPUT_CHECK(train::is_language_model(cfg.model),
                 "dtrain bench lm-gemm: --model must be gpt or llama (or --model-file a language model), got '"
                     << cfg.model << "'");
  DT_INPUT_CHECK(cfg.device == "cpu", "dtrain bench lm-gemm: --device " << cfg.device << ": it times the CPU engine");
  DT_INPUT_CHECK(cfg.precision == "fp32",
                 "dtrain bench lm-gemm: --precision " << cfg.precision << ": it times fp32 GEMMs only");
  if (comm::Runtime::get().topology().rank != 0) return 0;
  const int threads = cfg.threads > 0 ? cfg.threads : 1;
  Engine& e = cpu_engine();
  e.set_threads(threads);
  const nn::GptConfig shape = train::lm_shape(cfg, vocab_of(cfg));
  const int64_t batch = cfg.batch_size, len = cfg.seq_len > 0 ? cfg.seq_len : shape.context;
  DT_INPUT_CHECK(len <= shape.context, "option --seq-len " << len << " exceeds the context " << shape.context);
  nn::Gpt model(shape);
  Rng rng(cfg.seed);
  StepGemms r = record_steps(model, batch, len, rng);
  std::printf(
      "GEMMs of one forward + backward: %s, %lld blocks of width %lld (%lld heads over %lld kv heads, MLP %lld, "
      "vocab %lld), %lld x %lld tokens, %d thread(s); attention %s%s\n",
      shape.llama() ? "llama" : "gpt", static_cast<long long>(shape.layers), static_cast<long long>(shape.width),
      static_cast<long long>(shape.heads), static_cast<long long>(shape.kv()), static_cast<long long>(shape.hidden()),
      static_cast<long long>(shape.vocab), static_cast<long long>(batch), static_cast<long long>(len), threads,
      attention_path(e).c_str(), attention_path(e) == "materialised" ? "" : " (its products are not GEMM calls)");
  report(r, static_cast<double>(batch * len), e, rng);
  return 0;
}

}  // namespace dtrain::cli

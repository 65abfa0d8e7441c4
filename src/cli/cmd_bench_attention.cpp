// dtrain bench attention: the attention op's forward and backward on one shape, fused against
// materialised on the same engine: milliseconds a call, GFLOP/s of the products a causal mask
// leaves (forward 2 products, backward 5: the recomputed scores, dV, dP, dK, dQ), and the bytes of
// the [B*H, Tq, Tk] scores the materialised path holds, which the fused one never makes.
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "bench_timing.h"
#include "commands.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/attention.h"
#include "dtrain/kernels/engine.h"

namespace po = boost::program_options;

namespace dtrain::cli {

int cmd_bench_attention(int argc, char** argv) {
  int64_t batch = 1, heads = 8, kv_heads = 2, t = 2048, d = 32;
  int threads = 1, reps = 3;
  bool bidirectional = false, skip_materialised = false;
  std::string dtype = "f32";
  po::options_description opts("dtrain bench attention");
  opts.add_options()("help,h", "this message")("batch", po::value(&batch)->default_value(1), "sequences")(
      "heads", po::value(&heads)->default_value(8), "query heads")(
      "kv-heads", po::value(&kv_heads)->default_value(2), "key/value heads (dividing --heads)")(
      "seq-len", po::value(&t)->default_value(2048), "tokens per sequence")(
      "head-dim", po::value(&d)->default_value(32), "head width")(
      "bidirectional", po::bool_switch(&bidirectional), "every query sees every key (default: causal)")(
      "dtype", po::value(&dtype)->default_value("f32"), "q, k, v: f32, bf16 or f16")(
      "no-materialised", po::bool_switch(&skip_materialised), "time the fused path only (long sequences)")(
      "threads", po::value(&threads)->default_value(1), "OpenMP threads")(
      "reps", po::value(&reps)->default_value(3), "timings per figure (the best is kept)");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  DT_INPUT_CHECK(batch > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && t > 0 && d > 0,
                 "dtrain bench attention: --heads " << heads << " over --kv-heads " << kv_heads << ", --seq-len " << t
                                                    << ", --head-dim " << d);
  DType dt = dtype == "bf16" ? DType::BF16 : dtype == "f16" ? DType::F16 : DType::F32;
  DT_INPUT_CHECK(dtype == "f32" || dt != DType::F32, "option --dtype: '" << dtype << "' is not f32, bf16 or f16");
  Engine& e = cpu_engine();
  e.set_threads(threads);
  const AttentionShape s{.batch = batch,
                         .heads = heads,
                         .kv_heads = kv_heads,
                         .q_len = t,
                         .kv_len = t,
                         .head_dim = d,
                         .causal = !bidirectional,
                         .scale = 1.f / std::sqrt(static_cast<float>(d))};
  Rng rng(1);
  const int64_t nq = batch * heads * t * d, nkv = batch * kv_heads * t * d;
  auto random = [&](int64_t n, DType type) {
    Tensor f = Tensor::empty({n});
    fill_uniform(f, rng);
    if (type == DType::F32) return f;
    Tensor low = Tensor::empty({n}, type);
    e.cast(f, low);
    return low;
  };
  Tensor q = random(nq, dt), k = random(nkv, dt), v = random(nkv, dt), dout = random(nq, DType::F32);
  Tensor out = Tensor::empty({nq}), lse = Tensor::empty({batch * heads * t}), dq = Tensor::empty({nq});
  Tensor dk = Tensor::empty({nkv}), dv = Tensor::empty({nkv});
  // Multiply-adds of one product over the pairs a query sees: t^2 (bidirectional) or t (t + 1) / 2.
  const double pairs = bidirectional ? static_cast<double>(t) * t : 0.5 * static_cast<double>(t) * (t + 1);
  const double product = 2 * pairs * static_cast<double>(batch * heads * d);
  std::printf("attention: batch %lld, %lld heads over %lld kv heads, %lld tokens, head width %lld, %s, %s, %d thread(s)\n",
              static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(kv_heads),
              static_cast<long long>(t), static_cast<long long>(d), bidirectional ? "bidirectional" : "causal",
              dtype_name(dt), threads);
  std::printf("%-34s %10s %10s %10s %10s\n", "path", "fwd ms", "fwd GF/s", "bwd ms", "bwd GF/s");
  auto row = [&](const std::string& name, const std::function<void()>& fwd, const std::function<void()>& bwd) {
    const double tf = time_call(fwd, reps), tb = time_call(bwd, reps);
    std::printf("%-34s %10.2f %10.1f %10.2f %10.1f\n", name.c_str(), tf * 1e3, 2 * product / tf * 1e-9, tb * 1e3,
                5 * product / tb * 1e-9);
  };
  FusedAttention* fused = e.fused_attention();
  DT_INPUT_CHECK(fused, "dtrain bench attention: " << e.describe() << " has no fused attention");
  fused->forward(s, q, k, v, out, lse);
  row(std::string("fused (") + fused->name() + " tiles)", [&] { fused->forward(s, q, k, v, out, lse); },
      [&] { fused->backward(s, q, k, v, out, lse, dout, dq, dk, dv); });
  if (!skip_materialised)
    row("materialised", [&] { materialized_attention_forward(e, s, q, k, v, out); },
        [&] { materialized_attention_backward(e, s, q, k, v, dout, dq, dk, dv); });
  std::printf("materialised scores: %.1f MiB per [B*H, T, T] f32 tensor (forward holds 2, backward 3)\n",
              static_cast<double>(batch * heads) * t * t * 4 / (1 << 20));
  return 0;
}

}  // namespace dtrain::cli

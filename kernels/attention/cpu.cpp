// The CPU engine's fused attention: checks the tensors, splits a call into tasks over OpenMP
// threads (forward: heads x query tiles, the longest causal tiles first; backward: query heads) with
// scratch of their own, and sums grouped-query heads' key/value gradients.
#include <omp.h>

#include <memory>
#include <vector>

#include "../cpu/cpu_engine.h"
#include "cpu_attention.h"
#include "dtrain/core/error.h"

namespace dtrain::attention_cpu {

size_t forward_scratch(const AttentionShape& s) {
  const int64_t dp = padded(s.head_dim);
  return static_cast<size_t>(2 * kQueryTile * dp + kQueryTile * kKeyTile + 2 * kQueryTile);
}

size_t backward_scratch(const AttentionShape& s) {
  const int64_t dp = padded(s.head_dim), tqp = query_tiles(s) * kQueryTile;
  return static_cast<size_t>(3 * tqp * dp + 2 * tqp + 2 * kKeyTile * dp + 2 * kQueryTile * kKeyTile);
}

const TileKernels& generic_tiles() { return generic::tiles(); }

const TileKernels* avx2_tiles() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok ? &avx2::tiles() : nullptr;
}

const TileKernels* avx512_tiles() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok ? &avx512::tiles() : nullptr;
}

const TileKernels& active_tiles() {
  static const TileKernels& k = avx512_tiles() ? *avx512_tiles() : avx2_tiles() ? *avx2_tiles() : generic_tiles();
  return k;
}

namespace {

// Runs task(i, scratch) for i in [0, n) across the OpenMP threads, each with `floats` of scratch.
template <typename F>
void parallel_tasks(int64_t n, size_t floats, F task) {
  const int threads = static_cast<int>(std::min<int64_t>(n, omp_get_max_threads()));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scratch(floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) task(i, scratch.data());
  }
}

class CpuFusedAttention final : public FusedAttention {
 public:
  explicit CpuFusedAttention(const TileKernels& k) : k_(k) {}
  const char* name() const override { return k_.name; }

  void forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
               Tensor& lse) override {
    check_attention_args(s, q, k, v, out);
    check_f32(lse, s.batch * s.heads * s.q_len, "lse");
    DT_CHECK(cpu::cpu_addressable(q), "fused attention on the CPU: q is on " << q.device().str());
    Problem p = problem(s, q, k, v);
    p.out = out.device_f32();
    p.lse = lse.device_f32();
    std::vector<float> packed = pack(p, false);
    const int64_t heads = s.batch * s.heads, tiles = query_tiles(s);
    parallel_tasks(heads * tiles, forward_scratch(s), [&](int64_t i, float* scratch) {
      k_.forward_tile(p, i % heads, tiles - 1 - i / heads, scratch);  // the longest tiles first
    });
  }

  void backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    check_attention_args(s, q, k, v, out);
    check_f32(lse, s.batch * s.heads * s.q_len, "lse");
    check_f32(dout, q.numel(), "dout");
    check_f32(dq, q.numel(), "dq");
    const int64_t kv_dense = s.batch * s.kv_heads * s.kv_len * s.head_dim;
    check_f32(dk, kv_dense, "dk");
    check_f32(dv, kv_dense, "dv");
    DT_CHECK(cpu::cpu_addressable(q), "fused attention on the CPU: q is on " << q.device().str());
    Problem p = problem(s, q, k, v);
    p.o = out.device_f32();
    p.lse_in = lse.device_f32();
    p.dout = dout.device_f32();
    p.dq = dq.device_f32();
    std::vector<float> packed = pack(p, true);
    const int64_t g = s.group(), per_head = s.batch * s.heads * s.kv_len * s.head_dim;
    std::vector<float> partial(g > 1 ? 2 * static_cast<size_t>(per_head) : 0);
    p.per_head = g > 1;
    p.dk = g > 1 ? partial.data() : dk.device_f32();
    p.dv = g > 1 ? partial.data() + per_head : dv.device_f32();
    parallel_tasks(s.batch * s.heads, backward_scratch(s),
                   [&](int64_t bh, float* scratch) { k_.backward_head(p, bh, scratch); });
    if (g > 1) sum_groups(s, partial.data(), dk.device_f32(), partial.data() + per_head, dv.device_f32());
  }

 private:
  const TileKernels& k_;

  // k and v in the tiles' layouts (Problem::k_rows ...), every key/value head in parallel.
  std::vector<float> pack(Problem& p, bool rows) const {
    const int64_t heads = p.s.batch * p.s.kv_heads, block = p.kv_block();
    std::vector<float> packed(static_cast<size_t>((rows ? 4 : 2) * heads * block));
    p.k_tiles = packed.data();
    p.v_rows = p.k_tiles + heads * block;
    if (rows) {
      p.k_rows = p.v_rows + heads * block;
      p.v_tiles = p.k_rows + heads * block;
    }
    parallel_tasks(heads, 0, [&](int64_t kv, float*) { k_.pack_kv(p, kv, rows); });
    return packed;
  }

  static Problem problem(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v) {
    Problem p;
    p.s = s;
    p.dtype = q.dtype();
    p.q = q.device_raw();
    p.k = k.device_raw();
    p.v = v.device_raw();
    return p;
  }

  static void check_f32(const Tensor& t, int64_t numel, const char* what) {
    DT_CHECK(t.defined() && t.dtype() == DType::F32 && t.numel() == numel && cpu::cpu_addressable(t),
             "fused attention: " << what << " must be an f32 tensor of " << numel << " elements on the host, got "
                                 << (t.defined() ? t.str() : "undefined"));
  }

  // dk[b, kv] = sum over the group's query heads h of their partial rows [B*H, Tk, D].
  static void sum_groups(const AttentionShape& s, const float* pk, float* dk, const float* pv, float* dv) {
    const int64_t g = s.group(), n = s.kv_len * s.head_dim, kv = s.batch * s.kv_heads;
#pragma omp parallel for if (kv * n * g > (1 << 16))
    for (int64_t i = 0; i < kv; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float sk = 0, sv = 0;
        for (int64_t h = 0; h < g; ++h) {
          sk += pk[(i * g + h) * n + j];
          sv += pv[(i * g + h) * n + j];
        }
        dk[i * n + j] = sk;
        dv[i * n + j] = sv;
      }
  }
};

}  // namespace

std::unique_ptr<FusedAttention> cpu_fused_attention(const TileKernels& tiles) {
  return std::make_unique<CpuFusedAttention>(tiles);
}

}  // namespace dtrain::attention_cpu

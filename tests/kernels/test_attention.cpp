// The attention family: the CPU's fused tiles (every instruction-set table the processor runs)
// against the materialised path, forward (out, and lse against a double-precision sum) and
// backward (dq, dk, dv), over sequence lengths with partial tiles, head widths, grouped-query
// ratios, causal and not; bf16 and f16 inputs; views at odd offsets; a cached decoding step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../../kernels/attention/cpu_attention.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/attention.h"
#include "dtrain/kernels/engine.h"

using namespace dtrain;
namespace acpu = dtrain::attention_cpu;

namespace {

Tensor random_tensor(int64_t n, uint64_t seed, float range = 1.f) {
  Rng rng(seed);
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = rng.uniform(-range, range);
  return t;
}

// max over i of |got - want| / max(1, |want|).
double worst_error(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.numel(), want.numel());
  double worst = 0;
  const float *g = got.f32(), *w = want.f32();
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::abs(static_cast<double>(g[i]) - w[i]) / std::max(1.0, std::abs(static_cast<double>(w[i])));
    if (!(err <= worst)) worst = err;
  }
  return worst;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::equal(a.f32(), a.f32() + a.numel(), b.f32());
}

// lse in double precision, from the shape's definition, of every 13th query row of each head and
// its last (a partial tile's end): (row of [B*H*Tq], lse) pairs.
std::vector<std::pair<int64_t, double>> lse_reference(const AttentionShape& s, const Tensor& q, const Tensor& k) {
  std::vector<std::pair<int64_t, double>> out;
  const int64_t d = s.head_dim;
  const float *pq = q.f32(), *pk = k.f32();
  for (int64_t bh = 0; bh < s.batch * s.heads; ++bh) {
    const int64_t kv = bh / s.heads * s.kv_heads + bh % s.heads / s.group();
    for (int64_t i = 0; i < s.q_len; i = i + 13 < s.q_len || i == s.q_len - 1 ? i + 13 : s.q_len - 1) {
      const int64_t last = s.causal ? s.q_offset + i : s.kv_len - 1;
      std::vector<double> x;
      for (int64_t j = 0; j <= last; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c)
          dot += static_cast<double>(pq[(bh * s.q_len + i) * d + c]) * pk[kv * s.kv_head_stride() + j * d + c];
        x.push_back(dot * s.scale);
      }
      const double m = *std::max_element(x.begin(), x.end());
      double sum = 0;
      for (double v : x) sum += std::exp(v - m);
      out.emplace_back(bh * s.q_len + i, m + std::log(sum));
    }
  }
  return out;
}

struct Inputs {
  AttentionShape s;
  Tensor q, k, v, dout;
};

Inputs make_inputs(int64_t batch, int64_t heads, int64_t kv_heads, int64_t t, int64_t d, bool causal, uint64_t seed) {
  Inputs in;
  in.s = {.batch = batch,
          .heads = heads,
          .kv_heads = kv_heads,
          .q_len = t,
          .kv_len = t,
          .head_dim = d,
          .causal = causal,
          .scale = 1.f / std::sqrt(static_cast<float>(d))};
  const int64_t nq = batch * heads * t * d, nkv = batch * kv_heads * t * d;
  // Scores of a few units: the softmax is neither flat nor one-hot.
  in.q = random_tensor(nq, seed, 2.f);
  in.k = random_tensor(nkv, seed + 1, 2.f);
  in.v = random_tensor(nkv, seed + 2);
  in.dout = random_tensor(nq, seed + 3);
  return in;
}

struct Result {
  Tensor out, lse, dq, dk, dv;
};

Result run_fused(FusedAttention& f, const Inputs& in) {
  const AttentionShape& s = in.s;
  Result r{Tensor::empty({in.q.numel()}), Tensor::empty({s.batch * s.heads * s.q_len}), Tensor::empty({in.q.numel()}),
           Tensor::empty({in.k.numel()}), Tensor::empty({in.v.numel()})};
  f.forward(s, in.q, in.k, in.v, r.out, r.lse);
  f.backward(s, in.q, in.k, in.v, r.out, r.lse, in.dout, r.dq, r.dk, r.dv);
  return r;
}

Result run_materialised(const Inputs& in) {
  Engine& e = cpu_engine();
  Result r{Tensor::empty({in.q.numel()}), Tensor(), Tensor::empty({in.q.numel()}), Tensor::empty({in.k.numel()}),
           Tensor::empty({in.v.numel()})};
  materialized_attention_forward(e, in.s, in.q, in.k, in.v, r.out);
  materialized_attention_backward(e, in.s, in.q, in.k, in.v, in.dout, r.dq, r.dk, r.dv);
  return r;
}

// Every table this processor runs, each a FusedAttention of its own.
std::vector<std::unique_ptr<FusedAttention>> tables() {
  std::vector<std::unique_ptr<FusedAttention>> t;
  t.push_back(acpu::cpu_fused_attention(acpu::generic_tiles()));
  if (acpu::avx2_tiles()) t.push_back(acpu::cpu_fused_attention(*acpu::avx2_tiles()));
  if (acpu::avx512_tiles()) t.push_back(acpu::cpu_fused_attention(*acpu::avx512_tiles()));
  return t;
}

constexpr double kTol = 1e-5;

struct Case {
  int64_t t, d;
};

class FusedVsMaterialised : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST(FusedAttention, EveryTableTheProcessorHasIsTested) {
  const auto t = tables();
  std::string names;
  for (const auto& f : t) names += std::string(f->name()) + " ";
  std::printf("attention tile tables run here: %s(the engine's: %s)\n", names.c_str(),
              cpu_engine().fused_attention()->name());
  EXPECT_GE(t.size(), 1u);
  EXPECT_STREQ(cpu_engine().fused_attention()->name(), t.back()->name());
}

// Outputs and gradients within 1e-5 of the materialised path, lse within 1e-5 of a double sum (rows
// sampled), for kv groups 1, 2, 4, 8 (heads = the group: one key/value head), causal and not.
TEST_P(FusedVsMaterialised, OutputsAndGradients) {
  const Case c = GetParam();
  const auto fused = tables();
  for (bool causal : {true, false})
    for (int64_t group : {1, 2, 4, 8}) {
      const Inputs in = make_inputs(1, group, 1, c.t, c.d, causal, 100 + c.t + c.d + group);
      const Result want = run_materialised(in);
      const auto lse = lse_reference(in.s, in.q, in.k);
      for (const auto& f : fused) {
        SCOPED_TRACE(std::string(f->name()) + " T=" + std::to_string(c.t) + " D=" + std::to_string(c.d) +
                     " group=" + std::to_string(group) + (causal ? " causal" : " bidirectional"));
        const Result got = run_fused(*f, in);
        EXPECT_LE(worst_error(got.out, want.out), kTol);
        EXPECT_LE(worst_error(got.dq, want.dq), kTol);
        EXPECT_LE(worst_error(got.dk, want.dk), kTol);
        EXPECT_LE(worst_error(got.dv, want.dv), kTol);
        double worst = 0;
        for (const auto& [row, want_lse] : lse) worst = std::max(worst, std::abs(got.lse.f32()[row] - want_lse));
        EXPECT_LE(worst, kTol);
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedVsMaterialised,
                         ::testing::Values(Case{1, 32}, Case{17, 32}, Case{256, 32}, Case{1000, 32}, Case{1, 64},
                                           Case{17, 64}, Case{256, 64}, Case{1000, 64}, Case{1, 128}, Case{17, 128},
                                           Case{256, 128}, Case{1000, 128}, Case{70, 40}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.t) + "_D" + std::to_string(info.param.d);
                         });

// Two sequences of 4 query heads over 2 key/value heads: each batch's and group's rows in place.
TEST(FusedAttention, BatchesAndSeveralKeyValueHeads) {
  for (bool causal : {true, false}) {
    const Inputs in = make_inputs(2, 4, 2, 130, 32, causal, 7);
    const Result want = run_materialised(in);
    for (const auto& f : tables()) {
      SCOPED_TRACE(f->name());
      const Result got = run_fused(*f, in);
      EXPECT_LE(worst_error(got.out, want.out), kTol);
      EXPECT_LE(worst_error(got.dq, want.dq), kTol);
      EXPECT_LE(worst_error(got.dk, want.dk), kTol);
      EXPECT_LE(worst_error(got.dv, want.dv), kTol);
    }
  }
}

// bf16 and f16 heads are read into f32: the results are bitwise those of f32 heads holding the
// same (rounded) values.
TEST(FusedAttention, LowPrecisionInputsAreWidenedExactly) {
  for (DType low : {DType::BF16, DType::F16}) {
    Inputs in = make_inputs(1, 4, 2, 90, 64, true, 11);
    Inputs lowin = in;
    for (Tensor* t : {&in.q, &in.k, &in.v}) {
      Tensor l = Tensor::empty(t->shape(), low);
      cpu_engine().cast(*t, l);
      cpu_engine().cast(l, *t);  // the f32 inputs now hold the rounded values
      (t == &in.q ? lowin.q : t == &in.k ? lowin.k : lowin.v) = l;
    }
    FusedAttention& f = *cpu_engine().fused_attention();
    const Result wide = run_fused(f, in), narrow = run_fused(f, lowin);
    EXPECT_TRUE(bitwise_equal(narrow.out, wide.out)) << dtype_name(low);
    EXPECT_TRUE(bitwise_equal(narrow.lse, wide.lse)) << dtype_name(low);
    EXPECT_TRUE(bitwise_equal(narrow.dq, wide.dq)) << dtype_name(low);
    EXPECT_TRUE(bitwise_equal(narrow.dk, wide.dk)) << dtype_name(low);
    EXPECT_TRUE(bitwise_equal(narrow.dv, wide.dv)) << dtype_name(low);
  }
}

// Views that start at odd element offsets give the same bits as fresh tensors.
TEST(FusedAttention, ViewsAtOddOffsets) {
  const Inputs in = make_inputs(1, 2, 1, 77, 48, true, 21);
  auto offset_copy = [](const Tensor& t) {
    Tensor big = Tensor::empty({t.numel() + 3});
    Tensor view = big.slice0(3, 3 + t.numel());
    view.copy_from(t);
    return view;
  };
  Inputs moved = in;
  moved.q = offset_copy(in.q);
  moved.k = offset_copy(in.k);
  moved.v = offset_copy(in.v);
  moved.dout = offset_copy(in.dout);
  FusedAttention& f = *cpu_engine().fused_attention();
  const Result a = run_fused(f, in);
  Result b{offset_copy(a.out), offset_copy(a.lse), offset_copy(a.dq), offset_copy(a.dk), offset_copy(a.dv)};
  f.forward(moved.s, moved.q, moved.k, moved.v, b.out, b.lse);
  f.backward(moved.s, moved.q, moved.k, moved.v, b.out, b.lse, moved.dout, b.dq, b.dk, b.dv);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
}

// One cached decoding step: query position p over a cache of capacity C (key/value heads C*D
// apart) holding p + 1 keys equals row p of the whole sequence's attention, and the materialised
// decoding step.
TEST(FusedAttention, CachedDecodingStepIsTheSequencesLastRow) {
  const int64_t heads = 4, kvh = 2, d = 32, t = 70, capacity = 96;
  const Inputs whole = make_inputs(1, heads, kvh, t, d, true, 31);
  FusedAttention& f = *cpu_engine().fused_attention();
  Tensor out = Tensor::empty({whole.q.numel()}), lse = Tensor::empty({heads * t});
  f.forward(whole.s, whole.q, whole.k, whole.v, out, lse);
  for (int64_t p : {0L, 1L, 63L, 64L, 69L}) {
    AttentionShape s = whole.s;
    s.q_len = 1;
    s.kv_len = p + 1;
    s.kv_stride = capacity * d;
    s.q_offset = p;
    Tensor q = Tensor::empty({heads * d}), kc = Tensor::zeros({kvh * capacity * d}), vc = Tensor::zeros({kvh * capacity * d});
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(whole.q.f32() + (h * t + p) * d, d, q.f32() + h * d);
    for (int64_t h = 0; h < kvh; ++h) {
      std::copy_n(whole.k.f32() + h * t * d, (p + 1) * d, kc.f32() + h * capacity * d);
      std::copy_n(whole.v.f32() + h * t * d, (p + 1) * d, vc.f32() + h * capacity * d);
    }
    Tensor step = Tensor::empty({heads * d}), step_lse = Tensor::empty({heads}), mat = Tensor::empty({heads * d});
    f.forward(s, q, kc, vc, step, step_lse);
    materialized_attention_forward(cpu_engine(), s, q, kc, vc, mat);
    Tensor row = Tensor::empty({heads * d}), row_lse = Tensor::empty({heads});
    for (int64_t h = 0; h < heads; ++h) {
      std::copy_n(out.f32() + (h * t + p) * d, d, row.f32() + h * d);
      row_lse.f32()[h] = lse.f32()[h * t + p];
    }
    EXPECT_LE(worst_error(step, row), 1e-6) << "position " << p;
    EXPECT_LE(worst_error(step_lse, row_lse), 1e-6) << "position " << p;
    EXPECT_LE(worst_error(step, mat), kTol) << "position " << p;
  }
}

// A block of queries at an offset (a prompt's later chunk over the cache) gives the rows of the
// whole sequence's causal attention; queries over more keys than themselves, bidirectional (as a
// cross-attention), the materialised forward's result.
TEST(FusedAttention, QueriesAtAnOffsetAndUnequalLengths) {
  const int64_t heads = 4, kvh = 1, d = 32, t = 150;
  const Inputs whole = make_inputs(1, heads, kvh, t, d, true, 51);
  FusedAttention& f = *cpu_engine().fused_attention();
  Tensor out = Tensor::empty({whole.q.numel()}), lse = Tensor::empty({heads * t});
  f.forward(whole.s, whole.q, whole.k, whole.v, out, lse);
  const int64_t first = 70, n = 45;  // queries 70 .. 114 over keys 0 .. 114
  AttentionShape s = whole.s;
  s.q_len = n;
  s.kv_len = first + n;
  s.kv_stride = t * d;
  s.q_offset = first;
  Tensor q = Tensor::empty({heads * n * d}), part = Tensor::empty({heads * n * d}), part_lse = Tensor::empty({heads * n});
  Tensor want = Tensor::empty({heads * n * d});
  for (int64_t h = 0; h < heads; ++h) {
    std::copy_n(whole.q.f32() + (h * t + first) * d, n * d, q.f32() + h * n * d);
    std::copy_n(out.f32() + (h * t + first) * d, n * d, want.f32() + h * n * d);
  }
  f.forward(s, q, whole.k, whole.v, part, part_lse);
  EXPECT_LE(worst_error(part, want), 1e-6);
  s.causal = false;
  s.q_offset = 0;
  Tensor mat = Tensor::empty({heads * n * d});
  f.forward(s, q, whole.k, whole.v, part, part_lse);
  materialized_attention_forward(cpu_engine(), s, q, whole.k, whole.v, mat);
  EXPECT_LE(worst_error(part, mat), kTol);
}

TEST(FusedAttention, WrongShapesAreRefusedByName) {
  Inputs in = make_inputs(1, 2, 1, 8, 16, true, 41);
  FusedAttention& f = *cpu_engine().fused_attention();
  Tensor out = Tensor::empty({in.q.numel()}), lse = Tensor::empty({2 * 8});
  Tensor short_out = Tensor::empty({in.q.numel() - 1});
  EXPECT_THROW(
      {
        try {
          f.forward(in.s, in.q, in.k, in.v, short_out, lse);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("out must be"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  AttentionShape bad = in.s;
  bad.kv_heads = 3;  // does not divide 2 heads
  EXPECT_THROW(f.forward(bad, in.q, in.k, in.v, out, lse), Error);
  Tensor k16 = Tensor::empty(in.k.shape(), DType::BF16);
  EXPECT_THROW(f.forward(in.s, in.q, k16, in.v, out, lse), Error);  // mixed dtypes
}

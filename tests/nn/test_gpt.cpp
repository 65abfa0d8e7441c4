// GPT pieces against finite differences, the engine's transformer ops against direct formulas,
// and causality (no position sees a later one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "dtrain/nn/gpt.h"
#include "dtrain/nn/quantized.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::dot;
using dtrain::test::gradcheck;
using dtrain::test::random_tensor;

namespace {
nn::GptConfig tiny_gpt(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t width, uint64_t seed) {
  nn::GptConfig cfg;
  cfg.vocab = vocab;
  cfg.context = context;
  cfg.layers = layers;
  cfg.heads = heads;
  cfg.width = width;
  cfg.seed = seed;
  return cfg;
}
}  // namespace

TEST(TransformerOps, PermuteAndCausalSoftmaxByDefinition) {
  Rng rng(3);
  Engine& e = cpu_engine();
  Tensor x = random_tensor({2, 3, 4, 5}, rng), y = Tensor::zeros({2, 4, 3, 5}), back = Tensor::zeros({2, 3, 4, 5});
  e.permute_0213(x, 2, 3, 4, 5, y);
  EXPECT_EQ(y.f32()[((1 * 4 + 2) * 3 + 1) * 5 + 3], x.f32()[((1 * 3 + 1) * 4 + 2) * 5 + 3]);
  e.permute_0213(y, 2, 4, 3, 5, back);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(back.f32()[i], x.f32()[i]);

  const int64_t t = 4;
  Tensor s = random_tensor({2, t, t}, rng), p = Tensor::zeros({2, t, t});
  e.attention_softmax_forward(s, t, 0.5f, true, p);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t i = 0; i < t; ++i) {
      const float* srow = s.f32() + (n * t + i) * t;
      const float* prow = p.f32() + (n * t + i) * t;
      double z = 0;
      for (int64_t j = 0; j <= i; ++j) z += std::exp(0.5 * srow[j]);
      for (int64_t j = 0; j < t; ++j) EXPECT_NEAR(prow[j], j <= i ? std::exp(0.5 * srow[j]) / z : 0.0, 1e-6);
    }
}

TEST(TransformerOps, EmbeddingWithOffsetSkipsOtherRows) {
  Engine& e = cpu_engine();
  Tensor table = Tensor::from({2, 3}, {1, 2, 3, 4, 5, 6});  // vocabulary rows 10 and 11
  Tensor ids = Tensor::empty({3}, DType::I32);
  ids.data<int32_t>()[0] = 11;
  ids.data<int32_t>()[1] = 3;
  ids.data<int32_t>()[2] = 11;
  Tensor y = Tensor::full({3, 3}, 9.f);
  e.embedding_forward(ids, table, 10, y);
  std::vector<float> want{4, 5, 6, 0, 0, 0, 4, 5, 6};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(y.f32()[i], want[i]);
  Tensor dt = Tensor::zeros({2, 3});
  e.embedding_backward(ids, Tensor::full({3, 3}, 1.f), 10, dt);
  std::vector<float> dwant{0, 0, 0, 2, 2, 2};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dt.f32()[i], dwant[i]);
}

TEST(Gradients, SelfAttention) {
  Rng rng(21);
  nn::SelfAttention attn(8, 2, rng);
  gradcheck(attn, random_tensor({2, 5, 8}, rng), 7, 1e-2f, 3e-2, 32);
}

TEST(Gradients, SelfAttentionIsCausal) {
  Rng rng(22);
  nn::SelfAttention attn(8, 2, rng);
  Tensor x = random_tensor({1, 6, 8}, rng);
  Tensor y0 = attn.forward(x).clone();
  x.f32()[4 * 8 + 3] += 1.f;  // change position 4
  Tensor y1 = attn.forward(x);
  for (int64_t i = 0; i < 4 * 8; ++i) EXPECT_EQ(y1.f32()[i], y0.f32()[i]) << "position " << i / 8;
  double moved = 0;
  for (int64_t i = 4 * 8; i < 6 * 8; ++i) moved += std::abs(y1.f32()[i] - y0.f32()[i]);
  EXPECT_GT(moved, 1e-4);
}

TEST(Gradients, GptBlock) {
  Rng rng(23);
  nn::ModulePtr block = nn::make_gpt_block(8, 2, rng);
  gradcheck(*block, random_tensor({2, 4, 8}, rng), 7, 1e-2f, 3e-2, 16);
}

// The whole model: L = sum(logits * r), every parameter (a tied wte included) against central
// differences, and the grad-ready hook fires once per parameter.
void check_model_end_to_end(const nn::GptConfig& cfg) {
  nn::Gpt gpt(cfg);
  Rng rng(24);
  // GPT-2's N(0, 0.02) embeddings put the first norm where a finite-difference step of 1e-2 is
  // far from linear; unit-scale embeddings keep the check meaningful.
  for (nn::Parameter* p : gpt.parameters())
    if (p->name == "wte" || p->name == "wpe")
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = rng.normal();
  const int64_t b = 2, t = 5;
  Tensor ids = Tensor::empty({b, t}, DType::I32);
  for (int64_t i = 0; i < b * t; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(cfg.vocab));
  Tensor r = random_tensor({b * t, cfg.vocab}, rng);
  std::map<std::string, int> fired;
  gpt.set_grad_ready_hook([&](nn::Parameter& p) { ++fired[p.name]; });
  for (nn::Parameter* p : gpt.parameters()) p->grad.zero_();
  gpt.forward(ids);
  gpt.backward(r);
  auto loss = [&]() { return dot(gpt.forward(ids), r); };
  const float eps = 1e-2f;
  for (nn::Parameter* p : gpt.parameters()) {
    EXPECT_EQ(fired[p->name], 1) << p->name;
    double scale = 1e-3;
    for (int64_t i = 0; i < p->grad.numel(); ++i) scale = std::max(scale, std::abs((double)p->grad.f32()[i]));
    for (int s = 0; s < 6; ++s) {
      int64_t i = static_cast<int64_t>(rng.below(static_cast<uint64_t>(p->value.numel())));
      float keep = p->value.f32()[i];
      p->value.f32()[i] = keep + eps;
      double up = loss();
      p->value.f32()[i] = keep - eps;
      double down = loss();
      p->value.f32()[i] = keep;
      EXPECT_NEAR((up - down) / (2.0 * eps), p->grad.f32()[i], 3e-2 * scale) << p->name << " at " << i;
    }
  }
}

TEST(Gradients, GptEndToEndWithTiedEmbedding) {
  nn::GptConfig cfg = tiny_gpt(11, 6, 2, 2, 8, 5);
  check_model_end_to_end(cfg);
  // Positions past T get no gradient; tied wte gets both the embedding and the unembedding parts.
  nn::Gpt gpt(cfg);
  Tensor ids = Tensor::zeros({1, 5}, DType::I32);
  gpt.forward(ids);
  gpt.backward(Tensor::full({5, cfg.vocab}, 1.f));
  nn::Parameter* wpe = gpt.parameters()[1];
  ASSERT_EQ(wpe->name, "wpe");
  for (int64_t i = 5 * cfg.width; i < wpe->grad.numel(); ++i) EXPECT_EQ(wpe->grad.f32()[i], 0.f);
  double moved = 0;
  for (int64_t i = 0; i < 5 * cfg.width; ++i) moved += std::abs(wpe->grad.f32()[i]);
  EXPECT_GT(moved, 0.0);
}

// A Llama: RMSNorm, rotary positions, SwiGLU, 2 key/value heads for 4 query heads, no biases, an
// untied output layer ("lm_head"), no position table.
TEST(Gradients, LlamaEndToEnd) {
  nn::GptConfig cfg = tiny_gpt(11, 6, 2, 4, 8, 5);
  cfg.kv_heads = 2;
  cfg.mlp_width = 12;
  nn::llama_shape(cfg);
  check_model_end_to_end(cfg);
  nn::Gpt llama(cfg);
  std::vector<std::string> names;
  for (nn::Parameter* p : llama.parameters()) names.push_back(p->name);
  EXPECT_EQ(std::count(names.begin(), names.end(), "wpe"), 0);
  EXPECT_EQ(std::count(names.begin(), names.end(), "lm_head"), 1);
  EXPECT_EQ(llama.parameter_count(), nn::gpt_parameter_count(cfg));
}

// GELU's tanh goes through one expf (fn::tanh_via_exp): against std::tanh in double precision.
// The vocabulary-parallel cross-entropy pieces over two column slices, combined as two ranks
// would (max of the row maxima, sums of the rest), give the loss and gradient of the whole row.
TEST(TransformerOps, VocabParallelCrossEntropyPiecesAddUpToTheFullLoss) {
  Engine& e = cpu_engine();
  const int64_t m = 7, v = 10, half = 5;
  Rng rng(12);
  Tensor logits = random_tensor({m, v}, rng), labels = Tensor::empty({m}, DType::I32);
  for (int64_t i = 0; i < m; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>(rng.below(v));
  Tensor probs = Tensor::empty({m, v}), dfull = Tensor::empty({m, v});
  int64_t hits = 0;
  const double loss = e.softmax_xent_forward(logits, labels, probs, &hits);
  e.softmax_xent_backward(probs, labels, 0.25f, dfull);
  Tensor slice[2], mx[2];
  for (int r = 0; r < 2; ++r) {
    slice[r] = Tensor::empty({m, half});
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < half; ++j) slice[r].f32()[i * half + j] = logits.f32()[i * v + r * half + j];
    mx[r] = Tensor::empty({m});
    e.row_max(slice[r], mx[r]);
  }
  Tensor gmax = Tensor::empty({m});
  for (int64_t i = 0; i < m; ++i) gmax.f32()[i] = std::max(mx[0].f32()[i], mx[1].f32()[i]);
  Tensor se[2], tg[2];
  for (int r = 0; r < 2; ++r) {
    se[r] = Tensor::empty({m});
    tg[r] = Tensor::empty({m});
    e.vocab_xent_partials(slice[r], labels, r * half, gmax, se[r], tg[r]);
  }
  Tensor total = Tensor::empty({m});
  double got = 0;
  for (int64_t i = 0; i < m; ++i) {
    total.f32()[i] = se[0].f32()[i] + se[1].f32()[i];
    got += std::log(total.f32()[i]) + gmax.f32()[i] - (tg[0].f32()[i] + tg[1].f32()[i]);
  }
  EXPECT_NEAR(got, loss, 1e-5 * std::abs(loss));
  // The engine's own sum of the rows' losses (what a step adds into its statistics on the device).
  Tensor tsum = Tensor::empty({m}), stats = Tensor::zeros({kXentStatsFloats});
  for (int64_t i = 0; i < m; ++i) tsum.f32()[i] = tg[0].f32()[i] + tg[1].f32()[i];
  e.vocab_xent_loss_accumulate(gmax, total, tsum, labels, stats);
  e.vocab_xent_loss_accumulate(gmax, total, tsum, labels, stats);
  EXPECT_NEAR(xent_stats(stats).loss_sum, 2 * loss, 1e-5 * std::abs(loss));
  EXPECT_EQ(xent_stats(stats).hits, static_cast<uint64_t>(2 * hits));  // the target's logit is the row's maximum
  for (int r = 0; r < 2; ++r) {
    Tensor d = Tensor::empty({m, half});
    e.vocab_xent_backward(slice[r], labels, r * half, gmax, total, 0.25f, d);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < half; ++j)
        EXPECT_NEAR(d.f32()[i * half + j], dfull.f32()[i * v + r * half + j], 1e-6) << r << " " << i << " " << j;
  }
}

// The head fused with its cross-entropy (score_next; chunks of 7 of 34 rows, every fifth target
// ignored) gives the loss, the hits and every gradient of the whole logits' SoftmaxCrossEntropy
// within 1e-5, tied (GPT) and untied (Llama); evaluating gives the same loss; without targets the
// next forward gives logits again.
TEST(ScoringHead, LossAndGradientsOfTheWholeLogits) {
  for (bool llama : {false, true}) {
    nn::GptConfig cfg = tiny_gpt(37, 20, 2, 4, 16, 3);
    if (llama) {
      cfg.kv_heads = 2;
      cfg.mlp_width = 24;
      nn::llama_shape(cfg);
    }
    cfg.head_chunk_rows = 7;
    nn::Gpt whole(cfg), scored(cfg);
    const int64_t b = 2, t = 17;
    Rng rng(5);
    Tensor ids = Tensor::empty({b, t}, DType::I32), targets = Tensor::empty({b * t}, DType::I32);
    for (int64_t i = 0; i < b * t; ++i) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(cfg.vocab));
      targets.data<int32_t>()[i] = i % 5 == 4 ? kIgnoreLabel : static_cast<int32_t>(rng.below(cfg.vocab));
    }
    std::map<std::string, int> fired;
    scored.set_grad_ready_hook([&](nn::Parameter& p) { ++fired[p.name]; });
    for (nn::Gpt* m : {&whole, &scored})
      for (nn::Parameter* p : m->parameters()) p->grad.zero_();
    nn::SoftmaxCrossEntropy logits_loss;
    nn::HeadCrossEntropy head_loss;
    Tensor want = Tensor::zeros({kXentStatsFloats}), got = Tensor::zeros({kXentStatsFloats});
    logits_loss.accumulate(whole.forward(ids), targets, want);
    whole.backward(logits_loss.backward(0.5f));
    scored.score_next(targets);
    const Tensor rows = scored.forward(ids);
    EXPECT_EQ(rows.shape(), (Shape{3, b * t}));
    head_loss.accumulate(rows, targets, got);
    scored.backward(head_loss.backward(0.5f));
    EXPECT_NEAR(xent_stats(got).loss_sum, xent_stats(want).loss_sum, 1e-5 * xent_stats(want).loss_sum);
    EXPECT_EQ(xent_stats(got).hits, xent_stats(want).hits);
    const auto ref = whole.parameters();
    const auto params = scored.parameters();
    ASSERT_EQ(ref.size(), params.size());
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_EQ(fired[params[k]->name], 1) << params[k]->name;
      double top = 1e-3, worst = 0;
      for (int64_t i = 0; i < ref[k]->grad.numel(); ++i) {
        top = std::max(top, std::abs(static_cast<double>(ref[k]->grad.f32()[i])));
        worst = std::max(worst, std::abs(static_cast<double>(ref[k]->grad.f32()[i] - params[k]->grad.f32()[i])));
      }
      EXPECT_LE(worst, 1e-5 * top) << (llama ? "llama " : "gpt ") << params[k]->name;
    }
    // Evaluating (no gradients made) gives the same statistics; without targets, logits again.
    scored.eval();
    scored.score_next(targets);
    Tensor again = Tensor::zeros({kXentStatsFloats});
    head_loss.accumulate(scored.forward(ids), targets, again);
    EXPECT_EQ(xent_stats(again).loss_sum, xent_stats(got).loss_sum);
    EXPECT_EQ(scored.forward(ids).shape(), (Shape{b * t, cfg.vocab}));
  }
}

// Row softmax at a temperature (distillation's), against the formula in double precision.
TEST(TransformerOps, SoftmaxRowsAtATemperature) {
  Rng rng(13);
  Tensor x = random_tensor({5, 9}, rng), y = Tensor::empty({5, 9});
  for (int64_t i = 0; i < 9; ++i) x.f32()[i] = 80.f + static_cast<float>(i);  // large: needs the max shift
  cpu_engine().softmax_rows(x, 0.5f, y);
  for (int64_t i = 0; i < 5; ++i) {
    const float* row = x.f32() + i * 9;
    const double mx = 0.5 * *std::max_element(row, row + 9);
    double sum = 0;
    for (int64_t j = 0; j < 9; ++j) sum += std::exp(0.5 * row[j] - mx);
    double total = 0;
    for (int64_t j = 0; j < 9; ++j) {
      const double want = std::exp(0.5 * row[j] - mx) / sum;
      EXPECT_NEAR(y.f32()[i * 9 + j], want, 1e-6) << i << " " << j;
      total += y.f32()[i * 9 + j];
    }
    EXPECT_NEAR(total, 1.0, 1e-6);
  }
}

TEST(TransformerOps, GeluMatchesTheTanhFormula) {
  Tensor x = Tensor::empty({4001}), y = Tensor::zeros({4001}), dx = Tensor::zeros({4001});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = -10.f + 0.005f * static_cast<float>(i);
  cpu_engine().unary_forward(Unary::Gelu, x, y);
  cpu_engine().unary_backward(Unary::Gelu, x, Tensor::full({4001}, 1.f), dx);
  const double k = std::sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < x.numel(); ++i) {
    double v = x.f32()[i], u = k * (v + 0.044715 * v * v * v), t = std::tanh(u);
    double dt = k * (1 + 3 * 0.044715 * v * v);
    EXPECT_NEAR(y.f32()[i], 0.5 * v * (1 + t), 2e-6 * std::max(1.0, std::abs(v))) << "x = " << v;
    EXPECT_NEAR(dx.f32()[i], 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * dt, 2e-6 * std::max(1.0, std::abs(v))) << v;
  }
}

// Activation checkpointing recomputes each block in backward: the same output and gradients
// (bitwise: the same kernels on the same inputs), far fewer activation bytes held between passes.
TEST(ActivationCheckpointing, SameGradientsLessMemory) {
  nn::GptConfig cfg = tiny_gpt(17, 16, 3, 2, 16, 3);
  nn::Gpt plain(cfg), recompute(cfg, nullptr, {}, true);
  Rng rng(8);
  const int64_t b = 3, t = 16;
  Tensor ids = Tensor::empty({b, t}, DType::I32);
  for (int64_t i = 0; i < b * t; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(17));
  Tensor r = random_tensor({b * t, cfg.vocab}, rng);
  auto pa = plain.parameters(), pb = recompute.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (int rep = 0; rep < 2; ++rep) {  // twice: the freed buffers are made again correctly
    for (size_t i = 0; i < pa.size(); ++i) {
      pa[i]->grad.zero_();
      pb[i]->grad.zero_();
    }
    Tensor ya = plain.forward(ids).clone(), yb = recompute.forward(ids).clone();
    for (int64_t i = 0; i < ya.numel(); ++i) ASSERT_EQ(ya.f32()[i], yb.f32()[i]);
    size_t held_plain = plain.activation_bytes(), held_recompute = recompute.activation_bytes();
    EXPECT_LT(held_recompute * 3, held_plain) << held_recompute << " vs " << held_plain;
    plain.backward(r);
    {
      nn::PhaseScope bwd(nn::Phase::Backward);
      recompute.backward(r);
    }
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(pa[i]->name, pb[i]->name);  // checkpointing leaves the names alone
      for (int64_t k = 0; k < pa[i]->grad.numel(); ++k)
        ASSERT_EQ(pa[i]->grad.f32()[k], pb[i]->grad.f32()[k]) << pa[i]->name << " at " << k;
    }
  }
}

// Under bf16/f16 math attention holds q, k and v in that precision and rounds dy's heads and
// d(scores) once for their two GEMMs each: every output and gradient is bitwise what the engine's
// own GEMMs give on the f32 operands (which they round inside), built here step by step.
// The materialised path (DTRAIN_ATTENTION=materialized) with its heads held in bf16/f16.
TEST(LowPrecisionAttention, HeldHeadsChangeNoBit) {
  const int64_t b = 2, t = 16, c = 64, h = 2, hd = c / h, bh = b * h;
  Engine& e = cpu_engine();
  ::setenv("DTRAIN_ATTENTION", "materialized", 1);
  struct Restore {
    ~Restore() {
      cpu_engine().set_math_precision(MathPrecision::F32);
      ::unsetenv("DTRAIN_ATTENTION");
    }
  } restore;
  for (MathPrecision prec : {MathPrecision::BF16, MathPrecision::F16}) {
    e.set_math_precision(prec);
    Rng rng(21);
    nn::SelfAttention attn(c, h, rng);
    Tensor x = random_tensor({b, t, c}, rng), dout = random_tensor({b, t, c}, rng);
    Tensor out = attn.forward(x).clone();
    Tensor dx = attn.backward(dout).clone();
    std::vector<Tensor> grads;
    for (nn::Parameter* p : attn.parameters()) {
      grads.push_back(p->grad.clone());
      p->grad.zero_();
    }
    auto* qkv_l = dynamic_cast<nn::Linear*>(attn.children()[0].second);
    auto* proj_l = dynamic_cast<nn::Linear*>(attn.children()[1].second);
    ASSERT_TRUE(qkv_l && proj_l);
    // The reference: f32 heads, each GEMM rounding its own operands.
    Tensor qkv = qkv_l->forward(x).clone();
    Tensor split = Tensor::zeros({3, b * t, c}), heads = Tensor::zeros({3 * bh, t, hd});
    e.permute_0213(qkv, 1, b * t, 3, c, split);
    e.permute_0213(split, 3 * b, t, h, hd, heads);
    Tensor hv = heads.reshape({3 * bh, t * hd});
    Tensor q = hv.slice0(0, bh), k = hv.slice0(bh, 2 * bh), v = hv.slice0(2 * bh, 3 * bh);
    const int64_t qs = t * hd, ss = t * t;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    Tensor scores = Tensor::zeros({bh, t, t}), att = Tensor::zeros({bh, t, t}), yh = Tensor::zeros({bh, t, hd});
    e.gemm_batched(bh, false, true, t, t, hd, 1.f, q, qs, k, qs, 0.f, scores, ss);
    e.attention_softmax_forward(scores, t, scale, true, att);
    e.gemm_batched(bh, false, false, t, hd, t, 1.f, att, ss, v, qs, 0.f, yh, qs);
    Tensor y = Tensor::zeros({b, t, c});
    e.permute_0213(yh, b, h, t, hd, y);
    Tensor want_out = proj_l->forward(y).clone();
    Tensor dy = proj_l->backward(dout).clone();
    Tensor dyh = Tensor::zeros({bh, t, hd}), datt = Tensor::zeros({bh, t, t}), ds = Tensor::zeros({bh, t, t});
    Tensor dheads = Tensor::zeros({3 * bh, t, hd});
    Tensor dv_ = dheads.reshape({3 * bh, t * hd});
    Tensor dq = dv_.slice0(0, bh), dk = dv_.slice0(bh, 2 * bh), dv = dv_.slice0(2 * bh, 3 * bh);
    e.permute_0213(dy, b, t, h, hd, dyh);
    e.gemm_batched(bh, false, true, t, t, hd, 1.f, dyh, qs, v, qs, 0.f, datt, ss);
    e.gemm_batched(bh, true, false, t, hd, t, 1.f, att, ss, dyh, qs, 0.f, dv, qs);
    e.attention_softmax_backward(att, datt, t, scale, true, ds);
    e.gemm_batched(bh, false, false, t, hd, t, 1.f, ds, ss, k, qs, 0.f, dq, qs);
    e.gemm_batched(bh, true, false, t, hd, t, 1.f, ds, ss, q, qs, 0.f, dk, qs);
    Tensor dsplit = Tensor::zeros({3, b * t, c}), dqkv = Tensor::zeros({b, t, 3 * c});
    e.permute_0213(dheads, 3 * b, h, t, hd, dsplit);
    e.permute_0213(dsplit, 1, 3, b * t, c, dqkv);
    Tensor want_dx = qkv_l->backward(dqkv).clone();
    const char* name = math_precision_name(prec);
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(want_out.f32()[i], out.f32()[i]) << "out " << i << " " << name;
    for (int64_t i = 0; i < dx.numel(); ++i) ASSERT_EQ(want_dx.f32()[i], dx.f32()[i]) << "dx " << i << " " << name;
    auto params = attn.parameters();
    for (size_t p = 0; p < params.size(); ++p)
      for (int64_t i = 0; i < grads[p].numel(); ++i)
        ASSERT_EQ(params[p]->grad.f32()[i], grads[p].f32()[i]) << params[p]->name << " " << i << " " << name;
  }
}

// Under bf16 math the blocks' GEMM inputs can be held as bf16 copies (GptConfig::copy_gemm_inputs):
// the GEMMs round their operands to bf16 anyway, so outputs and gradients are bitwise the same,
// and fewer activation bytes are held between forward and backward. In fp32 the copies are f32:
// the same numbers again. fp16 holds f16 copies, as bf16 does bf16 ones.
TEST(Bf16Activations, SameGradientsFewerBytes) {
  nn::GptConfig cfg = tiny_gpt(19, 16, 2, 2, 32, 5);
  nn::GptConfig copying = cfg;
  copying.copy_gemm_inputs = true;
  Rng rng(9);
  const int64_t b = 3, t = 16;
  Tensor ids = Tensor::empty({b, t}, DType::I32);
  for (int64_t i = 0; i < b * t; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(19));
  Tensor r = random_tensor({b * t, cfg.vocab}, rng);
  Engine& e = cpu_engine();
  for (MathPrecision prec : {MathPrecision::BF16, MathPrecision::F16, MathPrecision::F32}) {
    e.set_math_precision(prec);
    nn::Gpt plain(cfg), copy(copying);
    auto pa = plain.parameters(), pb = copy.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (int rep = 0; rep < 2; ++rep) {
      for (size_t i = 0; i < pa.size(); ++i) {
        pa[i]->grad.zero_();
        pb[i]->grad.zero_();
      }
      Tensor ya = plain.forward(ids).clone(), yb = copy.forward(ids).clone();
      for (int64_t i = 0; i < ya.numel(); ++i) ASSERT_EQ(ya.f32()[i], yb.f32()[i]) << math_precision_name(prec);
      size_t held_plain = plain.activation_bytes(), held_copy = copy.activation_bytes();
      if (prec != MathPrecision::F32) {
        // Per block: LayerNorm outputs (2C), attention output (C) and GELU output (4C) per token
        // go from 4 to 2 bytes: 14C bytes of each token's share.
        EXPECT_EQ(held_plain - held_copy, static_cast<size_t>(cfg.layers * b * t * 14 * cfg.width))
            << held_plain << " vs " << held_copy;
      } else {
        EXPECT_EQ(held_plain, held_copy);
      }
      plain.backward(r);
      copy.backward(r);
      for (size_t i = 0; i < pa.size(); ++i)
        for (int64_t k = 0; k < pa[i]->grad.numel(); ++k)
          ASSERT_EQ(pa[i]->grad.f32()[k], pb[i]->grad.f32()[k])
              << pa[i]->name << " at " << k << " " << math_precision_name(prec);
    }
  }
  e.set_math_precision(MathPrecision::F32);
}

// The stash moves a micro-batch's activations out of the modules and back: a backward after
// other forwards ran in between gives that micro-batch's own gradients.
TEST(ActivationStash, BackwardOfAnEarlierMicroBatch) {
  nn::GptConfig cfg = tiny_gpt(13, 8, 2, 2, 8, 1);
  nn::Gpt a(cfg), ref(cfg);
  Rng rng(4);
  auto batch = [&]() {
    Tensor ids = Tensor::empty({2, 8}, DType::I32);
    for (int64_t i = 0; i < 16; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(13));
    return ids;
  };
  Tensor x0 = batch(), x1 = batch();
  Tensor r = random_tensor({16, cfg.vocab}, rng);
  a.forward(x0);
  nn::ActivationStash s0 = a.stash_activations();
  EXPECT_EQ(a.activation_bytes(), 0u);
  EXPECT_GT(nn::Module::stash_bytes(s0), 0u);
  a.forward(x1);  // another micro-batch in between
  nn::ActivationStash s1 = a.stash_activations();
  a.restore_activations(std::move(s0));
  a.backward(r);
  ref.forward(x0);
  ref.backward(r);
  auto pa = a.parameters(), pr = ref.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    for (int64_t k = 0; k < pa[i]->grad.numel(); ++k)
      ASSERT_EQ(pa[i]->grad.f32()[k], pr[i]->grad.f32()[k]) << pa[i]->name;
}

// Weight-only int8 of a GPT: every block's four Linear layers (qkv, proj and the MLP's two), a
// quarter of their bytes plus one scale per row; the logits stay close to fp32's, and backward is
// refused instead of using weights that are gone.
TEST(WeightOnlyInt8, GptLogitsStayCloseAndBackwardIsRefused) {
  nn::GptConfig cfg = tiny_gpt(13, 8, 2, 2, 16, 6);
  nn::Gpt gpt(cfg);
  gpt.eval();
  Rng rng(5);
  Tensor ids = Tensor::empty({2, 6}, DType::I32);
  for (int64_t i = 0; i < ids.numel(); ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(13));
  const Tensor ref = gpt.forward(ids).clone();
  const nn::WeightOnlyReport r = nn::quantize_linear_weights_int8(gpt);
  EXPECT_EQ(r.layers, 4 * cfg.layers);
  const int64_t w = cfg.width, f32_bytes = cfg.layers * 4 * (3 * w * w + w * w + 4 * w * w + 4 * w * w);
  EXPECT_EQ(r.f32_bytes, f32_bytes);
  EXPECT_EQ(r.int8_bytes, cfg.layers * ((3 * w * w + w * w + 8 * w * w) + 4 * (3 * w + w + 4 * w + w)));
  const Tensor got = gpt.forward(ids);
  double err = 0, size = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got.f32()[i]) - ref.f32()[i]));
    size = std::max(size, std::abs(static_cast<double>(ref.f32()[i])));
  }
  EXPECT_GT(err, 0.0) << "the int8 weights were not used";
  EXPECT_LT(err, 0.02 * size);
  EXPECT_THROW(gpt.backward(Tensor::zeros(got.shape())), Error);
}

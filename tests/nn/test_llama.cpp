// The Llama family's pieces: RMSNorm, SwiGLU and rotary positions against hand-computed values and
// finite differences; grouped-query attention against multi-head attention with repeated key/value
// heads.
#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/nn/gpt.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::gradcheck;
using dtrain::test::random_tensor;

TEST(LlamaOps, RmsNormByHand) {
  nn::RMSNorm norm(2, 0.f);
  norm.parameters()[0]->value.f32()[1] = 2.f;
  Tensor y = norm.forward(Tensor::from({1, 2}, {3, 4}));  // rms = sqrt(12.5)
  EXPECT_NEAR(y.f32()[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y.f32()[1], 2 * 4 / std::sqrt(12.5), 1e-6);
}

TEST(Gradients, RmsNorm) {
  Rng rng(31);
  nn::RMSNorm norm(6);
  Tensor& w = norm.parameters()[0]->value;
  for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = 1.f + 0.3f * rng.normal();
  gradcheck(norm, random_tensor({3, 4, 6}, rng), 7, 1e-2f, 2e-2, 32);
}

TEST(LlamaOps, SwiGluByHand) {
  nn::SwiGLU act;
  Tensor y = act.forward(Tensor::from({1, 4}, {1, -2, 3, 5}));  // gates 1, -2; ups 3, 5
  EXPECT_NEAR(y.f32()[0], 1 / (1 + std::exp(-1.0)) * 3, 1e-6);
  EXPECT_NEAR(y.f32()[1], -2 / (1 + std::exp(2.0)) * 5, 1e-6);
}

TEST(Gradients, SwiGlu) {
  Rng rng(32);
  nn::SwiGLU act;
  gradcheck(act, random_tensor({2, 3, 8}, rng), 7, 1e-2f, 2e-2, 32);
}

// Head width 4, base 100: frequencies 1 and 0.1; feature i pairs with i + 2.
TEST(LlamaOps, RotaryByHand) {
  Engine& e = cpu_engine();
  const int64_t t = 3, d = 4;
  Tensor table = Tensor::empty({t, d});
  for (int64_t p = 0; p < t; ++p)
    for (int64_t i = 0; i < 2; ++i) {
      const double w = i == 0 ? 1.0 : 0.1;
      table.f32()[p * d + i] = static_cast<float>(std::cos(p * w));
      table.f32()[p * d + 2 + i] = static_cast<float>(std::sin(p * w));
    }
  Rng rng(33);
  Tensor x = random_tensor({2, t, d}, rng), y = Tensor::zeros({2, t, d});
  e.rotary(x, t, table, 0, false, y);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t p = 0; p < t; ++p) {
      const float* a = x.f32() + (n * t + p) * d;
      const float* b = y.f32() + (n * t + p) * d;
      for (int64_t i = 0; i < 2; ++i) {
        const double w = p * (i == 0 ? 1.0 : 0.1);
        EXPECT_NEAR(b[i], a[i] * std::cos(w) - a[i + 2] * std::sin(w), 1e-6);
        EXPECT_NEAR(b[i + 2], a[i + 2] * std::cos(w) + a[i] * std::sin(w), 1e-6);
      }
    }
  // From position 1 on: the rows of position 1 and 2 of the table; the inverse rotates back.
  Tensor z = Tensor::zeros({2, 2, d}), back = Tensor::zeros({2, 2, d});
  Tensor tail = Tensor::empty({2, 2, d});
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t k = 0; k < 2 * d; ++k) tail.f32()[n * 2 * d + k] = x.f32()[(n * t + 1) * d + k];
  e.rotary(tail, 2, table, 1, false, z);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t k = 0; k < 2 * d; ++k) EXPECT_EQ(z.f32()[n * 2 * d + k], y.f32()[(n * t + 1) * d + k]);
  e.rotary(z, 2, table, 1, true, back);
  for (int64_t i = 0; i < back.numel(); ++i) EXPECT_NEAR(back.f32()[i], tail.f32()[i], 1e-6);
}

namespace {

// Attention of width 8 over `heads` query heads and `kv` key/value heads, rotary when asked.
std::unique_ptr<nn::SelfAttention> attention(int64_t heads, int64_t kv, bool rotary, Rng& rng) {
  const int64_t c = 8, hd = c / heads;
  auto att = std::make_unique<nn::SelfAttention>(std::make_unique<nn::Linear>(c, (heads + 2 * kv) * hd, false, rng),
                                                 std::make_unique<nn::Linear>(c, c, false, rng), c, heads, hd, kv);
  if (rotary) att->set_rotary(10000.f, 16);
  return att;
}

}  // namespace

TEST(Gradients, GroupedQueryAttentionWithRotary) {
  Rng rng(34);
  auto att = attention(4, 2, true, rng);
  gradcheck(*att, random_tensor({2, 5, 8}, rng), 7, 1e-2f, 3e-2, 32);
}

// 4 query heads over 2 key/value heads equal multi-head attention whose key and value heads are
// the grouped ones repeated (query head h reads kv head h / 2): forward, d(input), and the key and
// value projections' gradients summed over each group.
TEST(LlamaOps, GroupedQueryAttentionEqualsRepeatedHeads) {
  Rng rng(35);
  auto gqa = attention(4, 2, true, rng);
  auto mha = attention(4, 4, true, rng);
  const int64_t hd = 2, c = 8;
  auto weight = [](nn::Module& m, const char* name) -> nn::Parameter& {
    for (nn::Parameter* p : m.parameters())
      if (p->name == name) return *p;
    throw std::runtime_error(name);
  };
  Tensor& wg = weight(*gqa, "qkv.weight").value;  // rows: q 4 heads, k 2 heads, v 2 heads
  Tensor& wm = weight(*mha, "qkv.weight").value;  // rows: q, k, v 4 heads each
  auto row_of_mha = [&](int64_t part, int64_t head, int64_t j) { return (part * 4 + head) * hd + j; };
  auto row_of_gqa = [&](int64_t part, int64_t head, int64_t j) {
    return part == 0 ? head * hd + j : (4 + (part - 1) * 2 + head / 2) * hd + j;
  };
  for (int64_t part = 0; part < 3; ++part)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t j = 0; j < hd; ++j)
        for (int64_t k = 0; k < c; ++k)
          wm.f32()[row_of_mha(part, h, j) * c + k] = wg.f32()[row_of_gqa(part, h, j) * c + k];
  weight(*mha, "proj.weight").value.copy_from(weight(*gqa, "proj.weight").value);
  Tensor x = random_tensor({2, 5, c}, rng), dy = random_tensor({2, 5, c}, rng);
  Tensor yg = gqa->forward(x).clone(), ym = mha->forward(x).clone();
  for (int64_t i = 0; i < yg.numel(); ++i) EXPECT_NEAR(yg.f32()[i], ym.f32()[i], 1e-6);
  for (nn::Parameter* p : gqa->parameters()) p->grad.zero_();
  for (nn::Parameter* p : mha->parameters()) p->grad.zero_();
  Tensor dxg = gqa->backward(dy).clone(), dxm = mha->backward(dy).clone();
  for (int64_t i = 0; i < dxg.numel(); ++i) EXPECT_NEAR(dxg.f32()[i], dxm.f32()[i], 1e-5);
  const Tensor& gg = weight(*gqa, "qkv.weight").grad;
  const Tensor& gm = weight(*mha, "qkv.weight").grad;
  for (int64_t part = 0; part < 3; ++part)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t j = 0; j < hd; ++j)
        for (int64_t k = 0; k < c; ++k) {
          double want = gm.f32()[row_of_mha(part, h, j) * c + k];
          if (part > 0) want += gm.f32()[row_of_mha(part, h ^ 1, j) * c + k];  // the other head of the group
          EXPECT_NEAR(gg.f32()[row_of_gqa(part, h, j) * c + k], want, 1e-5) << part << " " << h;
        }
}

// Cached decoding: a prompt at position 0, then one token at a time, gives the logits of the full
// forward over the whole sequence, for the GPT (learned positions) and the Llama (rotary, GQA).
TEST(CachedDecoding, EqualsTheFullForward) {
  for (bool llama : {false, true}) {
    nn::GptConfig cfg;
    cfg.vocab = 13;
    cfg.context = 12;
    cfg.layers = 2;
    cfg.heads = 4;
    cfg.width = 16;
    if (llama) {
      cfg.kv_heads = 2;
      nn::llama_shape(cfg);
    }
    nn::Gpt model(cfg);
    model.eval();
    Rng rng(41);
    const int64_t t = 10, prompt = 4;
    Tensor ids = Tensor::empty({2, t}, DType::I32);
    for (int64_t i = 0; i < ids.numel(); ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(13));
    const Tensor full = model.forward(ids).clone();  // [2 t, V]
    model.start_decoding(cfg.context);
    auto columns = [&](int64_t first, int64_t n) {  // ids[:, first:first+n]
      Tensor out = Tensor::empty({2, n}, DType::I32);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t j = 0; j < n; ++j) out.data<int32_t>()[b * n + j] = ids.data<int32_t>()[b * t + first + j];
      return out;
    };
    auto expect_rows = [&](const Tensor& got, int64_t first, int64_t n) {
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t k = 0; k < cfg.vocab; ++k)
            ASSERT_NEAR(got.f32()[(b * n + j) * cfg.vocab + k], full.f32()[(b * t + first + j) * cfg.vocab + k], 1e-5)
                << (llama ? "llama" : "gpt") << " sequence " << b << " position " << first + j;
    };
    model.decode_at(0);
    expect_rows(model.forward(columns(0, prompt)), 0, prompt);
    for (int64_t p = prompt; p < t; ++p) {
      model.decode_at(p);
      expect_rows(model.forward(columns(p, 1)), p, 1);
    }
    EXPECT_THROW(model.forward(columns(0, 3)), InputError) << "more than one new token past the prompt";
    model.start_decoding(0);  // off: the whole window again
    model.decode_at(0);
    expect_rows(model.forward(ids), 0, t);
  }
}

// LoRA on a fused projection's row blocks 0 and 2 of 3: zero B leaves the layer as it was; with B
// drawn, the output adds (alpha/r) (x A^T) B^T on those rows only, and B's other entries get no
// gradient; over one block of all rows, every gradient matches finite differences.
TEST(Gradients, LoraAdaptersOnRowBlocks) {
  Rng rng(51);
  nn::Linear base(6, 9, true, rng);
  Rng same(51);
  nn::Linear lora(6, 9, true, same);
  lora.add_lora({{0, 3}, {6, 3}}, 2, 4.f, rng);
  Tensor x = random_tensor({2, 3, 6}, rng);
  const Tensor y0 = base.forward(x).clone(), y1 = lora.forward(x).clone();
  for (int64_t i = 0; i < y0.numel(); ++i) ASSERT_EQ(y0.f32()[i], y1.f32()[i]) << "B = 0 at the start";
  nn::Parameter* b = lora.parameters()[3];
  ASSERT_EQ(b->name, "lora_B");
  ASSERT_EQ(b->value.shape(), (Shape{9, 4}));
  for (int64_t r = 0; r < 9; ++r)
    for (int64_t j = 0; j < 4; ++j)
      if ((r < 3 && j < 2) || (r >= 6 && j >= 2)) b->value.f32()[r * 4 + j] = rng.normal();
  const Tensor y2 = lora.forward(x).clone();
  for (int64_t m = 0; m < 6; ++m)
    for (int64_t r = 3; r < 6; ++r)
      EXPECT_EQ(y2.f32()[m * 9 + r], y0.f32()[m * 9 + r]) << "row " << r << " is not adapted";
  for (nn::Parameter* p : lora.parameters()) p->grad.zero_();
  lora.forward(x);
  lora.backward(random_tensor({2, 3, 9}, rng));
  for (int64_t r = 0; r < 9; ++r)
    for (int64_t j = 0; j < 4; ++j)
      if (!((r < 3 && j < 2) || (r >= 6 && j >= 2))) {
        EXPECT_EQ(b->grad.f32()[r * 4 + j], 0.f) << r << "," << j;
      }
  nn::Linear whole(6, 9, true, rng);
  whole.add_lora({{0, 9}}, 3, 6.f, rng);
  Tensor& wb = whole.parameters()[3]->value;
  for (int64_t i = 0; i < wb.numel(); ++i) wb.f32()[i] = rng.normal();
  gradcheck(whole, x, 7, 1e-2f, 2e-2, 24);
}

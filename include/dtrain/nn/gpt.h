#pragma once
// A GPT (decoder-only transformer) with hand-written backward: token and position embeddings,
// pre-LayerNorm blocks of causal self-attention and a GELU MLP with residuals, a final LayerNorm,
// and an unembedding tied to the token embedding. Shapes: B batch, T positions (<= context),
// C width, H heads (C % H == 0), V vocabulary (256 for bytes).
#include <functional>
#include <memory>

#include "dtrain/core/rng.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

struct GptConfig {
  int64_t vocab = 256;
  int64_t context = 128;
  int64_t layers = 6;
  int64_t heads = 8;
  int64_t width = 256;
  uint64_t seed = 1;
};

// x [B, T, C] -> y [B, T, C]: y = proj(softmax_causal(q k^T / sqrt(C/H)) v), heads concatenated.
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t width, int64_t heads, Rng& rng);
  // With given projections (tensor parallel: a column-parallel qkv producing this rank's
  // `local_heads` q, k and v heads, [.., 3 * local_heads * head_dim], and a row-parallel proj
  // taking [.., local_heads * head_dim] back to the full width).
  CausalSelfAttention(ModulePtr qkv, ModulePtr proj, int64_t width, int64_t local_heads, int64_t head_dim);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override;
  std::vector<std::pair<std::string, Module*>> children() override;
  void set_needs_input_grad(bool needed) override;

 private:
  int64_t c_, h_, hd_;  // input width, heads on this rank, head width
  int64_t b_ = 0, t_ = 0;
  ModulePtr qkv_, proj_;  // C -> 3*H*hd (q, k, v each head-major), H*hd -> C
  // qkvh_ [B, 3H, T, hd]; att_ (softmax probabilities) [B, H, T, T]; yh_ [B, H, T, hd]; y_ [B, T, C]
  Tensor qkvh_, scores_, att_, yh_, y_;         // y_ [B, T, H*hd]
  Tensor dyh_, datt_, dscores_, dqkvh_, dqkv_;  // dscores_ shares scores_'s buffer
};

// One pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(.)); mlp = C -> 4C, GELU, -> C.
ModulePtr make_gpt_block(int64_t width, int64_t heads, Rng& rng);
// Makes block `layer` drawing its initial weights from `rng` (tensor parallel passes its own).
using GptBlockFactory = std::function<ModulePtr(int64_t layer, Rng& rng)>;

// ids i32 [B, T] -> logits [B*T, V]. backward(dlogits [B*T, V]) returns an undefined tensor (the
// input is token ids).
class Gpt : public Module {
 public:
  explicit Gpt(const GptConfig& cfg, const GptBlockFactory& blocks = nullptr);
  Tensor forward(const Tensor& ids) override;
  Tensor backward(const Tensor& dlogits) override;
  std::string kind() const override;
  std::vector<std::pair<std::string, Module*>> children() override;
  const GptConfig& config() const { return cfg_; }

 private:
  GptConfig cfg_;
  Parameter* wte_;  // [V, C], also the unembedding
  Parameter* wpe_;  // [context, C]
  std::unique_ptr<Sequential> blocks_;
  std::unique_ptr<LayerNorm> ln_f_;
  int64_t b_ = 0, t_ = 0;
  Tensor ids_, emb_, hf_, logits_, dhf_;
};

}  // namespace dtrain::nn

// GPT pieces: causal self-attention and the GPT model (embeddings, blocks, tied unembedding). All
// compute goes through the Engine, so the same code runs on the CPU and CUDA engines.
#include "dtrain/nn/gpt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "dtrain/core/env.h"

namespace dtrain::nn {

// ------------------------------------------------------------------ SelfAttention
SelfAttention::SelfAttention(int64_t width, int64_t heads, Rng& rng)
    : c_(width), h_(heads), hd_(heads > 0 ? width / heads : 0), kvh_(heads) {
  DT_INPUT_CHECK(width > 0 && heads > 0 && width % heads == 0,
                 "attention width " << width << " must be a positive multiple of the head count " << heads);
  qkv_ = std::make_unique<Linear>(c_, 3 * c_, true, rng);
  proj_ = std::make_unique<Linear>(c_, c_, true, rng);
  qkv_->set_output_temporary(true);   // permuted into qkvh_ at once
  proj_->set_output_temporary(true);  // used up by the residual add
}

SelfAttention::SelfAttention(ModulePtr qkv, ModulePtr proj, int64_t width, int64_t local_heads, int64_t head_dim,
                             int64_t local_kv_heads)
    : c_(width),
      h_(local_heads),
      hd_(head_dim),
      kvh_(local_kv_heads > 0 ? local_kv_heads : local_heads),
      qkv_(std::move(qkv)),
      proj_(std::move(proj)) {
  DT_INPUT_CHECK(width > 0 && local_heads > 0 && head_dim > 0 && local_heads % kvh_ == 0,
                 "attention width " << width << ", " << local_heads << " heads of " << head_dim << " over " << kvh_
                                    << " key/value heads");
  qkv_->set_output_temporary(true);
  proj_->set_output_temporary(true);
}

void SelfAttention::copy_gemm_inputs() {
  auto* qkv = dynamic_cast<Linear*>(qkv_.get());
  auto* proj = dynamic_cast<Linear*>(proj_.get());
  DT_CHECK(qkv && proj, kind() << ": copying GEMM inputs needs Linear projections");
  qkv->set_copy_input(true);
  proj->set_copy_input(true);
  copies_ = true;
}

std::string SelfAttention::kind() const {
  return std::string(causal_ ? "Causal" : "") + "SelfAttention(" + std::to_string(c_) +
         ", heads=" + std::to_string(h_) + (kvh_ != h_ ? ", kv_heads=" + std::to_string(kvh_) : "") +
         (rope_base_ > 0 ? ", rotary" : "") + ")";
}

void SelfAttention::set_rotary(float base, int64_t context) {
  DT_INPUT_CHECK(base > 1.f && context > 0 && hd_ % 2 == 0,
                 "rotary positions need a base above 1 and an even head width, not " << base << " and " << hd_);
  rope_base_ = base;
  rope_context_ = context;
  rope_ = Tensor();
}

// cos and sin of p * base^(-2i/hd), rounded as PyTorch computes them in f32 (inverse frequencies,
// then the angle), so imported models see the same rotations.
const Tensor& SelfAttention::rope_table(Device dev) {
  if (rope_.defined() && rope_.device() == dev) return rope_;
  const int64_t half = hd_ / 2;
  Tensor t = Tensor::empty({rope_context_, hd_});
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd_);
    const float inv = 1.f / static_cast<float>(std::pow(static_cast<double>(rope_base_), exponent));
    for (int64_t p = 0; p < rope_context_; ++p) {
      const float angle = static_cast<float>(p) * inv;
      t.f32()[p * hd_ + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      t.f32()[p * hd_ + half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  rope_ = Tensor::empty(t.shape(), DType::F32, dev);
  copy_any(t, rope_);
  return rope_;
}

std::vector<std::pair<std::string, Module*>> SelfAttention::children() {
  return {{qkv_name_, qkv_.get()}, {proj_name_, proj_.get()}};
}

void SelfAttention::name_as_torch_multihead() {
  qkv_->rename_parameter("weight", "in_proj_weight");
  qkv_->rename_parameter("bias", "in_proj_bias");
  qkv_name_ = "";  // its parameters are the attention's own
  proj_name_ = "out_proj";
}

void SelfAttention::set_needs_input_grad(bool needed) {
  Module::set_needs_input_grad(needed);
  qkv_->set_needs_input_grad(needed);
}

// Heads in the layout q [B, H, T, hd], k and v [B, KV, T, hd], so every product below is ONE
// batched GEMM with uniform strides (one launch on a GPU, not one per sequence). Query heads
// h = kv G + g (G = H / KV) read key/value head kv, so the G query heads of a key/value head are
// G*T consecutive rows: the products run over B*KV batches of G*T rows, and d(k), d(v) sum their
// group in the GEMM. From qkv [B*T, H + 2 KV, hd]: -> [H + 2 KV, B*T, hd]; each of q, k and v
// [heads, B, T*hd] -> [B, heads, T*hd].
void SelfAttention::split_heads(Engine& e, const Tensor& qkv, Tensor& heads) {
  const int64_t nh = h_ + 2 * kvh_, bt = b_ * t_;
  ensure_temp(split_, {nh, bt, hd_}, qkv.device());
  e.permute_0213(qkv, 1, bt, nh, hd_, split_);
  Tensor flat = heads.reshape({nh * bt * hd_}), from = split_.reshape({nh * bt * hd_});
  int64_t at = 0;
  for (int64_t n : {h_, kvh_, kvh_}) {
    Tensor dst = flat.slice0(at, at + n * bt * hd_);
    e.permute_0213(from.slice0(at, at + n * bt * hd_), 1, n, b_, t_ * hd_, dst);
    at += n * bt * hd_;
  }
}

// The inverse of split_heads: d(q), d(k), d(v) back to [B*T, H + 2 KV, hd].
void SelfAttention::merge_heads(Engine& e, const Tensor& heads, Tensor& dqkv) {
  const int64_t nh = h_ + 2 * kvh_, bt = b_ * t_;
  ensure_temp(split_, {nh, bt, hd_}, heads.device());
  Tensor flat = heads.reshape({nh * bt * hd_}), to = split_.reshape({nh * bt * hd_});
  int64_t at = 0;
  for (int64_t n : {h_, kvh_, kvh_}) {
    Tensor dst = to.slice0(at, at + n * bt * hd_);
    e.permute_0213(flat.slice0(at, at + n * bt * hd_), 1, b_, n, t_ * hd_, dst);
    at += n * bt * hd_;
  }
  e.permute_0213(split_, 1, nh, bt, hd_, dqkv);
}

void SelfAttention::start_decoding(int64_t capacity) {
  DT_CHECK(capacity >= 0 && causal_, kind() << ": cached decoding of " << capacity << " positions");
  capacity_ = capacity;
  position_ = 0;
  kcache_ = vcache_ = Tensor();
}

SelfAttention::Heads SelfAttention::heads_of(const Tensor& flat) const {
  const int64_t q = b_ * h_ * t_ * hd_, kv = b_ * kvh_ * t_ * hd_;
  return {flat.slice0(0, q), flat.slice0(q, q + kv), flat.slice0(q + kv, q + 2 * kv)};
}

AttentionShape SelfAttention::attention_shape(int64_t kv_len, int64_t kv_stride, int64_t q_offset) const {
  return {.batch = b_,
          .heads = h_,
          .kv_heads = kvh_,
          .q_len = t_,
          .kv_len = kv_len,
          .head_dim = hd_,
          .kv_stride = kv_stride,
          .q_offset = q_offset,
          .causal = causal_,
          .scale = 1.f / std::sqrt(static_cast<float>(hd_))};
}

// The same op as in training over the cached keys and values: a prompt (position 0) is causal over
// itself; a later position is one new token that sees every cached one and itself.
Tensor SelfAttention::forward_cached(const Tensor& x) {
  b_ = x.size(0);
  t_ = x.size(1);
  Device dev = x.device();
  Engine& e = engine(x);
  DT_INPUT_CHECK(position_ + t_ <= capacity_ && (position_ == 0 || t_ == 1),
                 kind() << ": decoding " << t_ << " token(s) at position " << position_ << " of " << capacity_);
  if (!kcache_.defined() || kcache_.size(0) != b_ || kcache_.device() != dev) {
    kcache_ = Tensor::empty({b_, kvh_, capacity_, hd_}, DType::F32, dev);
    vcache_ = Tensor::empty({b_, kvh_, capacity_, hd_}, DType::F32, dev);
  }
  Tensor qkv = qkv_->forward(x);
  const int64_t bh = b_ * h_, bkv = b_ * kvh_, n = (bh + 2 * bkv) * t_ * hd_;
  Tensor heads = Tensor::empty({n}, DType::F32, dev);
  split_heads(e, qkv, heads);
  if (rope_base_ > 0) {
    Tensor qk = heads.slice0(0, (bh + bkv) * t_ * hd_);
    e.rotary(qk, t_, rope_table(dev), position_, false, qk);
  }
  // This step's keys and values into their rows of the cache, per (sequence, kv head).
  const int64_t step = t_ * hd_, row = capacity_ * hd_;
  Tensor kc = kcache_.reshape({bkv * row}), vc = vcache_.reshape({bkv * row});
  for (int64_t i = 0; i < bkv; ++i) {
    const int64_t at = i * row + position_ * hd_;
    Tensor kdst = kc.slice0(at, at + step), vdst = vc.slice0(at, at + step);
    e.copy(heads.slice0((bh + i) * step, (bh + i + 1) * step), kdst);
    e.copy(heads.slice0((bh + bkv + i) * step, (bh + bkv + i + 1) * step), vdst);
  }
  Tensor q = heads.slice0(0, bh * step);
  Tensor yh = Tensor::empty({bh * step}, DType::F32, dev), lse = Tensor::empty({bh * t_}, DType::F32, dev);
  attention_forward(e, attention_shape(position_ + t_, row, position_), q, kc, vc, yh, lse);
  Tensor y = Tensor::empty({b_, t_, h_ * hd_}, DType::F32, dev);
  e.permute_0213(yh, b_, h_, t_, hd_, y);
  return proj_->forward(y);
}

Tensor SelfAttention::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 3 && x.size(2) == c_, kind() << " needs input [B, T, " << c_ << "], got " << x.str());
  if (capacity_ > 0) return forward_cached(x);
  b_ = x.size(0);
  t_ = x.size(1);
  Device dev = x.device();
  Engine& e = engine(x);
  Tensor qkv = qkv_->forward(x);  // [B, T, (H + 2 KV) * hd]
  const int64_t hc = h_ * hd_, bh = b_ * h_, bkv = b_ * kvh_, n = (bh + 2 * bkv) * t_ * hd_;
  DT_CHECK(qkv.numel() == n, kind() << ": qkv gave " << qkv.str());
  low_ = !e.rounds_gemm(t_, t_) || !e.rounds_gemm(t_, hd_) ? DType::F32
         : e.math_precision() == MathPrecision::F16        ? DType::F16
                                                           : DType::BF16;
  Tensor& wide = low_ == DType::F32 ? ensure(qkvh_, {n}, dev) : ensure_temp(wide_, {n}, dev);
  split_heads(e, qkv, wide);
  if (rope_base_ > 0) {  // q and k rotated in place
    Tensor qk = wide.slice0(0, (bh + bkv) * t_ * hd_);
    e.rotary(qk, t_, rope_table(dev), 0, false, qk);
  }
  if (low_ != DType::F32) e.cast(wide_, ensure(qkvh_, {n}, dev, low_));
  ensure(yh_, {bh, t_, hd_}, dev);  // kept: the backward reads it beside lse_
  ensure(lse_, {bh * t_}, dev);
  const Heads h = heads_of(qkvh_);
  attention_forward(e, attention_shape(t_, 0, 0), h.q, h.k, h.v, yh_, lse_);
  if (copies_)
    ensure_temp(y_, {b_, t_, hc}, dev);  // proj keeps its own copy
  else
    ensure(y_, {b_, t_, hc}, dev);
  e.permute_0213(yh_, b_, h_, t_, hd_, y_);  // [B, H, T, hd] -> [B, T, H*hd]
  return proj_->forward(y_);
}

Tensor SelfAttention::backward(const Tensor& dout) {
  DT_CHECK(dout.numel() == b_ * t_ * c_, kind() << " backward got " << dout.str());
  Device dev = dout.device();
  Engine& e = engine(dout);
  const int64_t bh = b_ * h_, bkv = b_ * kvh_, n = (bh + 2 * bkv) * t_ * hd_;
  Tensor dy = proj_->backward(dout);  // [B, T, H*hd]
  ensure(dyh_, {bh, t_, hd_}, dev);
  e.permute_0213(dy, b_, t_, h_, hd_, dyh_);
  ensure(dqkvh_, {n}, dev);
  const Heads h = heads_of(qkvh_);
  Heads d = heads_of(dqkvh_);
  attention_backward(e, attention_shape(t_, 0, 0), h.q, h.k, h.v, yh_, lse_, dyh_, d.q, d.k, d.v);
  if (rope_base_ > 0) {  // back through the rotation
    Tensor dqk = dqkvh_.slice0(0, (bh + bkv) * t_ * hd_);
    e.rotary(dqk, t_, rope_table(dev), 0, true, dqk);
  }
  ensure(dqkv_, {b_, t_, (h_ + 2 * kvh_) * hd_}, dev);
  merge_heads(e, dqkvh_, dqkv_);
  return qkv_->backward(dqkv_);
}

// ------------------------------------------------------------------ blocks
void llama_shape(GptConfig& cfg) {
  cfg.rms_norm = cfg.rotary = cfg.swiglu = true;
  cfg.bias = cfg.tied = false;
  if (cfg.mlp_width <= 0) cfg.mlp_width = (8 * cfg.width / 3 + 31) / 32 * 32;
}

namespace {

BlockLinears one_rank_linears() {
  BlockLinears l;
  l.column = [](int64_t in, const std::vector<int64_t>& blocks, int64_t, bool bias, Rng& rng) -> ModulePtr {
    int64_t out = 0;
    for (int64_t b : blocks) out += b;
    return std::make_unique<Linear>(in, out, bias, rng);
  };
  l.row = [](int64_t in, int64_t out, bool bias, Rng& rng) -> ModulePtr {
    return std::make_unique<Linear>(in, out, bias, rng);
  };
  return l;
}

ModulePtr make_norm(const GptConfig& cfg) {
  if (cfg.rms_norm) return std::make_unique<RMSNorm>(cfg.width, cfg.norm_eps);
  return std::make_unique<LayerNorm>(cfg.width, cfg.norm_eps);
}

}  // namespace

namespace {

// add_lora on the projections of a block that cfg.lora_targets names: each target a row block of
// its layer's outputs. The adapters draw from a stream of (seed, layer), so the base weights' draws
// stay those of the model without them.
void add_lora_adapters(const GptConfig& cfg, int64_t layer, Module& qkv, Module& proj, Module& fc1, Module& fc2) {
  const int64_t hd = cfg.width / cfg.heads, q = cfg.heads * hd, kv = cfg.kv() * hd, f = cfg.hidden();
  std::map<std::string, std::pair<Module*, std::pair<int64_t, int64_t>>> where{{"q", {&qkv, {0, q}}},
                                                                               {"k", {&qkv, {q, kv}}},
                                                                               {"v", {&qkv, {q + kv, kv}}},
                                                                               {"o", {&proj, {0, cfg.width}}},
                                                                               {"down", {&fc2, {0, cfg.width}}}};
  if (cfg.swiglu) {
    where["gate"] = {&fc1, {0, f}};
    where["up"] = {&fc1, {f, f}};
  } else {
    where["up"] = {&fc1, {0, f}};
  }
  std::map<Module*, std::vector<std::pair<int64_t, int64_t>>> blocks;
  std::stringstream list(cfg.lora_targets);
  for (std::string t; std::getline(list, t, ',');) {
    const auto it = where.find(t);
    DT_INPUT_CHECK(it != where.end(), "option --lora-targets: '"
                                          << t << "' is not a projection of this model ("
                                          << (cfg.swiglu ? "q, k, v, o, gate, up, down" : "q, k, v, o, up, down")
                                          << ")");
    blocks[it->second.first].push_back(it->second.second);
  }
  Rng rng(derive_seed(cfg.seed, 0x4c6f5241ull + static_cast<uint64_t>(layer)));
  for (Module* m : {&qkv, &proj, &fc1, &fc2})  // a fixed order: the same draws whatever the list's
    if (auto b = blocks.find(m); b != blocks.end()) {
      std::sort(b->second.begin(), b->second.end());
      DT_INPUT_CHECK(std::adjacent_find(b->second.begin(), b->second.end()) == b->second.end(),
                     "option --lora-targets '" << cfg.lora_targets << "' names a projection twice");
      dynamic_cast<Linear&>(*m).add_lora(b->second, cfg.lora_rank, cfg.lora_alpha, rng);
    }
}

}  // namespace

ModulePtr make_lm_block(const GptConfig& cfg, Rng& rng, const BlockLinears* linears, int64_t layer) {
  static const BlockLinears one_rank = one_rank_linears();
  const BlockLinears& lin = linears ? *linears : one_rank;
  const int64_t c = cfg.width, h = cfg.heads, kv = cfg.kv(), f = cfg.hidden();
  DT_INPUT_CHECK(h > 0 && c % h == 0 && kv > 0 && h % kv == 0,
                 "the attention's " << h << " heads must divide the width " << c << " and be a multiple of the " << kv
                                    << " key/value heads");
  // Key/value heads split over tp where they divide; else each rank holds the one its query heads
  // read (replicated over tp / kv ranks).
  DT_INPUT_CHECK(h % lin.ranks == 0 && (kv % lin.ranks == 0 || lin.ranks % kv == 0) && f % lin.ranks == 0,
                 "tensor parallel: " << h << " heads and the MLP's " << f << " hidden features must split over "
                                     << lin.ranks << " tp ranks, and the " << kv
                                     << " key/value heads split over them or divide them");
  const int64_t hd = c / h;
  ModulePtr qkv = lin.column(c, {h * hd, kv * hd, kv * hd}, hd, cfg.bias, rng);
  ModulePtr proj = lin.row(h * hd, c, cfg.bias, rng);
  auto* att =
      new SelfAttention(std::move(qkv), std::move(proj), c, h / lin.ranks, hd, std::max<int64_t>(kv / lin.ranks, 1));
  ModulePtr attp(att);
  if (cfg.rotary) att->set_rotary(cfg.rope_base, cfg.context);
  ModulePtr fc1 = cfg.swiglu ? lin.column(c, {f, f}, 1, cfg.bias, rng) : lin.column(c, {f}, 1, cfg.bias, rng);
  ModulePtr fc2 = lin.row(f, c, cfg.bias, rng);
  ModulePtr act = cfg.swiglu ? ModulePtr(std::make_unique<SwiGLU>()) : GELU();
  if (cfg.lora_rank > 0) {
    add_lora_adapters(cfg, layer, *att->children()[0].second, *att->children()[1].second, *fc1, *fc2);
  }
  ModulePtr norm1 = make_norm(cfg), norm2 = make_norm(cfg);
  fc2->set_output_temporary(true);  // used up by the residual add
  if (cfg.copy_gemm_inputs) {
    // Each of these outputs has one reader, a Linear that now keeps its own (bf16) copy.
    att->copy_gemm_inputs();
    dynamic_cast<Linear&>(*fc1).set_copy_input(true);
    dynamic_cast<Linear&>(*fc2).set_copy_input(true);
    norm1->set_output_temporary(true);
    norm2->set_output_temporary(true);
    act->set_output_temporary(true);
  }
  auto attn = std::make_unique<Sequential>();
  attn->add(std::move(norm1));
  attn->add(std::move(attp));
  auto mlp = std::make_unique<Sequential>();
  mlp->add(std::move(norm2));
  mlp->add(std::move(fc1));
  mlp->add(std::move(act));
  mlp->add(std::move(fc2));
  auto block = std::make_unique<Sequential>();
  block->add(std::make_unique<Residual>(std::move(attn)));
  block->add(std::make_unique<Residual>(std::move(mlp)));
  return block;
}

ModulePtr make_gpt_block(int64_t width, int64_t heads, Rng& rng, bool copy_gemm_inputs) {
  GptConfig cfg;
  cfg.width = width;
  cfg.heads = heads;
  cfg.copy_gemm_inputs = copy_gemm_inputs;
  return make_lm_block(cfg, rng);
}

// ------------------------------------------------------------------ GptEmbedding
Placement GptVocabShard::placement(const Shape& local) const {
  if (!sharded()) return {};
  DT_CHECK(!local.empty() && local[0] == rows && offset % rows == 0, "vocabulary shard of " << shape_str(local));
  Shape whole = local;
  whole[0] = rows * ranks;
  std::vector<TpPart> parts;
  for (int r = 0; r < ranks; ++r) parts.push_back(TpPart::row_range(whole, r * rows, rows));
  return split_placement(std::move(parts), static_cast<int>(offset / rows));
}

GptEmbedding::GptEmbedding(Tensor wte, Tensor wpe, int64_t context, GptVocabShard shard)
    : context_(context), shard_(std::move(shard)) {
  DT_CHECK(!shard_.sharded() || (shard_.rows == wte.size(0) && shard_.sum), "vocabulary shard of " << wte.str());
  wte_ = &add_parameter("wte", std::move(wte));
  wte_->placement = shard_.placement(wte_->value.shape());
  if (wpe.defined()) wpe_ = &add_parameter("wpe", std::move(wpe));
}

Tensor GptEmbedding::forward(const Tensor& ids) {
  DT_CHECK(ids.dim() == 2 && ids.dtype() == DType::I32, "gpt needs i32 token ids [B, T], got " << ids.str());
  b_ = ids.size(0);
  t_ = ids.size(1);
  const int64_t c = wte_->value.size(1);
  DT_INPUT_CHECK(t_ >= 1 && position_ + t_ <= context_,
                 "positions " << position_ << " to " << position_ + t_ << " exceed the context " << context_);
  Engine& e = engine(ids);
  keep(ids_, ids);
  ensure(emb_, {b_, t_, c}, ids.device());
  e.embedding_forward(ids, wte_->value, shard_.offset, emb_);
  if (shard_.sharded()) shard_.sum(emb_);  // each row came from the one rank holding its token
  if (!wpe_) return emb_;
  // Position embedding: rows of wpe[0:T] flattened, added to every sequence ([B, T*C] + [T*C]).
  Tensor emb_rows = emb_.reshape({b_, t_ * c});
  e.add_row_bias(emb_rows, wpe_->value.slice0(position_, position_ + t_).reshape({t_ * c}));
  return emb_;
}

Tensor GptEmbedding::backward(const Tensor& demb) {
  const int64_t c = wte_->value.size(1);
  Engine& e = engine(demb);
  if (!wte_->frozen) e.embedding_backward(ids_, demb, shard_.offset, wte_->grad);
  if (wpe_ && !wpe_->frozen) {
    Tensor dpos = wpe_->grad.slice0(0, t_).reshape({t_ * c});
    e.row_bias_grad(demb.reshape({b_, t_ * c}), dpos);
    grad_ready(*wpe_);
  }
  // wte is final only now when the head is tied to it (it collects the unembedding's gradient too).
  grad_ready(*wte_);
  return Tensor();
}

// ------------------------------------------------------------------ GptHead
GptHead::GptHead(const GptConfig& cfg, Parameter* tied, Tensor own_wte, GptVocabShard shard)
    : owns_(tied == nullptr), tied_(cfg.tied), shard_(std::move(shard)), c_(cfg.width) {
  DT_CHECK(cfg.tied || !tied, "an untied head holds its own weight");
  if (!tied) {
    wte_ = &add_parameter(cfg.tied ? "wte" : "lm_head", std::move(own_wte));
    wte_->placement = shard_.placement(wte_->value.shape());
  } else {
    wte_ = tied;
  }
  wte_->gemm_weight = true;  // the unembedding reads it whole
  ln_f_ = make_norm(cfg);
  constexpr int64_t kChunkBytes = int64_t{64} << 20;
  const int64_t v = shard_.sharded() ? shard_.rows : cfg.vocab;
  chunk_rows_ = cfg.head_chunk_rows > 0 ? cfg.head_chunk_rows : std::max<int64_t>(1, kChunkBytes / (4 * v));
}

std::vector<std::pair<std::string, Module*>> GptHead::children() { return {{"ln_f", ln_f_.get()}}; }

Tensor GptHead::forward(const Tensor& h) {
  DT_CHECK(h.dim() == 3 && h.size(2) == c_, "gpt head needs [B, T, " << c_ << "], got " << h.str());
  const int64_t v = vocab();
  m_ = h.size(0) * h.size(1);
  keep(hf_, ln_f_->forward(h));  // [B, T, C]
  if (next_targets_.defined()) {
    score();
    return stats_;
  }
  targets_ = Tensor();
  ensure(logits_, {m_, v}, h.device());
  Engine& e = engine(h);
  e.gemm(false, true, m_, v, c_, 1.f, hf_, gemm_operand(e, *wte_, m_, v), 0.f, logits_);  // hf wte^T
  return logits_;
}

Tensor GptHead::chunk_logits(int64_t r0, int64_t r1) {
  const int64_t v = vocab(), rows = r1 - r0;
  Engine& e = engine(hf_);
  Tensor logits = chunk_.reshape({chunk_.numel()}).slice0(0, rows * v).reshape({rows, v});
  e.gemm(false, true, rows, v, c_, 1.f, hf_.reshape({m_, c_}).slice0(r0, r1), gemm_operand(e, *wte_, rows, v), 0.f,
         logits);
  return logits;
}

// Chunk by chunk: the logits, their row maxima (max-reduced over a shard's ranks), the sums of
// exponentials and the target logits (sum-reduced), into the rows' statistics. Training, the chunk
// then becomes d(loss sum)/d(logits) = softmax - onehot in place, and from it this forward keeps
// d(hf) and (unless the weight is frozen) d(wte) of the loss sum, which backward scales.
void GptHead::score() {
  keep(targets_, std::exchange(next_targets_, Tensor()));
  DT_CHECK(targets_.dtype() == DType::I32 && targets_.numel() == m_,
           "gpt head: " << targets_.str() << " targets for " << m_ << " rows");
  const Device dev = hf_.device();
  Engine& e = engine(hf_);
  const int64_t v = vocab();
  const bool grads = training(), weight_grad = grads && !wte_->frozen;
  ensure(stats_, {3, m_}, dev);
  if (grads) ensure(dhf_unit_, hf_.shape(), dev);
  if (weight_grad) ensure(dwte_unit_, wte_->value.shape(), dev);
  ensure_temp(chunk_, {std::min(chunk_rows_, m_), v}, dev);
  ensure_temp(partial_, {2 * std::min(chunk_rows_, m_)}, dev);
  const Tensor labels = targets_.reshape({m_}), hf = hf_.reshape({m_, c_});
  for (int64_t r0 = 0; r0 < m_; r0 += chunk_rows_) {
    const int64_t r1 = std::min(m_, r0 + chunk_rows_), rows = r1 - r0;
    Tensor logits = chunk_logits(r0, r1);
    Tensor rowmax = row_stat(0, r0, r1), sumexp_rows = row_stat(1, r0, r1), target_rows = row_stat(2, r0, r1);
    e.row_max(logits, rowmax);
    if (shard_.sharded()) shard_.max(rowmax);
    Tensor both = partial_.slice0(0, 2 * rows), sumexp = both.slice0(0, rows), target = both.slice0(rows, 2 * rows);
    e.vocab_xent_partials(logits, labels.slice0(r0, r1), shard_.offset, rowmax, sumexp, target);
    if (shard_.sharded()) shard_.sum(both);
    e.copy(sumexp, sumexp_rows);
    e.copy(target, target_rows);
    if (!grads) continue;
    e.vocab_xent_backward(logits, labels.slice0(r0, r1), shard_.offset, rowmax, sumexp_rows, 1.f, logits);
    Tensor dhf_rows = dhf_unit_.reshape({m_, c_}).slice0(r0, r1);
    e.gemm(false, false, rows, c_, v, 1.f, logits, gemm_operand(e, *wte_, rows, c_), 0.f, dhf_rows);
    if (weight_grad) e.gemm(true, false, v, c_, rows, 1.f, logits, hf.slice0(r0, r1), r0 == 0 ? 0.f : 1.f, dwte_unit_);
  }
}

Tensor GptHead::backward(const Tensor& dy) {
  Engine& e = engine(hf_);
  Tensor* dhf = &dhf_;
  if (targets_.defined()) {  // scored: the forward's gradients of the loss sum, times d(loss)/d(loss sum)
    DT_CHECK(dy.numel() == 1 && dhf_unit_.defined(),
             "a scoring gpt head's backward takes d(loss)/d(loss sum) after a training forward, got " << dy.str());
    const float dloss = to_host(dy).f32()[0];
    e.scale(dhf_unit_, dloss);
    if (!wte_->frozen) e.axpy(dloss, dwte_unit_, wte_->grad);
    dhf = &dhf_unit_;
  } else {
    const int64_t v = vocab();
    DT_CHECK(dy.numel() == m_ * v, "gpt head backward got " << dy.str());
    ensure(dhf_, hf_.shape(), hf_.device());
    e.gemm(false, false, m_, c_, v, 1.f, dy, gemm_operand(e, *wte_, m_, c_), 0.f, dhf_);  // dhf = dlogits wte
    if (!wte_->frozen) e.gemm(true, false, v, c_, m_, 1.f, dy, hf_, 1.f, wte_->grad);  // dwte += dlogits^T hf
  }
  if (shard_.sharded()) shard_.sum(*dhf);  // every rank's vocabulary columns contribute
  if (owns_) grad_ready(*wte_);
  return ln_f_->backward(*dhf);
}

bool lm_head_fused() {
  const std::string want = env::get("DTRAIN_LM_HEAD");
  DT_INPUT_CHECK(want == "fused" || want == "materialized",
                 "environment variable DTRAIN_LM_HEAD='" << want << "' is not fused or materialized");
  return want == "fused";
}

// ------------------------------------------------------------------ Gpt
Gpt::Gpt(const GptConfig& cfg, const GptBlockFactory& blocks, GptPart part, bool checkpoint_blocks, GptVocabShard vocab)
    : cfg_(cfg), part_(part) {
  DT_INPUT_CHECK(cfg.vocab > 0 && cfg.context > 0 && cfg.layers > 0 && cfg.width > 0,
                 "gpt needs positive vocab, context, layers and width");
  if (part_.end_block < 0) part_.end_block = cfg.layers;
  DT_INPUT_CHECK(part_.first_block >= 0 && part_.first_block <= part_.end_block && part_.end_block <= cfg.layers,
                 "gpt part: blocks [" << part_.first_block << ", " << part_.end_block << ") of " << cfg.layers);
  Rng rng(cfg.seed);
  // Embeddings N(0, 0.02) as GPT-2; the Linear layers keep PyTorch's default init (as the peer).
  auto normal = [&](const Shape& s) {
    Tensor t = Tensor::empty(s);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = 0.02f * rng.normal();
    return t;
  };
  auto own_rows = [&](Tensor t) {  // this rank's rows of a vocabulary table
    if (!vocab.sharded()) return t;
    DT_INPUT_CHECK(vocab.offset >= 0 && vocab.offset + vocab.rows <= cfg.vocab,
                   "vocabulary shard [" << vocab.offset << ", " << vocab.offset + vocab.rows << ") of " << cfg.vocab);
    return t.slice0(vocab.offset, vocab.offset + vocab.rows).clone();
  };
  Tensor wte = own_rows(normal({cfg.vocab, cfg.width}));
  Tensor wpe = cfg.rotary ? Tensor() : normal({cfg.context, cfg.width});
  if (part_.embed) embed_ = std::make_unique<GptEmbedding>(wte, wpe, cfg.context, vocab);
  // Every block is drawn (the RNG stream must not depend on the cut); the part keeps its own.
  auto pool = std::make_shared<std::vector<Tensor>>();  // recomputation buffers, shared by the blocks
  for (int64_t l = 0; l < cfg.layers; ++l) {
    ModulePtr b = blocks ? blocks(l, rng) : make_lm_block(cfg, rng, nullptr, l);
    if (l < part_.first_block || l >= part_.end_block) continue;
    if (checkpoint_blocks) b = std::make_unique<Checkpointed>(std::move(b), pool);
    if (cfg.sink) cfg.sink->unit_built({b.get()});
    blocks_.emplace_back("blocks." + std::to_string(l), std::move(b));
  }
  Tensor lm_head = cfg.tied ? Tensor() : own_rows(normal({cfg.vocab, cfg.width}));  // after the blocks
  if (part_.head) {
    Parameter* tied = cfg.tied && embed_ ? &embed_->wte() : nullptr;
    head_ = std::make_unique<GptHead>(cfg, tied, tied ? Tensor() : cfg.tied ? wte : lm_head, vocab);
  }
  wte = wpe = lm_head = Tensor();  // the embedding and head hold them (or the sink its block of them)
  cfg_.sink = nullptr;             // the sink lives as long as the build only
  if (!cfg.sink) return;
  const bool tied = cfg.tied && embed_ && head_;
  if (tied) cfg.sink->unit_built({embed_.get(), head_.get()});
  if (embed_ && !tied) cfg.sink->unit_built({embed_.get()});
  if (head_ && !tied) cfg.sink->unit_built({head_.get()});
}

void Gpt::score_next(Tensor targets) {
  DT_CHECK(head_, "only the part of a gpt with the head scores targets");
  head_->score_next(std::move(targets));
}

std::string Gpt::kind() const {
  std::string k = std::string(cfg_.llama() ? "Llama" : "Gpt") + "(layers=" + std::to_string(cfg_.layers) +
                  ", width=" + std::to_string(cfg_.width) + ", heads=" + std::to_string(cfg_.heads) +
                  (cfg_.kv() != cfg_.heads ? ", kv_heads=" + std::to_string(cfg_.kv()) : "") +
                  (cfg_.llama() ? ", mlp=" + std::to_string(cfg_.hidden()) : "") +
                  ", context=" + std::to_string(cfg_.context) + ", vocab=" + std::to_string(cfg_.vocab) + ")";
  if (!part_.embed || !part_.head || part_.first_block > 0 || part_.end_block < cfg_.layers)
    k += " blocks [" + std::to_string(part_.first_block) + ", " + std::to_string(part_.end_block) + ")" +
         (part_.embed ? " + embedding" : "") + (part_.head ? " + head" : "");
  return k;
}

std::vector<std::pair<std::string, Module*>> Gpt::children() {
  std::vector<std::pair<std::string, Module*>> out;
  if (embed_) out.emplace_back("", embed_.get());
  for (auto& [name, b] : blocks_) out.emplace_back(name, b.get());
  if (head_) out.emplace_back("", head_.get());
  return out;
}

Tensor Gpt::forward(const Tensor& x) {
  Tensor h = embed_ ? embed_->run_forward(x) : x;
  if (!embed_)
    DT_CHECK(h.dim() == 3 && h.size(2) == cfg_.width, kind() << " needs activations [B, T, C], got " << h.str());
  // The blocks' temporaries are scratch: one set shared by all blocks, as in backward.
  for (auto& [name, b] : blocks_) {
    b->give_buffers(std::move(scratch_), true);
    h = b->run_forward(h);
    scratch_ = b->take_buffers(true);
  }
  return head_ ? head_->run_forward(h) : h;
}

Tensor Gpt::backward(const Tensor& dy) {
  PhaseScope phase(Phase::Backward);
  Tensor g = head_ ? head_->run_backward(dy) : dy;
  // The blocks share one set of scratch buffers, taken in turn. Block l's d(input), which block
  // l-1 reads, lies in the slot of the attention residual's d(input), which block l-1 writes last,
  // after the last read of its d(output); no other slot holds it.
  for (size_t i = blocks_.size(); i-- > 0;) {
    Module& b = *blocks_[i].second;
    b.give_buffers(std::move(scratch_), true);
    g = b.run_backward(g);
    scratch_ = b.take_buffers(true);
  }
  return embed_ ? embed_->run_backward(g) : g;
}

// The embedding and a head tied to it are one unit (the weight they share is gathered once, from
// the embedding's forward to the head's, and its gradient is whole after the embedding's backward).
ShardUnits Gpt::shard_units() {
  ShardUnits units;
  const bool tied = cfg_.tied && embed_ && head_;
  int next = 0;
  if (embed_) {
    units.entries.push_back(embed_.get());
    units.unit_of.push_back(next++);
  }
  for (auto& [name, b] : blocks_) {
    units.entries.push_back(b.get());
    units.unit_of.push_back(next++);
  }
  if (head_) {
    units.entries.push_back(head_.get());
    units.unit_of.push_back(tied ? 0 : next++);
  }
  return units;
}

// Multiply-adds per token, forward; backward is about twice that. Attention: q k^T and att v over
// the T positions (half of them masked, but computed).
GptCosts gpt_costs(const GptConfig& c, int64_t seq_len) {
  const double w = static_cast<double>(c.width), t = static_cast<double>(seq_len);
  GptCosts k;
  const double hd = w / static_cast<double>(c.heads), qkv = (static_cast<double>(c.heads) + 2.0 * c.kv()) * hd;
  k.block = w * qkv + w * w + (c.swiglu ? 3.0 : 2.0) * w * static_cast<double>(c.hidden()) + 2.0 * t * w;
  k.head = static_cast<double>(c.vocab) * w + 10.0 * w;
  k.embed = 2.0 * w;
  return k;
}

namespace {

// The parameter count in N's arithmetic: in long double first, to know int64 can hold it.
template <typename N>
N parameter_count_in(const GptConfig& c) {
  const N w = c.width, f = c.hidden(), norm = c.rms_norm ? 1 : 2;
  const N qkv = N(c.width / c.heads) * (c.heads + 2 * c.kv());
  const N block =
      w * qkv + w * w + (c.swiglu ? 3 : 2) * w * f + (c.bias ? qkv + (c.swiglu ? 2 : 1) * f + 2 * w : 0) + 2 * norm * w;
  return N(c.vocab) * w * (c.tied ? 1 : 2) + (c.rotary ? 0 : N(c.context) * w) + N(c.layers) * block + norm * w;
}

}  // namespace

int64_t gpt_parameter_count(const GptConfig& c) {
  constexpr int64_t kHuge = int64_t{1} << 40;  // every size below it: hidden() and the counts cannot overflow
  for (int64_t v : {c.vocab, c.context, c.layers, c.width, c.heads, c.kv_heads, c.mlp_width})
    if (v > kHuge) return -1;
  if (c.vocab <= 0 || c.context <= 0 || c.layers <= 0 || c.width <= 0 || c.heads <= 0 || c.kv() <= 0 || c.hidden() <= 0)
    return -1;
  if (parameter_count_in<long double>(c) > static_cast<long double>(std::numeric_limits<int64_t>::max() / 2)) return -1;
  return parameter_count_in<int64_t>(c);
}

}  // namespace dtrain::nn

// GPT pieces: causal self-attention and the GPT model (embeddings, blocks, tied unembedding). All
// compute goes through the Engine, so the same code runs on the CPU and CUDA engines.
#include "dtrain/nn/gpt.h"

#include <cmath>

namespace dtrain::nn {

// ------------------------------------------------------------------ SelfAttention
SelfAttention::SelfAttention(int64_t width, int64_t heads, Rng& rng)
    : c_(width), h_(heads), hd_(heads > 0 ? width / heads : 0) {
  DT_INPUT_CHECK(width > 0 && heads > 0 && width % heads == 0,
                 "attention width " << width << " must be a positive multiple of the head count " << heads);
  qkv_ = std::make_unique<Linear>(c_, 3 * c_, true, rng);
  proj_ = std::make_unique<Linear>(c_, c_, true, rng);
  qkv_->set_output_temporary(true);   // permuted into qkvh_ at once
  proj_->set_output_temporary(true);  // used up by the residual add
}

SelfAttention::SelfAttention(ModulePtr qkv, ModulePtr proj, int64_t width, int64_t local_heads, int64_t head_dim)
    : c_(width), h_(local_heads), hd_(head_dim), qkv_(std::move(qkv)), proj_(std::move(proj)) {
  DT_INPUT_CHECK(width > 0 && local_heads > 0 && head_dim > 0,
                 "attention width " << width << ", " << local_heads << " heads of " << head_dim);
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
         ", heads=" + std::to_string(h_) + ")";
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

// Heads in the layout [3, B, H, T, hd] (q, k and v each [B*H, T, hd]), so every product below is
// ONE batched GEMM over all B*H heads with uniform strides (one launch on a GPU, not one per
// sequence). From qkv [B, T, 3, H, hd]: [B*T, 3, C] -> [3, B*T, C] = [3B, T, H, hd] -> [3B, H, T, hd].
Tensor SelfAttention::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 3 && x.size(2) == c_, kind() << " needs input [B, T, " << c_ << "], got " << x.str());
  b_ = x.size(0);
  t_ = x.size(1);
  Device dev = x.device();
  Engine& e = engine(x);
  Tensor qkv = qkv_->forward(x);  // [B, T, 3*H*hd]
  const int64_t hc = h_ * hd_, bh = b_ * h_;
  DT_CHECK(qkv.numel() == b_ * t_ * 3 * hc, kind() << ": qkv gave " << qkv.str());
  ensure_temp(split_, {3, b_ * t_, hc}, dev);
  e.permute_0213(qkv, 1, b_ * t_, 3, hc, split_);  // [3, B*T, H*hd]
  low_ = !e.rounds_gemm(t_, t_) || !e.rounds_gemm(t_, hd_) ? DType::F32
         : e.math_precision() == MathPrecision::F16        ? DType::F16
                                                           : DType::BF16;
  if (low_ == DType::F32) {
    ensure(qkvh_, {3 * bh, t_, hd_}, dev);
    e.permute_0213(split_, 3 * b_, t_, h_, hd_, qkvh_);  // [3B, H, T, hd]
  } else {
    e.permute_0213(split_, 3 * b_, t_, h_, hd_, ensure_temp(wide_, {3 * bh, t_, hd_}, dev));
    e.cast(wide_, ensure(qkvh_, {3 * bh, t_, hd_}, dev, low_));
  }
  ensure_temp(scores_, {bh, t_, t_}, dev);  // dead once softmax has run
  ensure(att_, {bh, t_, t_}, dev);
  ensure_temp(yh_, {bh, t_, hd_}, dev);  // permuted into y_ at once
  Tensor heads = qkvh_.reshape({3 * bh, t_ * hd_});
  Tensor q = heads.slice0(0, bh), k = heads.slice0(bh, 2 * bh), v = heads.slice0(2 * bh, 3 * bh);
  const int64_t qs = t_ * hd_, ss = t_ * t_;
  e.gemm_batched(bh, false, true, t_, t_, hd_, 1.f, q, qs, k, qs, 0.f, scores_, ss);  // s = q k^T [T, T]
  e.attention_softmax_forward(scores_, t_, 1.f / std::sqrt(static_cast<float>(hd_)), causal_, att_);
  e.gemm_batched(bh, false, false, t_, hd_, t_, 1.f, att_, ss, v, qs, 0.f, yh_, qs);  // y = att v [T, hd]
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
  const int64_t hc = h_ * hd_, bh = b_ * h_;
  Tensor dy = proj_->backward(dout);  // [B, T, H*hd]
  ensure(dyh_, {bh, t_, hd_}, dev);
  e.permute_0213(dy, b_, t_, h_, hd_, dyh_);
  ensure(datt_, {bh, t_, t_}, dev);
  // The raw scores are dead once softmax has run: their (scratch) buffer takes d(scores).
  keep(dscores_, ensure_temp(scores_, {bh, t_, t_}, dev));
  ensure(dqkvh_, {3 * bh, t_, hd_}, dev);
  Tensor heads = qkvh_.reshape({3 * bh, t_ * hd_}), dheads = dqkvh_.reshape({3 * bh, t_ * hd_});
  Tensor q = heads.slice0(0, bh), k = heads.slice0(bh, 2 * bh), v = heads.slice0(2 * bh, 3 * bh);
  Tensor dq = dheads.slice0(0, bh), dk = dheads.slice0(bh, 2 * bh), dv = dheads.slice0(2 * bh, 3 * bh);
  const int64_t qs = t_ * hd_, ss = t_ * t_;
  const Tensor* g = &dyh_;
  if (low_ != DType::F32) {
    DT_CHECK(qkvh_.dtype() == low_, kind() << ": heads held in " << dtype_name(qkvh_.dtype()));
    e.cast(dyh_, ensure_temp(dyh_low_, dyh_.shape(), dev, low_));
    g = &dyh_low_;
  }
  e.gemm_batched(bh, false, true, t_, t_, hd_, 1.f, *g, qs, v, qs, 0.f, datt_, ss);  // datt = dy v^T
  e.gemm_batched(bh, true, false, t_, hd_, t_, 1.f, att_, ss, *g, qs, 0.f, dv, qs);  // dv = att^T dy
  e.attention_softmax_backward(att_, datt_, t_, 1.f / std::sqrt(static_cast<float>(hd_)), causal_, dscores_);
  const Tensor* ds = &dscores_;
  if (low_ != DType::F32) {
    e.cast(dscores_, ensure_temp(ds_low_, dscores_.shape(), dev, low_));
    ds = &ds_low_;
  }
  e.gemm_batched(bh, false, false, t_, hd_, t_, 1.f, *ds, ss, k, qs, 0.f, dq, qs);  // dq = ds k (scale in ds)
  e.gemm_batched(bh, true, false, t_, hd_, t_, 1.f, *ds, ss, q, qs, 0.f, dk, qs);   // dk = ds^T q
  // Back to [B, T, 3, H, hd]: [3B, H, T, hd] -> [3B, T, H, hd] = [3, B*T, C] -> [B*T, 3, C].
  ensure_temp(split_, {3, b_ * t_, hc}, dev);
  e.permute_0213(dqkvh_, 3 * b_, h_, t_, hd_, split_);
  ensure(dqkv_, {b_, t_, 3 * hc}, dev);
  e.permute_0213(split_, 1, 3, b_ * t_, hc, dqkv_);
  return qkv_->backward(dqkv_);
}

// ------------------------------------------------------------------ blocks
ModulePtr make_gpt_block(int64_t width, int64_t heads, Rng& rng, bool copy_gemm_inputs) {
  auto attn = std::make_unique<Sequential>();
  auto ln1 = std::make_unique<LayerNorm>(width);
  auto att = std::make_unique<SelfAttention>(width, heads, rng);
  auto mlp = std::make_unique<Sequential>();
  auto ln2 = std::make_unique<LayerNorm>(width);
  auto fc1 = std::make_unique<Linear>(width, 4 * width, true, rng);
  ModulePtr gelu = GELU();
  auto fc2 = std::make_unique<Linear>(4 * width, width, true, rng);
  fc2->set_output_temporary(true);  // used up by the residual add
  if (copy_gemm_inputs) {
    // Each of these outputs has one reader, a Linear that now keeps its own (bf16) copy.
    att->copy_gemm_inputs();
    fc1->set_copy_input(true);
    fc2->set_copy_input(true);
    ln1->set_output_temporary(true);
    ln2->set_output_temporary(true);
    gelu->set_output_temporary(true);
  }
  attn->add(std::move(ln1));
  attn->add(std::move(att));
  mlp->add(std::move(ln2));
  mlp->add(std::move(fc1));
  mlp->add(std::move(gelu));
  mlp->add(std::move(fc2));
  auto block = std::make_unique<Sequential>();
  block->add(std::make_unique<Residual>(std::move(attn)));
  block->add(std::make_unique<Residual>(std::move(mlp)));
  return block;
}

// ------------------------------------------------------------------ GptEmbedding
GptEmbedding::GptEmbedding(Tensor wte, Tensor wpe, GptVocabShard shard) : shard_(std::move(shard)) {
  DT_CHECK(!shard_.sharded() || (shard_.rows == wte.size(0) && shard_.sum), "vocabulary shard of " << wte.str());
  wte_ = &add_parameter("wte", std::move(wte));
  wpe_ = &add_parameter("wpe", std::move(wpe));
}

Tensor GptEmbedding::forward(const Tensor& ids) {
  DT_CHECK(ids.dim() == 2 && ids.dtype() == DType::I32, "gpt needs i32 token ids [B, T], got " << ids.str());
  b_ = ids.size(0);
  t_ = ids.size(1);
  const int64_t c = wte_->value.size(1);
  DT_INPUT_CHECK(t_ >= 1 && t_ <= wpe_->value.size(0),
                 "sequence length " << t_ << " exceeds the context " << wpe_->value.size(0));
  Engine& e = engine(ids);
  keep(ids_, ids);
  ensure(emb_, {b_, t_, c}, ids.device());
  e.embedding_forward(ids, wte_->value, shard_.offset, emb_);
  if (shard_.sharded()) shard_.sum(emb_);  // each row came from the one rank holding its token
  // Position embedding: rows of wpe[0:T] flattened, added to every sequence ([B, T*C] + [T*C]).
  Tensor emb_rows = emb_.reshape({b_, t_ * c});
  e.add_row_bias(emb_rows, wpe_->value.slice0(0, t_).reshape({t_ * c}));
  return emb_;
}

Tensor GptEmbedding::backward(const Tensor& demb) {
  const int64_t c = wte_->value.size(1);
  Engine& e = engine(demb);
  e.embedding_backward(ids_, demb, shard_.offset, wte_->grad);
  Tensor dpos = wpe_->grad.slice0(0, t_).reshape({t_ * c});
  e.row_bias_grad(demb.reshape({b_, t_ * c}), dpos);
  // wte is final only now when the head is tied to it (it collects the unembedding's gradient too).
  grad_ready(*wpe_);
  grad_ready(*wte_);
  return Tensor();
}

// ------------------------------------------------------------------ GptHead
GptHead::GptHead(int64_t width, Parameter* tied, Tensor own_wte, GptVocabShard shard)
    : owns_(tied == nullptr), shard_(std::move(shard)), c_(width) {
  wte_ = tied ? tied : &add_parameter("wte", std::move(own_wte));
  wte_->gemm_weight = true;  // the unembedding reads it whole
  ln_f_ = std::make_unique<LayerNorm>(width);
}

std::vector<std::pair<std::string, Module*>> GptHead::children() { return {{"ln_f", ln_f_.get()}}; }

Tensor GptHead::forward(const Tensor& h) {
  DT_CHECK(h.dim() == 3 && h.size(2) == c_, "gpt head needs [B, T, " << c_ << "], got " << h.str());
  const int64_t v = wte_->value.size(0);
  m_ = h.size(0) * h.size(1);
  keep(hf_, ln_f_->forward(h));  // [B, T, C]
  ensure(logits_, {m_, v}, h.device());
  Engine& e = engine(h);
  e.gemm(false, true, m_, v, c_, 1.f, hf_, gemm_operand(e, *wte_, m_, v), 0.f, logits_);  // hf wte^T
  return logits_;
}

Tensor GptHead::backward(const Tensor& dlogits) {
  const int64_t v = wte_->value.size(0);
  DT_CHECK(dlogits.numel() == m_ * v, "gpt head backward got " << dlogits.str());
  Engine& e = engine(dlogits);
  ensure(dhf_, hf_.shape(), dlogits.device());
  e.gemm(false, false, m_, c_, v, 1.f, dlogits, gemm_operand(e, *wte_, m_, c_), 0.f, dhf_);  // dhf = dlogits wte
  e.gemm(true, false, v, c_, m_, 1.f, dlogits, hf_, 1.f, wte_->grad);                        // dwte += dlogits^T hf
  if (shard_.sharded()) shard_.sum(dhf_);  // every rank's vocabulary columns contribute
  if (owns_) grad_ready(*wte_);
  return ln_f_->backward(dhf_);
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
  Tensor wte = normal({cfg.vocab, cfg.width});
  Tensor wpe = normal({cfg.context, cfg.width});
  if (vocab.sharded()) {
    DT_INPUT_CHECK(vocab.offset >= 0 && vocab.offset + vocab.rows <= cfg.vocab,
                   "vocabulary shard [" << vocab.offset << ", " << vocab.offset + vocab.rows << ") of " << cfg.vocab);
    wte = wte.slice0(vocab.offset, vocab.offset + vocab.rows).clone();
  }
  if (part_.embed) embed_ = std::make_unique<GptEmbedding>(wte, wpe, vocab);
  // Every block is drawn (the RNG stream must not depend on the cut); the part keeps its own.
  auto pool = std::make_shared<std::vector<Tensor>>();  // recomputation buffers, shared by the blocks
  for (int64_t l = 0; l < cfg.layers; ++l) {
    ModulePtr b = blocks ? blocks(l, rng) : make_gpt_block(cfg.width, cfg.heads, rng, cfg.copy_gemm_inputs);
    if (l < part_.first_block || l >= part_.end_block) continue;
    if (checkpoint_blocks) b = std::make_unique<Checkpointed>(std::move(b), pool);
    if (cfg.sink) cfg.sink->unit_built({b.get()});
    blocks_.emplace_back("blocks." + std::to_string(l), std::move(b));
  }
  if (part_.head)
    head_ = std::make_unique<GptHead>(cfg.width, embed_ ? &embed_->wte() : nullptr, embed_ ? Tensor() : wte, vocab);
  wte = wpe = Tensor();  // the embedding holds them (or the sink its block of them)
  cfg_.sink = nullptr;   // the sink lives as long as the build only
  if (!cfg.sink) return;
  const bool tied = embed_ && head_;
  if (tied) cfg.sink->unit_built({embed_.get(), head_.get()});
  if (embed_ && !tied) cfg.sink->unit_built({embed_.get()});
  if (head_ && !tied) cfg.sink->unit_built({head_.get()});
}

std::string Gpt::kind() const {
  std::string k = "Gpt(layers=" + std::to_string(cfg_.layers) + ", width=" + std::to_string(cfg_.width) +
                  ", heads=" + std::to_string(cfg_.heads) + ", context=" + std::to_string(cfg_.context) +
                  ", vocab=" + std::to_string(cfg_.vocab) + ")";
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
  const bool tied = embed_ && head_ && !head_->owns_wte();
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
  k.block = 12.0 * w * w + 2.0 * t * w;
  k.head = static_cast<double>(c.vocab) * w + 10.0 * w;
  k.embed = 2.0 * w;
  return k;
}

}  // namespace dtrain::nn

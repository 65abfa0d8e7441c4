#pragma once
// A GPT (decoder-only transformer) with hand-written backward: token and position embeddings,
// pre-LayerNorm blocks of causal self-attention and a GELU MLP with residuals, a final LayerNorm,
// and an unembedding tied to the token embedding. Shapes: B batch, T positions (<= context),
// C width, H heads (C % H == 0), V vocabulary (256 for bytes).
#include <functional>
#include <memory>
#include <string>

#include "dtrain/core/rng.h"
#include "dtrain/kernels/attention.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

struct GptConfig {
  int64_t vocab = 256;
  int64_t context = 128;
  int64_t layers = 6;
  int64_t heads = 8;
  int64_t width = 256;
  uint64_t seed = 1;
  // The blocks' Linear layers keep their own copies of their inputs (bf16/f16 under bf16/fp16 math) and
  // the LayerNorm, GELU and attention outputs feeding them become temporaries: under bf16/fp16 the
  // activations the GEMMs read are held in 16 bits, half the bytes, with the same arithmetic.
  bool copy_gemm_inputs = false;
  // The Llama family's choices (the defaults are GPT-2's; llama_shape() sets all of them).
  int64_t kv_heads = 0;   // key/value heads: 0 = heads (multi-head); fewer (dividing heads): grouped-query
  int64_t mlp_width = 0;  // the MLP's hidden width: 0 = 4 * width
  bool rms_norm = false;  // RMSNorm (weight only) instead of LayerNorm, in the blocks and before the head
  bool rotary = false;    // rotary positions on q and k instead of a learned position table
  float rope_base = 10000.f;
  bool swiglu = false;  // MLP = down(silu(gate x) * up x) instead of fc2(gelu(fc x))
  bool bias = true;     // biases on the blocks' Linear layers
  bool tied = true;     // the unembedding is the token embedding; else a weight of its own ("lm_head")
  float norm_eps = 1e-5f;
  // Rows of logits a scoring head (GptHead::score_next) computes at a time: 0 = as many as fill
  // 64 MiB of f32 logits.
  int64_t head_chunk_rows = 0;
  // LoRA adapters (nn::Linear::add_lora) on the blocks' projections named in `lora_targets` (q, k,
  // v, o, gate, up, down; GPT-2's MLP is up and down), drawn from a stream of their own per block.
  int64_t lora_rank = 0;  // 0: none
  float lora_alpha = 16.f;
  std::string lora_targets = "q,v";
  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t hidden() const { return mlp_width > 0 ? mlp_width : 4 * width; }
  bool llama() const { return rms_norm; }
  // Given each unit as it is built (the blocks in order, then the embedding with the head): ZeRO-3
  // keeps this rank's blocks of them. Drawn values are the same with or without one.
  UnitSink* sink = nullptr;
};

// x [B, T, C] -> y [B, T, C]: y = proj(softmax(q k^T / sqrt(C/H)) v), heads concatenated; causal
// (each position sees itself and the ones before it: the GPT) unless set_causal(false) (every
// position sees every one: a ViT's encoder).
class SelfAttention : public Module {
 public:
  SelfAttention(int64_t width, int64_t heads, Rng& rng);
  // With given projections (tensor parallel: a column-parallel qkv producing this rank's
  // `local_heads` q, k and v heads, [.., 3 * local_heads * head_dim], and a row-parallel proj
  // taking [.., local_heads * head_dim] back to the full width).
  // `local_kv_heads` (0: as many as the query heads) makes it grouped-query attention: the qkv
  // projection then gives [.., (local_heads + 2 * local_kv_heads) * head_dim], and query head h
  // reads key/value head h / (local_heads / local_kv_heads).
  SelfAttention(ModulePtr qkv, ModulePtr proj, int64_t width, int64_t local_heads, int64_t head_dim,
                int64_t local_kv_heads = 0);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override;
  std::vector<std::pair<std::string, Module*>> children() override;
  void set_needs_input_grad(bool needed) override;
  // qkv and proj keep their own (bf16/f16 under bf16/fp16 math) input copies; y_ becomes a temporary.
  void copy_gemm_inputs();
  void set_causal(bool causal) { causal_ = causal; }
  // Rotary positions (the Llama family's) on q and k, with frequencies base^(-2i/head_dim), for
  // sequences up to `context` positions.
  void set_rotary(float base, int64_t context);
  // Cached decoding: keys and values of up to `capacity` positions per sequence; then a forward at
  // position 0 is a whole causal prompt, and one at position p > 0 takes one new token per
  // sequence, attending to the p cached ones and itself. Forward only.
  void start_decoding(int64_t capacity) override;
  void decode_at(int64_t position) override { position_ = position; }
  // Parameters named as torch.nn.MultiheadAttention's: "in_proj_weight", "in_proj_bias" (the qkv
  // projection; its rows q, k, v, each head-major, are torch's layout too) and "out_proj.*".
  void name_as_torch_multihead();

 private:
  int64_t c_, h_, hd_, kvh_;  // input width, query heads on this rank, head width, key/value heads on this rank
  bool copies_ = false, causal_ = true;
  float rope_base_ = 0;  // > 0: rotary positions
  int64_t rope_context_ = 0;
  Tensor rope_;  // [context, hd]: cos | sin per position, on the activations' device
  const Tensor& rope_table(Device dev);
  int64_t capacity_ = 0, position_ = 0;  // cached decoding: positions kept, where the input starts
  Tensor kcache_, vcache_;               // [B, KV, capacity, hd]
  Tensor forward_cached(const Tensor& x);
  std::string qkv_name_ = "qkv", proj_name_ = "proj";
  int64_t b_ = 0, t_ = 0;
  ModulePtr qkv_, proj_;  // C -> (H + 2 KV)*hd (q, k, v each head-major), H*hd -> C
  void split_heads(Engine& e, const Tensor& qkv, Tensor& heads);
  void merge_heads(Engine& e, const Tensor& heads, Tensor& dqkv);
  AttentionShape attention_shape(int64_t kv_len, int64_t kv_stride, int64_t q_offset) const;
  // The q, k and v views of heads held as one tensor [B*H*T*hd | B*KV*T*hd | B*KV*T*hd] (qkvh_, dqkvh_).
  struct Heads {
    Tensor q, k, v;
  };
  Heads heads_of(const Tensor& flat) const;
  // qkvh_: q [B, H, T, hd], then k and v [B, KV, T, hd] each; yh_ (the attention's output) [B*H, T,
  // hd] and lse_ [B*H*T] (its log-sum-exp, from which backward recomputes the probabilities: no
  // [T, T] tensor is kept); y_ [B, T, H*hd]; split_ [H + 2 KV, B*T, hd] (between the permutes, scratch)
  Tensor qkvh_, yh_, lse_, y_, split_;
  Tensor dyh_, dqkvh_, dqkv_;
  // Where every attention GEMM would round its operands to bf16/f16 (Engine::rounds_gemm), the
  // heads are held in that precision (qkvh_ then is a low-precision copy of wide_, scratch): half
  // the bytes held for q, k and v; the attention reads them into f32.
  DType low_ = DType::F32;
  Tensor wide_;
};

// GPT-2's shape with the Llama family's choices: RMSNorm, rotary positions (base 10000), SwiGLU with
// `mlp_width` (0: 8/3 of the width rounded up to a multiple of 32, as Llama), `kv_heads` (0: heads),
// no biases, an untied output layer.
void llama_shape(GptConfig& cfg);

// The Linear layers a block is made of: plain ones on one rank; tensor parallelism passes column-
// and row-parallel ones (parallel::tensor_parallel_linears) that keep this rank's part.
struct BlockLinears {
  // in -> the concatenated `blocks` of outputs (q, k, v; gate, up); each block split over `ranks`
  // in whole `unit`s of rows (a head's), or, with fewer units than ranks, one unit on each rank,
  // replicated (key/value heads that do not divide over tp).
  std::function<ModulePtr(int64_t in, const std::vector<int64_t>& blocks, int64_t unit, bool bias, Rng& rng)> column;
  // in -> out taking each rank's share of the inputs.
  std::function<ModulePtr(int64_t in, int64_t out, bool bias, Rng& rng)> row;
  int64_t ranks = 1;
};

// One pre-norm transformer block of `cfg`: x + attn(norm1(x)), then + mlp(norm2(.)); GPT-2's mlp is
// C -> 4C, GELU, -> C, Llama's C -> (gate, up), SwiGLU, -> C. Draws qkv, proj, then the MLP's two
// layers from `rng`, whatever the linears.
ModulePtr make_lm_block(const GptConfig& cfg, Rng& rng, const BlockLinears* linears = nullptr, int64_t layer = 0);
ModulePtr make_gpt_block(int64_t width, int64_t heads, Rng& rng, bool copy_gemm_inputs = false);
// Makes block `layer` drawing its initial weights from `rng` (tensor parallel passes its own).
using GptBlockFactory = std::function<ModulePtr(int64_t layer, Rng& rng)>;

// A vocabulary split over tensor-parallel ranks (Megatron's vocabulary-parallel embedding): this
// rank holds rows [offset, offset + rows) of the token embedding and of the tied unembedding, so
// its logits are those columns; `sum` adds a tensor over the ranks (an allreduce), `max` takes the
// element-wise maximum over them. rows == 0: the whole vocabulary, nothing to add.
struct GptVocabShard {
  int64_t offset = 0, rows = 0;
  int ranks = 1;  // the tp ranks the vocabulary is split over, `rows` each
  std::function<void(Tensor&)> sum, max;
  bool sharded() const { return rows > 0; }
  // Where this rank's rows of a [V, ...] tensor of local shape `local` lie (none when not sharded).
  Placement placement(const Shape& local) const;
};

// Token and position embeddings: ids i32 [B, T] -> [B, T, C]. Parameters "wte" [V, C] (or this
// rank's rows of it), "wpe" [context, C] (none when `wpe` is undefined: rotary positions act in the
// attention). backward returns an undefined tensor (the input is ids).
class GptEmbedding : public Module {
 public:
  GptEmbedding(Tensor wte, Tensor wpe, int64_t context, GptVocabShard shard = {});
  const GptVocabShard& shard() const { return shard_; }
  Tensor forward(const Tensor& ids) override;
  Tensor backward(const Tensor& demb) override;
  std::string kind() const override { return "GptEmbedding"; }
  void start_decoding(int64_t) override { position_ = 0; }
  void decode_at(int64_t position) override { position_ = position; }  // the position table's first row
  Parameter& wte() { return *wte_; }

 private:
  Parameter* wte_;
  Parameter* wpe_ = nullptr;
  int64_t context_, position_ = 0;
  GptVocabShard shard_;
  int64_t b_ = 0, t_ = 0;
  Tensor ids_, emb_;
};

// Final norm and the unembedding: [B, T, C] -> logits [B*T, V] = ln_f(h) wte^T. The weight is
// tied to the token embedding: `tied` is the embedding's own parameter (whole model on one stage),
// or null when this module holds a copy of its own, also named "wte" (the last pipeline stage;
// the two copies' gradients are summed across the stages). An untied model (`cfg.tied` false)
// holds its own weight "lm_head" [V, C]. The norm is `cfg`'s (LayerNorm or RMSNorm).
//
// Scoring (the LM head fused with its cross-entropy): after score_next(targets) the next forward
// computes the logits `cfg.head_chunk_rows` rows at a time and returns, instead of them, the rows'
// softmax statistics [3, B*T] (row max, sum of exponentials, target logit; over the whole
// vocabulary, a shard's reduced over the ranks), from which HeadCrossEntropy takes the loss. A
// training forward also turns each chunk into d(logits) of the loss sum and keeps what they give,
// d(hf) [B*T, C] and d(wte) (the weight's shape; none when it is frozen); backward takes
// d(loss)/d(loss sum), one f32, and scales them. No GEMM is repeated and the [B*T, V] logits
// never exist: one chunk at a time, as scratch.
class GptHead : public Module {
 public:
  // With a vocabulary shard the logits are this rank's columns [B*T, rows] (vocabulary-parallel
  // cross-entropy takes them) and d(input) is summed over the ranks.
  GptHead(const GptConfig& cfg, Parameter* tied, Tensor own_wte = Tensor(), GptVocabShard shard = {});
  const GptVocabShard& shard() const { return shard_; }
  // The next forward scores `targets` (i32 [B*T] on the model's device; kIgnoreLabel: no loss).
  void score_next(Tensor targets) { next_targets_ = std::move(targets); }
  Tensor forward(const Tensor& h) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "GptHead"; }
  std::vector<std::pair<std::string, Module*>> children() override;
  Parameter& wte() { return *wte_; }
  // A copy of the token embedding (a last pipeline stage's), whose gradient is summed with it.
  bool owns_wte() const { return owns_ && tied_; }

 private:
  int64_t vocab() const { return wte_->value.size(0); }
  Tensor chunk_logits(int64_t r0, int64_t r1);  // rows [r0, r1) of hf wte^T, in chunk_
  Tensor row_stat(int which, int64_t r0, int64_t r1) {
    return stats_.slice0(which, which + 1).reshape({m_}).slice0(r0, r1);
  }
  void score();
  Parameter* wte_;
  bool owns_, tied_;
  GptVocabShard shard_;
  ModulePtr ln_f_;
  int64_t m_ = 0, c_, chunk_rows_ = 0;
  Tensor hf_, logits_, dhf_;
  Tensor next_targets_, targets_, stats_, dhf_unit_, dwte_unit_, chunk_, partial_;  // scoring
};

// Which part of the model a Gpt holds: blocks [first_block, end_block) (end -1: to the last),
// with the embedding in front when `embed` and the head behind when `head`. The default is the
// whole model; a pipeline stage holds a part. Every part draws the whole model's initial weights
// from the seed in the same order and keeps its own, so any cut gives the one-rank model.
struct GptPart {
  int64_t first_block = 0, end_block = -1;
  bool embed = true, head = true;
};

// The model, or a pipeline stage of it. Input: ids i32 [B, T] when it holds the embedding, else
// activations [B, T, C]; output: logits [B*T, V] when it holds the head, else [B, T, C].
// backward(d output) returns d(input) (undefined for token ids). Parameter names are those of the
// whole model ("wte", "wpe", "blocks.<l>....", "ln_f.weight"), whatever the part.
class Gpt : public Module {
 public:
  explicit Gpt(const GptConfig& cfg, const GptBlockFactory& blocks = nullptr, GptPart part = {},
               bool checkpoint_blocks = false, GptVocabShard vocab = {});
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override;
  std::vector<std::pair<std::string, Module*>> children() override;
  ShardUnits shard_units() override;  // the blocks; the embedding with the head tied to it
  const GptConfig& config() const { return cfg_; }
  const GptPart& part() const { return part_; }
  // The head's own copy of the tied weight (a last pipeline stage without the embedding), else null.
  Parameter* head_wte_copy() { return head_ && head_->owns_wte() ? &head_->wte() : nullptr; }
  Parameter* embedding_wte() { return embed_ ? &embed_->wte() : nullptr; }
  // The next forward scores `targets` in the head (GptHead::score_next): a part with the head only.
  void score_next(Tensor targets);

 private:
  GptConfig cfg_;
  GptPart part_;
  std::unique_ptr<GptEmbedding> embed_;
  std::vector<std::pair<std::string, ModulePtr>> blocks_;  // ("blocks.<l>", block)
  std::vector<Tensor> scratch_;                            // scratch buffers shared by the blocks
  std::unique_ptr<GptHead> head_;
};

// Whether the LM head scores its targets itself (fused with the cross-entropy, chunked: DTRAIN_LM_HEAD
// fused, the default) or returns the whole logits to a separate loss (materialized: the reference).
bool lm_head_fused();

// Relative compute cost of the embedding, one block and the head (forward + backward FLOPs per
// token), for cutting the model into balanced pipeline stages.
struct GptCosts {
  double embed, block, head;
};
GptCosts gpt_costs(const GptConfig& cfg, int64_t seq_len);

// The parameters of the whole model of `c` (token table, position table unless rotary, `layers`
// blocks, the final norm, an untied output layer), or -1 when a size is not positive or the count
// passes int64: what a checkpoint's tensors must hold before its attributes may size a Gpt.
int64_t gpt_parameter_count(const GptConfig& c);

}  // namespace dtrain::nn

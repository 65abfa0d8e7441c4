#pragma once
// The attention family: softmax(scale q k^T) v as one op that returns the per-row log-sum-exp, and
// its backward, which recomputes the probabilities from it (FlashAttention-2). Two paths:
//   fused         tiles and an online softmax; memory O(T) per head, no [T, T] tensor anywhere
//                 (the CPU engine's; an engine offers it through Engine::fused_attention()).
//   materialised  the scores and probabilities as [B*H, Tq, Tk] tensors through the engine's batched
//                 GEMMs and attention softmax: the tests' reference, and the fallback where an engine
//                 has no fused path (DTRAIN_ATTENTION=materialized asks for it everywhere).
// Shapes: B batch, H query heads, KV key/value heads (dividing H; query head h reads key/value head
// h / (H / KV), so the G = H / KV query heads of a group are consecutive and k, v are never
// repeated), Tq queries, Tk keys, D head width.
#include <cstdint>
#include <string>

#include "dtrain/core/tensor.h"

namespace dtrain {

class Engine;

struct AttentionShape {
  int64_t batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, head_dim = 1;
  // Elements between two key/value heads of k and v: 0 means kv_len * head_dim (dense). A KV cache
  // of `capacity` positions passes capacity * head_dim and kv_len <= capacity.
  int64_t kv_stride = 0;
  // Causal: query i sits at position q_offset + i among the keys and sees keys 0 .. q_offset + i
  // (a prompt: q_offset 0 and q_len == kv_len; a cached decoding step: q_offset = the tokens
  // before it). Otherwise every query sees every key (a ViT's encoder).
  int64_t q_offset = 0;
  bool causal = true;
  float scale = 1.f;  // usually 1 / sqrt(head_dim)
  int64_t group() const { return heads / kv_heads; }
  int64_t kv_head_stride() const { return kv_stride > 0 ? kv_stride : kv_len * head_dim; }
};

// q [B, H, Tq, D]; k, v [B, KV, kv_head_stride] (rows of D); all three f32, bf16 or f16, one dtype
// (low precision is read into f32: the arithmetic and the softmax are f32). out [B, H, Tq, D] f32
// and lse [B, H, Tq] f32 (natural log of each row's sum of exp(scale s)) are written. The tensors
// may be views at any element offset. Throws naming the tensor whose shape or dtype does not fit.
class FusedAttention {
 public:
  virtual ~FusedAttention() = default;
  virtual const char* name() const = 0;
  virtual void forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       Tensor& lse) = 0;
  // Given the forward's inputs, out and lse, and dout [B, H, Tq, D] f32: dq [B, H, Tq, D], dk, dv
  // [B, KV, Tk, D] f32 (dense), overwritten; a key/value head's gradients sum its group's heads.
  virtual void backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) = 0;
};

// The op as layers call it: the engine's fused path unless DTRAIN_ATTENTION=materialized or the
// engine has none (said once on stderr), else the materialised one. lse is written by the fused path
// only; the materialised backward recomputes the probabilities from q and k and does not read it.
void attention_forward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                       Tensor& out, Tensor& lse);
void attention_backward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);
// Which path attention_forward takes on `e`, for the log: "fused (avx512 tiles)", "materialised".
std::string attention_path(Engine& e);

// The materialised path on any engine (the reference). Causal attention needs q_offset 0 with
// q_len == kv_len (a whole sequence) or q_len 1 (one cached decoding step). Under bf16/f16 inputs
// the probabilities and d(scores) are rounded to that type once for their two GEMMs each (the
// engine's GEMMs would round them anyway). Temporaries of [B*H, Tq, Tk] f32 live for one call.
void materialized_attention_forward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k,
                                    const Tensor& v, Tensor& out);
void materialized_attention_backward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);

// Checks the tensors against s (numel, dtypes, devices), naming the one that does not fit.
void check_attention_args(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out);

}  // namespace dtrain

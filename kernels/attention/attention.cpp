// The attention family's entry points: the choice between an engine's fused path and the
// materialised one, the argument checks, and the materialised path written over Engine ops (so it
// runs on every engine: the reference of the fused kernels and the fallback).
#include "dtrain/kernels/attention.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "dtrain/core/env.h"
#include "dtrain/core/error.h"
#include "dtrain/kernels/engine.h"

namespace dtrain {

namespace {

std::string describe(const Tensor& t) { return t.defined() ? t.str() : "undefined"; }

void check_tensor(const Tensor& t, int64_t numel, bool f32, Device dev, const char* what) {
  DT_CHECK(t.defined() && t.numel() == numel && t.device() == dev && (!f32 || t.dtype() == DType::F32),
           "attention: " << what << " must be " << (f32 ? "an f32 tensor" : "a tensor") << " of " << numel
                         << " elements on " << dev.str() << ", got " << describe(t));
}

FusedAttention* fused_path(Engine& e) {
  const std::string want = env::get("DTRAIN_ATTENTION");
  DT_INPUT_CHECK(want == "fused" || want == "materialized",
                 "environment variable DTRAIN_ATTENTION='" << want << "' is not fused or materialized");
  if (want == "materialized") return nullptr;
  FusedAttention* f = e.fused_attention();
  if (!f) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      std::fprintf(stderr, "dtrain: %s has no fused attention; attention runs materialised ([T, T] scores)\n",
                   e.describe().c_str());
  }
  return f;
}

// The score rows of a query head group: the G query heads of a key/value head are G * Tq consecutive
// rows of q, so every product is one batched GEMM over B * KV groups.
struct Strides {
  int64_t groups, rows, qs, ks, ss;  // B*KV batches of G*Tq rows; q/out, k/v and score strides
};
Strides strides_of(const AttentionShape& s) {
  const int64_t g = s.group();
  return {s.batch * s.kv_heads, g * s.q_len, g * s.q_len * s.head_dim, s.kv_head_stride(), g * s.q_len * s.kv_len};
}

void check_materializable(const AttentionShape& s) {
  DT_CHECK(!s.causal || (s.q_offset == 0 && s.q_len == s.kv_len) || s.q_len == 1,
           "materialised attention: causal over " << s.q_len << " queries at offset " << s.q_offset << " of "
                                                  << s.kv_len << " keys (a whole sequence or one step)");
}

bool whole_sequence(const AttentionShape& s) { return s.q_offset == 0 && s.q_len == s.kv_len; }

// probs [B*H*Tq, Tk] = softmax of scale * scores, causal or not.
void softmax_scores(Engine& e, const AttentionShape& s, const Tensor& scores, Tensor& probs) {
  if (whole_sequence(s))
    e.attention_softmax_forward(scores, s.q_len, s.scale, s.causal, probs);
  else  // every key visible: one decoding step that sees all cached keys, or cross-attention
    e.softmax_rows(scores, s.scale, probs);
}

}  // namespace

void check_attention_args(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out) {
  DT_CHECK(s.batch > 0 && s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.q_len > 0 &&
               s.kv_len > 0 && s.head_dim > 0 && s.q_offset >= 0 && s.kv_head_stride() >= s.kv_len * s.head_dim,
           "attention: " << s.batch << " x " << s.heads << " heads over " << s.kv_heads << " key/value heads, "
                         << s.q_len << " queries at offset " << s.q_offset << ", " << s.kv_len << " keys of "
                         << s.head_dim << " (stride " << s.kv_head_stride() << ")");
  DT_CHECK(!s.causal || s.q_offset + s.q_len <= s.kv_len,
           "attention: causal queries up to position " << s.q_offset + s.q_len << " beyond " << s.kv_len << " keys");
  const Device dev = q.device();
  check_tensor(q, s.batch * s.heads * s.q_len * s.head_dim, false, dev, "q");
  const int64_t kv = (s.batch * s.kv_heads - 1) * s.kv_head_stride() + s.kv_len * s.head_dim;
  DT_CHECK(k.defined() && v.defined() && k.numel() >= kv && v.numel() >= kv && k.device() == dev &&
               v.device() == dev && k.dtype() == q.dtype() && v.dtype() == q.dtype(),
           "attention: k and v must hold " << kv << " elements of " << dtype_name(q.dtype()) << " on " << dev.str()
                                           << ", got " << describe(k) << " and " << describe(v));
  DT_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16 || q.dtype() == DType::F16,
           "attention: q, k and v must be f32, bf16 or f16, got " << dtype_name(q.dtype()));
  check_tensor(out, q.numel(), true, dev, "out");
}

std::string attention_path(Engine& e) {
  const FusedAttention* f = fused_path(e);
  return f ? std::string("fused (") + f->name() + " tiles)" : std::string("materialised");
}

void attention_forward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                       Tensor& out, Tensor& lse) {
  if (FusedAttention* f = fused_path(e))
    f->forward(s, q, k, v, out, lse);
  else
    materialized_attention_forward(e, s, q, k, v, out);
}

void attention_backward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (FusedAttention* f = fused_path(e))
    f->backward(s, q, k, v, out, lse, dout, dq, dk, dv);
  else
    materialized_attention_backward(e, s, q, k, v, dout, dq, dk, dv);
}

void materialized_attention_forward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k,
                                    const Tensor& v, Tensor& out) {
  check_attention_args(s, q, k, v, out);
  check_materializable(s);
  const Strides st = strides_of(s);
  const Device dev = q.device();
  const Shape rows{s.batch * s.heads * s.q_len, s.kv_len};
  Tensor scores = Tensor::empty(rows, DType::F32, dev), probs = Tensor::empty(rows, DType::F32, dev);
  e.gemm_batched(st.groups, false, true, st.rows, s.kv_len, s.head_dim, 1.f, q, st.qs, k, st.ks, 0.f, scores, st.ss);
  softmax_scores(e, s, scores, probs);
  e.gemm_batched(st.groups, false, false, st.rows, s.head_dim, s.kv_len, 1.f, probs, st.ss, v, st.ks, 0.f, out,
                 st.qs);
}

void materialized_attention_backward(Engine& e, const AttentionShape& s, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  check_attention_args(s, q, k, v, dq);
  DT_CHECK(whole_sequence(s), "materialised attention: the backward needs whole sequences, not "
                                  << s.q_len << " queries at offset " << s.q_offset << " of " << s.kv_len << " keys");
  const Device dev = q.device();
  check_tensor(dout, q.numel(), true, dev, "dout");
  const int64_t kv_dense = s.batch * s.kv_heads * s.kv_len * s.head_dim;
  check_tensor(dk, kv_dense, true, dev, "dk");
  check_tensor(dv, kv_dense, true, dev, "dv");
  AttentionShape dense = s;
  dense.kv_stride = 0;  // dk and dv are dense
  const Strides st = strides_of(s), dst = strides_of(dense);
  const Shape rows{s.batch * s.heads * s.q_len, s.kv_len};
  Tensor scores = Tensor::empty(rows, DType::F32, dev), probs = Tensor::empty(rows, DType::F32, dev);
  Tensor dprobs = Tensor::empty(rows, DType::F32, dev);
  e.gemm_batched(st.groups, false, true, st.rows, s.kv_len, s.head_dim, 1.f, q, st.qs, k, st.ks, 0.f, scores, st.ss);
  softmax_scores(e, s, scores, probs);
  // Low-precision heads: dout, probs and d(scores) rounded once for their two GEMMs each.
  const bool low = q.dtype() != DType::F32;
  auto lowered = [&](const Tensor& t) {
    if (!low) return t;
    Tensor l = Tensor::empty(t.shape(), q.dtype(), dev);
    e.cast(t, l);
    return l;
  };
  const Tensor dy = lowered(dout);
  e.gemm_batched(st.groups, false, true, st.rows, s.kv_len, s.head_dim, 1.f, dy, st.qs, v, st.ks, 0.f, dprobs,
                 st.ss);  // dp = dy v^T
  e.gemm_batched(st.groups, true, false, s.kv_len, s.head_dim, st.rows, 1.f, probs, st.ss, dy, st.qs, 0.f, dv,
                 dst.ks);  // dv = p^T dy
  Tensor& dscores = scores;  // the raw scores are dead
  e.attention_softmax_backward(probs, dprobs, s.q_len, s.scale, s.causal, dscores);
  const Tensor ds = lowered(dscores);
  e.gemm_batched(st.groups, false, false, st.rows, s.head_dim, s.kv_len, 1.f, ds, st.ss, k, st.ks, 0.f, dq,
                 st.qs);  // dq = ds k (the scale is in ds)
  e.gemm_batched(st.groups, true, false, s.kv_len, s.head_dim, st.rows, 1.f, ds, st.ss, q, st.qs, 0.f, dk,
                 dst.ks);  // dk = ds^T q
}

}  // namespace dtrain

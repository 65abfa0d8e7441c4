// CudaEngine: the contract's transformer pieces, each a checked call into a transformer.cu launcher.
#include "cuda_engine.h"
#include "kernels.h"

namespace dtrain::cuda {

namespace {

void check_dev_numel(const Tensor& t, int64_t numel, const char* what, int index, DType dtype = DType::F32) {
  DT_CHECK(t.defined() && t.dtype() == dtype && t.device() == Device::cuda(index) && (numel < 0 || t.numel() == numel),
           what << " must be a " << dtype_name(dtype) << " tensor on cuda:" << index
                << (numel >= 0 ? " of " + std::to_string(numel) + " elements" : std::string()) << ", got "
                << (t.defined() ? t.str() : "undefined"));
}

}  // namespace

void CudaEngine::permute_0213(const Tensor& x, int64_t a, int64_t b, int64_t c, int64_t d, Tensor& y) {
  int64_t n = a * b * c * d;
  check_dev_numel(x, n, "permute_0213 input", index_);
  check_dev_numel(y, n, "permute_0213 output", index_);
  bind();
  k::permute_0213(x.device_f32(), y.device_f32(), a, b, c, d, compute_);
}

void CudaEngine::attention_softmax_forward(const Tensor& scores, int64_t t, float scale, bool causal, Tensor& probs) {
  DT_CHECK(t > 0 && scores.numel() % (t * t) == 0,
           "causal_softmax: " << scores.str() << " is not [N, " << t << ", " << t << "]");
  check_dev_numel(scores, scores.numel(), "causal_softmax scores", index_);
  check_dev_numel(probs, scores.numel(), "causal_softmax probs", index_);
  bind();
  k::attention_softmax_forward(scores.device_f32(), probs.device_f32(), scores.numel() / t, t, scale, causal, compute_);
}

void CudaEngine::attention_softmax_backward(const Tensor& probs, const Tensor& dprobs, int64_t t, float scale,
                                            bool causal, Tensor& dscores) {
  DT_CHECK(t > 0 && probs.numel() % (t * t) == 0,
           "causal_softmax_backward: " << probs.str() << " is not [N, " << t << ", " << t << "]");
  check_dev_numel(probs, probs.numel(), "causal_softmax_backward probs", index_);
  check_dev_numel(dprobs, probs.numel(), "causal_softmax_backward dprobs", index_);
  check_dev_numel(dscores, probs.numel(), "causal_softmax_backward dscores", index_);
  bind();
  k::attention_softmax_backward(probs.device_f32(), dprobs.device_f32(), dscores.device_f32(), probs.numel() / t, t,
                                scale, causal, compute_);
}

void CudaEngine::rotary(const Tensor& x, int64_t t, const Tensor& table, int64_t pos0, bool inverse, Tensor& y) {
  DT_CHECK(table.dim() == 2 && table.size(1) % 2 == 0 && t > 0 && pos0 >= 0 && pos0 + t <= table.size(0),
           "rotary: positions [" << pos0 << ", " << pos0 + t << ") of the table " << table.str());
  const int64_t d = table.size(1);
  DT_CHECK(x.numel() % (t * d) == 0, "rotary: " << x.str() << " is not [N, " << t << ", " << d << "]");
  check_dev_numel(x, -1, "rotary input", index_);
  check_dev_numel(y, x.numel(), "rotary output", index_);
  check_dev_numel(table, -1, "rotary table", index_);
  bind();
  k::rotary(x.device_f32(), table.device_f32(), y.device_f32(), x.numel() / d, t, d, pos0, inverse, compute_);
}

void CudaEngine::swiglu_forward(const Tensor& gu, Tensor& y) {
  DT_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "swiglu needs [M, 2F], got " << gu.str());
  const int64_t f = gu.size(-1) / 2, m = gu.numel() / (2 * f);
  check_dev_numel(gu, -1, "swiglu input", index_);
  check_dev_numel(y, m * f, "swiglu output", index_);
  bind();
  k::swiglu_forward(gu.device_f32(), y.device_f32(), m, f, compute_);
}

void CudaEngine::swiglu_backward(const Tensor& gu, const Tensor& dy, Tensor& dgu) {
  DT_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "swiglu_backward needs [M, 2F], got " << gu.str());
  const int64_t f = gu.size(-1) / 2, m = gu.numel() / (2 * f);
  check_dev_numel(gu, -1, "swiglu_backward input", index_);
  check_dev_numel(dy, m * f, "swiglu_backward dy", index_);
  check_dev_numel(dgu, gu.numel(), "swiglu_backward dgu", index_);
  bind();
  k::swiglu_backward(gu.device_f32(), dy.device_f32(), dgu.device_f32(), m, f, compute_);
}

void CudaEngine::embedding_forward(const Tensor& ids, const Tensor& table, int64_t offset, Tensor& y) {
  check_dev_numel(ids, -1, "embedding ids", index_, DType::I32);
  DT_CHECK(table.dim() == 2, "embedding table must be [V, C], got " << table.str());
  check_dev_numel(table, -1, "embedding table", index_);
  check_dev_numel(y, ids.numel() * table.size(1), "embedding output", index_);
  bind();
  k::embedding_forward(ids.device_data<int32_t>(), table.device_f32(), y.device_f32(), ids.numel(), table.size(0),
                       table.size(1), offset, compute_);
}

void CudaEngine::embedding_backward(const Tensor& ids, const Tensor& dy, int64_t offset, Tensor& dtable) {
  check_dev_numel(ids, -1, "embedding ids", index_, DType::I32);
  DT_CHECK(dtable.dim() == 2, "embedding gradient must be [V, C], got " << dtable.str());
  check_dev_numel(dtable, -1, "embedding gradient", index_);
  check_dev_numel(dy, ids.numel() * dtable.size(1), "embedding dy", index_);
  bind();
  k::embedding_backward(ids.device_data<int32_t>(), dy.device_f32(), dtable.device_f32(), ids.numel(), dtable.size(0),
                        dtable.size(1), offset, compute_);
}

}  // namespace dtrain::cuda

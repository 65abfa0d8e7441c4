#include "dtrain/nn/layers.h"

namespace dtrain::nn {

float SoftmaxCrossEntropy::forward(const Tensor& logits, const Tensor& labels, int64_t* correct) {
  DT_CHECK(logits.dim() == 2 && labels.numel() == logits.size(0),
           "cross-entropy needs logits (N, C) and N labels, got " << logits.str() << " and " << labels.str());
  labels_ = labels;
  if (!probs_.defined() || probs_.shape() != logits.shape())
    probs_ = Tensor::empty(logits.shape(), DType::F32, logits.device());
  loss_sum_ = engine_for(logits.device()).softmax_xent_forward(logits, labels, probs_, correct);
  return static_cast<float>(loss_sum_ / static_cast<double>(logits.size(0)));
}

void SoftmaxCrossEntropy::accumulate(const Tensor& logits, const Tensor& labels, Tensor& stats) {
  DT_CHECK(logits.dim() == 2 && labels.numel() == logits.size(0),
           "cross-entropy needs logits (N, C) and N labels, got " << logits.str() << " and " << labels.str());
  labels_ = labels;
  if (!probs_.defined() || probs_.shape() != logits.shape())
    probs_ = Tensor::empty(logits.shape(), DType::F32, logits.device());
  engine_for(logits.device()).softmax_xent_accumulate(logits, labels, probs_, stats);
}

Tensor SoftmaxCrossEntropy::backward(float scale) {
  if (!dlogits_.defined() || dlogits_.shape() != probs_.shape())
    dlogits_ = Tensor::empty(probs_.shape(), DType::F32, probs_.device());
  engine_for(probs_.device())
      .softmax_xent_backward(probs_, labels_, scale / static_cast<float>(probs_.size(0)), dlogits_);
  return dlogits_;
}

}  // namespace dtrain::nn

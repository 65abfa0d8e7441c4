#include "dtrain/nn/layers.h"

#include <cmath>

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

namespace {

// Row-wise softmax(x / t) into p (host f32), stable; returns the log of each row's normaliser so
// that log p = x / t - max - log(sum).
void softmax_rows(const Tensor& x, float t, Tensor& p, std::vector<double>* log_p = nullptr) {
  const int64_t n = x.size(0), c = x.size(1);
  if (log_p) log_p->assign(static_cast<size_t>(n * c), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x.f32() + i * c;
    float* pi = p.f32() + i * c;
    double mx = xi[0] / t, sum = 0;
    for (int64_t j = 1; j < c; ++j) mx = std::max(mx, static_cast<double>(xi[j]) / t);
    for (int64_t j = 0; j < c; ++j) sum += std::exp(xi[j] / t - mx);
    const double log_sum = std::log(sum);
    for (int64_t j = 0; j < c; ++j) {
      const double lp = xi[j] / t - mx - log_sum;
      pi[j] = static_cast<float>(std::exp(lp));
      if (log_p) (*log_p)[static_cast<size_t>(i * c + j)] = lp;
    }
  }
}

}  // namespace

SoftTargetLoss::SoftTargetLoss(float temperature) : t_(temperature) {
  DT_INPUT_CHECK(temperature > 0.f && std::isfinite(temperature),
                 "the distillation temperature must be > 0, got " << temperature);
}

float SoftTargetLoss::forward(const Tensor& student, const Tensor& teacher) {
  DT_CHECK(student.dim() == 2 && student.shape() == teacher.shape() && student.device().is_cpu() &&
               teacher.device().is_cpu(),
           "distillation needs student and teacher logits of one shape (N, C) on the host, got "
               << student.str() << " and " << teacher.str());
  if (!p_student_.defined() || p_student_.shape() != student.shape()) {
    p_student_ = Tensor::empty(student.shape());
    p_teacher_ = Tensor::empty(student.shape());
  }
  std::vector<double> log_s, log_t;
  softmax_rows(student, t_, p_student_, &log_s);
  softmax_rows(teacher, t_, p_teacher_, &log_t);
  double kl = 0;
  for (size_t i = 0; i < log_s.size(); ++i) kl += p_teacher_.f32()[i] * (log_t[i] - log_s[i]);
  return static_cast<float>(static_cast<double>(t_) * t_ * kl / static_cast<double>(student.size(0)));
}

Tensor SoftTargetLoss::backward(float scale) {
  if (!dlogits_.defined() || dlogits_.shape() != p_student_.shape()) dlogits_ = Tensor::empty(p_student_.shape());
  const float k = scale * t_ / static_cast<float>(p_student_.size(0));
  for (int64_t i = 0; i < p_student_.numel(); ++i)
    dlogits_.f32()[i] = k * (p_student_.f32()[i] - p_teacher_.f32()[i]);
  return dlogits_;
}

}  // namespace dtrain::nn

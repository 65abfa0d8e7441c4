#include "dtrain/nn/layers.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "dtrain/kernels/engine.h"

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

void HeadCrossEntropy::accumulate(const Tensor& row_stats, const Tensor& labels, Tensor& stats) {
  DT_CHECK(row_stats.dim() == 2 && row_stats.size(0) == 3 && labels.numel() == row_stats.size(1),
           "a scoring head's cross-entropy needs row statistics [3, N] and N labels, got " << row_stats.str() << " and "
                                                                                           << labels.str());
  rows_ = row_stats.size(1);
  auto row = [&](int64_t i) { return row_stats.slice0(i, i + 1).reshape({rows_}); };
  engine_for(row_stats.device()).vocab_xent_loss_accumulate(row(0), row(1), row(2), labels, stats);
}

float HeadCrossEntropy::forward(const Tensor& row_stats, const Tensor& labels, int64_t* correct) {
  DT_CHECK(correct == nullptr, "a scoring head's cross-entropy does not count argmax hits");
  Tensor stats = zeros_on({kXentStatsFloats}, row_stats.device());
  accumulate(row_stats, labels, stats);
  loss_sum_ = xent_stats(to_host(stats)).loss_sum;  // the caller asked for the figure: one sync
  return static_cast<float>(loss_sum_ / static_cast<double>(rows_));
}

Tensor HeadCrossEntropy::backward(float scale) {
  DT_CHECK(rows_ > 0, "a scoring head's cross-entropy: backward before a forward");
  return Tensor::from({1}, {scale / static_cast<float>(rows_)});
}

SoftTargetLoss::SoftTargetLoss(float temperature) : t_(temperature) {
  DT_INPUT_CHECK(temperature > 0.f && std::isfinite(temperature),
                 "the distillation temperature must be > 0, got " << temperature);
}

// The softened distributions, on the logits' device: p = softmax(logits / T).
void SoftTargetLoss::prepare(const Tensor& student, const Tensor& teacher) {
  DT_CHECK(student.dim() == 2 && student.shape() == teacher.shape() && student.device() == teacher.device(),
           "distillation needs student and teacher logits of one shape (N, C) on one device, got "
               << student.str() << " and " << teacher.str());
  if (!p_student_.defined() || p_student_.shape() != student.shape() || p_student_.device() != student.device()) {
    p_student_ = Tensor::empty(student.shape(), DType::F32, student.device());
    p_teacher_ = Tensor::empty(student.shape(), DType::F32, student.device());
  }
  Engine& e = engine_for(student.device());
  e.softmax_rows(student, 1.f / t_, p_student_);
  e.softmax_rows(teacher, 1.f / t_, p_teacher_);
}

namespace {
// log softmax(x / t) of row i of a host [N, C] tensor, in f64.
std::vector<double> log_softmax_row(const Tensor& x, int64_t i, float t) {
  const int64_t c = x.size(1);
  const float* row = x.f32() + i * c;
  double mx = row[0] / static_cast<double>(t), sum = 0;
  for (int64_t j = 1; j < c; ++j) mx = std::max(mx, row[j] / static_cast<double>(t));
  for (int64_t j = 0; j < c; ++j) sum += std::exp(row[j] / static_cast<double>(t) - mx);
  std::vector<double> out(static_cast<size_t>(c));
  for (int64_t j = 0; j < c; ++j) out[static_cast<size_t>(j)] = row[j] / static_cast<double>(t) - mx - std::log(sum);
  return out;
}
}  // namespace

// T^2 KL(p_teacher || p_student), averaged over the rows: a figure for the caller (training needs
// only backward), in f64 from host copies of the logits.
float SoftTargetLoss::forward(const Tensor& student, const Tensor& teacher) {
  prepare(student, teacher);
  const Tensor s = to_host(student), t = to_host(teacher);
  double kl = 0;
  for (int64_t i = 0; i < s.size(0); ++i) {
    const std::vector<double> ls = log_softmax_row(s, i, t_), lt = log_softmax_row(t, i, t_);
    for (size_t j = 0; j < ls.size(); ++j) kl += std::exp(lt[j]) * (lt[j] - ls[j]);
  }
  return static_cast<float>(static_cast<double>(t_) * t_ * kl / static_cast<double>(student.size(0)));
}

// d(mean loss)/d(student logits) = T (p_student - p_teacher) / N, times `scale`.
Tensor SoftTargetLoss::backward(float scale) {
  if (!dlogits_.defined() || dlogits_.shape() != p_student_.shape() || dlogits_.device() != p_student_.device())
    dlogits_ = Tensor::empty(p_student_.shape(), DType::F32, p_student_.device());
  Engine& e = engine_for(p_student_.device());
  e.copy(p_student_, dlogits_);
  e.axpy(-1.f, p_teacher_, dlogits_);
  e.scale(dlogits_, scale * t_ / static_cast<float>(p_student_.size(0)));
  return dlogits_;
}

}  // namespace dtrain::nn

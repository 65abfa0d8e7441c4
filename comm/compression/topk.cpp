// Top-k sparsification with error feedback.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

TopKCompressor::TopKCompressor(double ratio, float momentum_correction) : ratio_(ratio), target_(ratio) {
  DT_CHECK(ratio > 0 && ratio <= 1, "top-k ratio " << ratio << " must be in (0, 1]");
  set_momentum_correction(momentum_correction);
}

void TopKCompressor::set_momentum_correction(float m) {
  DT_CHECK(m >= 0 && m < 1, "top-k momentum correction " << m << " must be in [0, 1)");
  momentum_ = m;
}

void TopKCompressor::set_ratio(double ratio) {
  DT_CHECK(ratio > 0 && ratio <= 1, "top-k ratio " << ratio << " must be in (0, 1]");
  ratio_ = ratio;
}

// Deep Gradient Compression's sparsity warm-up: the kept fraction falls exponentially from 25 % to
// the target over the warm-up's steps.
void TopKCompressor::on_step(int64_t step, int64_t warmup_steps) {
  const double start = std::max(0.25, target_);
  double r = target_;
  if (step < warmup_steps)
    r = start * std::pow(target_ / start, static_cast<double>(step) / static_cast<double>(warmup_steps));
  set_ratio(r);
}

std::string TopKCompressor::name() const {
  char b[32];
  std::snprintf(b, sizeof b, "topk(%g)", ratio_);
  return b;
}

// The residual (plus, with momentum correction, the momentum u = m u + g) takes the gradient, its k
// largest magnitudes leave it, and each rank's (index, value) pairs reach every rank by two
// allgathers; the decoding sums them in rank order, so every rank holds the same bits.
std::shared_ptr<Work> TopKCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel(), size = comm.size();
  const int64_t k = std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio_ * n))));
  const Device dev = bucket.device();
  Engine& e = engine_for(dev);
  Tensor idx = Tensor::empty({k}, DType::I32, dev), vals = Tensor::empty({k}, DType::F32, dev);
  {
    detail::ScopedSeconds t(stats_.compress_s);
    Tensor& acc = BucketState::on(st.residual, dev);  // becomes gradient + residual, then what is left unsent
    if (!acc.defined()) acc = zeros_on({n}, dev);
    if (momentum_ > 0) {
      Tensor& u = BucketState::on(st.velocity, dev);
      if (!u.defined()) u = zeros_on({n}, dev);
      e.scale(u, momentum_);
      e.axpy(1.f, bucket, u);
      e.axpy(1.f, u, acc);
    } else {
      e.axpy(1.f, bucket, acc);
    }
    e.topk_abs(acc, k, idx);
    e.gather_and_clear(acc, idx, vals);  // sent exactly: nothing of it stays behind
    if (momentum_ > 0) {
      Tensor none;
      e.gather_and_clear(st.velocity, idx, none);  // momentum factor masking: a sent coordinate restarts
    }
  }
  stats_.bytes_sent += 8 * k;
  Tensor all_idx = Tensor::empty({k * size}, DType::I32, dev), all_vals = Tensor::empty({k * size}, DType::F32, dev);
  auto idx_work = comm.allgather(idx, all_idx);
  auto vals_work = comm.allgather(vals, all_vals);
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, all_idx, all_vals, k, size, op, dec]() mutable {
    detail::ScopedSeconds t(*dec);
    Engine& e = engine_for(bucket.device());
    e.fill(bucket, 0.f);
    for (int64_t r = 0; r < size; ++r)  // rank order: the same sum on every rank
      e.scatter_add(all_idx.slice0(r * k, (r + 1) * k), all_vals.slice0(r * k, (r + 1) * k), bucket);
    if (op == ReduceOp::Avg) e.scale(bucket, 1.f / static_cast<float>(size));
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), idx_work,
                                              std::vector<detail::StagedWork::Stage>{[vals_work] { return vals_work; }},
                                              finish);
}

}  // namespace dtrain::comm

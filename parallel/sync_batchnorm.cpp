#include "dtrain/parallel/sync_batchnorm.h"

#include <cmath>

namespace dtrain::parallel {

SyncBatchNorm::SyncBatchNorm(int64_t channels, comm::Communicator& comm, float eps, float momentum)
    : c_(channels), comm_(comm), eps_(eps), momentum_(momentum) {
  gamma_ = &add_parameter("weight", Tensor::full({channels}, 1.f));
  beta_ = &add_parameter("bias", Tensor::zeros({channels}));
  running_mean_ = &add_buffer("running_mean", Tensor::zeros({channels}));
  running_var_ = &add_buffer("running_var", Tensor::full({channels}, 1.f));
  for (Tensor* t : {&scale_, &shift_, &neg_mean_}) *t = Tensor::zeros({channels});
  ones_ = Tensor::full({channels}, 1.f);
  stats_ = Tensor::zeros({2 * channels + 1});
}

// Forward, in two passes as BatchNorm2d's double-precision statistics are: the global mean from
// the per-channel sums of all ranks, then the variance from sums of the centred input
// xc = x - mean (a variance taken as E[x^2] - mean^2 from f32 sums loses digits to cancellation,
// enough to move a ResNet's weights by 1e-5 within 20 steps). The second pass's mean of xc (zero
// up to rounding) corrects the first. y = xc * gamma*invstd + (beta - mean(xc)*gamma*invstd).
Tensor SyncBatchNorm::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4 && x.size(1) == c_, kind() << " needs (N, " << c_ << ", H, W), got " << x.str());
  Engine& e = engine(x);
  Tensor& y = ensure(y_, x.shape(), x.device());
  const float* g = gamma_->value.f32();
  const float* b = beta_->value.f32();
  if (!training_) {
    for (int64_t c = 0; c < c_; ++c) {
      float inv = 1.f / std::sqrt(running_var_->value.f32()[c] + eps_);
      scale_.f32()[c] = g[c] * inv;
      shift_.f32()[c] = b[c] - running_mean_->value.f32()[c] * g[c] * inv;
    }
    e.channel_affine(x, c_, scale_, shift_, y);
    return y;
  }
  Tensor s1 = stats_.slice0(0, c_), s2 = stats_.slice0(c_, 2 * c_);
  e.channel_sums(x, c_, s1, s2);
  stats_.f32()[2 * c_] = static_cast<float>(x.numel() / c_);
  comm_.allreduce(stats_, comm::ReduceOp::Sum)->wait();
  const double count = stats_.f32()[2 * c_];
  // What backward reads, [invstd (C) | mean of xc (C) | count], in a slot of its own: a pipeline's
  // micro-batches in flight each keep theirs.
  Tensor& saved = ensure(saved_, {2 * c_ + 1});
  float* invstd = saved.f32();
  float* resid = invstd + c_;
  saved.f32()[2 * c_] = static_cast<float>(count);  // exact: an f32 sum of counts
  for (int64_t c = 0; c < c_; ++c) neg_mean_.f32()[c] = static_cast<float>(-s1.f32()[c] / count);
  Tensor& xc = ensure(xc_, x.shape(), x.device());
  e.channel_affine(x, c_, ones_, neg_mean_, xc);
  e.channel_sums(xc, c_, s1, s2);
  stats_.f32()[2 * c_] = 0.f;
  comm_.allreduce(stats_, comm::ReduceOp::Sum)->wait();
  for (int64_t c = 0; c < c_; ++c) {
    double d = s1.f32()[c] / count;  // mean of xc
    double var = std::max(0.0, s2.f32()[c] / count - d * d);
    double mean = -static_cast<double>(neg_mean_.f32()[c]) + d;
    float inv = static_cast<float>(1.0 / std::sqrt(var + eps_));
    resid[c] = static_cast<float>(d);
    invstd[c] = inv;
    scale_.f32()[c] = g[c] * inv;
    shift_.f32()[c] = b[c] - static_cast<float>(d) * g[c] * inv;
    double unbiased = count > 1 ? var * count / (count - 1) : var;  // running variance, as PyTorch
    float* rm = running_mean_->value.f32();
    float* rv = running_var_->value.f32();
    rm[c] = (1.f - momentum_) * rm[c] + momentum_ * static_cast<float>(mean);
    rv[c] = (1.f - momentum_) * rv[c] + momentum_ * static_cast<float>(unbiased);
  }
  e.channel_affine(xc, c_, scale_, shift_, y);
  return y;
}

// Backward. With sums over ALL ranks sdy = sum dy, sdx = sum dy*(x - mean), M = count:
//   dx = gamma*invstd*dy - gamma*invstd/M*sdy - gamma*invstd^3/M*sdx*(x - mean)
// computed as dx = A*dy + (B*xc + C) with two channel_affine maps (x - mean = xc - mean(xc)).
// dgamma and dbeta take this rank's sums only: data parallel averages them over the ranks like
// every other gradient (as PyTorch's SyncBatchNorm does), while dx needs the global sums because
// every sample moved the statistics.
Tensor SyncBatchNorm::backward(const Tensor& dy) {
  Engine& e = engine(dy);
  const float* invstd = saved_.f32();
  const float* resid = invstd + c_;
  const double count = saved_.f32()[2 * c_];
  Tensor sdy = stats_.slice0(0, c_), sdyx = stats_.slice0(c_, 2 * c_), unused = Tensor::zeros({c_});
  e.channel_sums(dy, c_, sdy, unused);
  e.channel_dot(dy, xc_, c_, sdyx);
  stats_.f32()[2 * c_] = 0.f;
  for (int64_t c = 0; c < c_; ++c) {
    double s_dy = sdy.f32()[c];
    double s_dx = sdyx.f32()[c] - resid[c] * s_dy;
    gamma_->grad.f32()[c] += static_cast<float>(s_dx * invstd[c]);
    beta_->grad.f32()[c] += static_cast<float>(s_dy);
  }
  grad_ready(*gamma_);
  grad_ready(*beta_);
  comm_.allreduce(stats_, comm::ReduceOp::Sum)->wait();
  const float* g = gamma_->value.f32();
  Tensor a = Tensor::empty({c_}), zero = Tensor::zeros({c_}), bsc = Tensor::empty({c_}), csh = Tensor::empty({c_});
  for (int64_t c = 0; c < c_; ++c) {
    double d = resid[c], inv = invstd[c];
    double s_dy = sdy.f32()[c];
    double s_dx = sdyx.f32()[c] - d * s_dy;
    double k = g[c] * inv;
    double bcoef = -k * inv * inv * s_dx / count;
    a.f32()[c] = static_cast<float>(k);
    bsc.f32()[c] = static_cast<float>(bcoef);
    csh.f32()[c] = static_cast<float>(-k * s_dy / count - bcoef * d);
  }
  Tensor& dx = ensure(dx_, xc_.shape(), dy.device());
  Tensor& t = ensure(tmp_, xc_.shape(), dy.device());
  e.channel_affine(dy, c_, a, zero, dx);
  e.channel_affine(xc_, c_, bsc, csh, t);
  e.add(dx, t, dx);
  return dx;
}

int convert_sync_batchnorm(nn::Module& root, comm::Communicator& comm) {
  int replaced = 0;
  if (auto* seq = dynamic_cast<nn::Sequential*>(&root)) {
    for (size_t i = 0; i < seq->size(); ++i) {
      if (auto* bn = dynamic_cast<nn::BatchNorm2d*>(&(*seq)[i])) {
        auto sync = std::make_unique<SyncBatchNorm>(bn->channels(), comm, bn->eps(), bn->momentum());
        auto from = bn->parameters();
        auto to = sync->parameters();
        for (size_t k = 0; k < from.size(); ++k) to[k]->value.copy_from(from[k]->value);
        auto fb = bn->buffers();
        auto tb = sync->buffers();
        for (size_t k = 0; k < fb.size(); ++k) tb[k]->value.copy_from(fb[k]->value);
        seq->replace(i, std::move(sync));
        ++replaced;
      }
    }
  }
  for (auto& [name, child] : root.children()) replaced += convert_sync_batchnorm(*child, comm);
  return replaced;
}

}  // namespace dtrain::parallel

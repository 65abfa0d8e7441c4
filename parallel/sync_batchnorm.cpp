#include "dtrain/parallel/sync_batchnorm.h"

#include <algorithm>
#include <cmath>

#include "dtrain/kernels/engine.h"

namespace dtrain::parallel {

SyncBatchNorm::SyncBatchNorm(int64_t channels, comm::Communicator& comm, float eps, float momentum)
    : c_(channels), comm_(comm), eps_(eps), momentum_(momentum) {
  gamma_ = &add_parameter("weight", Tensor::full({channels}, 1.f));
  beta_ = &add_parameter("bias", Tensor::zeros({channels}));
  running_mean_ = &add_buffer("running_mean", Tensor::zeros({channels}));
  running_var_ = &add_buffer("running_var", Tensor::full({channels}, 1.f));
}

// The per-channel vectors live where the input does; their arithmetic is f64 on the host over
// explicit copies of [C] values (a few hundred bytes a layer), the maps over the batch on the engine.
void SyncBatchNorm::place(Device device) {
  if (stats_.defined() && stats_.device() == device) return;
  for (Tensor* t : {&scale_, &shift_, &neg_mean_, &ones_, &zeros_}) *t = Tensor::empty({c_}, DType::F32, device);
  stats_ = Tensor::empty({2 * c_ + 1}, DType::F32, device);
  engine_for(device).fill(ones_, 1.f);
  engine_for(device).fill(zeros_, 0.f);
}

// The sums of all ranks: stats_ = [s1 (C) | s2 (C) | count] after the allreduce, as host values.
Tensor SyncBatchNorm::sum_over_ranks(float count) {
  Tensor last = stats_.slice0(2 * c_, 2 * c_ + 1);
  copy_any(Tensor::from({1}, {count}), last);
  comm_.allreduce(stats_, comm::ReduceOp::Sum)->wait();
  return host_copy(stats_);
}

// Forward, in two passes as BatchNorm2d's double-precision statistics are: the global mean from
// the per-channel sums of all ranks, then the variance from sums of the centred input
// xc = x - mean (a variance taken as E[x^2] - mean^2 from f32 sums loses digits to cancellation,
// enough to move a ResNet's weights by 1e-5 within 20 steps). The second pass's mean of xc (zero
// up to rounding) corrects the first. y = xc * gamma*invstd + (beta - mean(xc)*gamma*invstd).
Tensor SyncBatchNorm::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4 && x.size(1) == c_, kind() << " needs (N, " << c_ << ", H, W), got " << x.str());
  Engine& e = engine(x);
  place(x.device());
  Tensor& y = ensure(y_, x.shape(), x.device());
  const Tensor gamma = host_copy(gamma_->value), beta = host_copy(beta_->value);
  const float *g = gamma.f32(), *b = beta.f32();
  Tensor scale = Tensor::empty({c_}), shift = Tensor::empty({c_});
  if (!training_) {
    const Tensor rm = host_copy(running_mean_->value), rv = host_copy(running_var_->value);
    for (int64_t c = 0; c < c_; ++c) {
      float inv = 1.f / std::sqrt(rv.f32()[c] + eps_);
      scale.f32()[c] = g[c] * inv;
      shift.f32()[c] = b[c] - rm.f32()[c] * g[c] * inv;
    }
    copy_any(scale, scale_);
    copy_any(shift, shift_);
    e.channel_affine(x, c_, scale_, shift_, y);
    return y;
  }
  Tensor s1 = stats_.slice0(0, c_), s2 = stats_.slice0(c_, 2 * c_);
  e.channel_sums(x, c_, s1, s2);
  const Tensor first = sum_over_ranks(static_cast<float>(x.numel() / c_));
  const double count = first.f32()[2 * c_];
  Tensor neg_mean = Tensor::empty({c_});
  for (int64_t c = 0; c < c_; ++c) neg_mean.f32()[c] = static_cast<float>(-first.f32()[c] / count);
  copy_any(neg_mean, neg_mean_);
  Tensor& xc = ensure(xc_, x.shape(), x.device());
  e.channel_affine(x, c_, ones_, neg_mean_, xc);
  e.channel_sums(xc, c_, s1, s2);
  const Tensor second = sum_over_ranks(0.f);
  // What backward reads, [invstd (C) | mean of xc (C) | count], in a slot of its own (host values):
  // a pipeline's micro-batches in flight each keep theirs.
  Tensor& saved = ensure(saved_, {2 * c_ + 1});
  float* invstd = saved.f32();
  float* resid = invstd + c_;
  saved.f32()[2 * c_] = static_cast<float>(count);  // exact: an f32 sum of counts
  Tensor rm = host_copy(running_mean_->value), rv = host_copy(running_var_->value);
  for (int64_t c = 0; c < c_; ++c) {
    double d = second.f32()[c] / count;  // mean of xc
    double var = std::max(0.0, second.f32()[c_ + c] / count - d * d);
    double mean = -static_cast<double>(neg_mean.f32()[c]) + d;
    float inv = static_cast<float>(1.0 / std::sqrt(var + eps_));
    resid[c] = static_cast<float>(d);
    invstd[c] = inv;
    scale.f32()[c] = g[c] * inv;
    shift.f32()[c] = b[c] - static_cast<float>(d) * g[c] * inv;
    double unbiased = count > 1 ? var * count / (count - 1) : var;  // running variance, as PyTorch
    rm.f32()[c] = (1.f - momentum_) * rm.f32()[c] + momentum_ * static_cast<float>(mean);
    rv.f32()[c] = (1.f - momentum_) * rv.f32()[c] + momentum_ * static_cast<float>(unbiased);
  }
  copy_any(rm, running_mean_->value);
  copy_any(rv, running_var_->value);
  copy_any(scale, scale_);
  copy_any(shift, shift_);
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
  Tensor sdy = stats_.slice0(0, c_), sdyx = stats_.slice0(c_, 2 * c_);
  Tensor unused = Tensor::empty({c_}, DType::F32, dy.device());
  e.channel_sums(dy, c_, sdy, unused);
  e.channel_dot(dy, xc_, c_, sdyx);
  const Tensor mine = host_copy(stats_.slice0(0, 2 * c_));  // this rank's sums, for dgamma and dbeta
  Tensor dgamma = Tensor::empty({c_}), dbeta = Tensor::empty({c_});
  for (int64_t c = 0; c < c_; ++c) {
    double s_dy = mine.f32()[c];
    dgamma.f32()[c] = static_cast<float>((mine.f32()[c_ + c] - resid[c] * s_dy) * invstd[c]);
    dbeta.f32()[c] = static_cast<float>(s_dy);
  }
  Tensor here = Tensor::empty({c_}, DType::F32, dy.device());  // accumulated, as every parameter gradient
  for (auto [p, d] : {std::pair{gamma_, &dgamma}, std::pair{beta_, &dbeta}}) {
    if (p->frozen) continue;
    copy_any(*d, here);
    e.axpy(1.f, here, p->grad);
  }
  grad_ready(*gamma_);
  grad_ready(*beta_);
  const Tensor all = sum_over_ranks(0.f);
  const Tensor gamma = host_copy(gamma_->value);
  const float* g = gamma.f32();
  Tensor a = Tensor::empty({c_}), bsc = Tensor::empty({c_}), csh = Tensor::empty({c_});
  for (int64_t c = 0; c < c_; ++c) {
    double d = resid[c], inv = invstd[c];
    double s_dy = all.f32()[c];
    double s_dx = all.f32()[c_ + c] - d * s_dy;
    double k = g[c] * inv;
    double bcoef = -k * inv * inv * s_dx / count;
    a.f32()[c] = static_cast<float>(k);
    bsc.f32()[c] = static_cast<float>(bcoef);
    csh.f32()[c] = static_cast<float>(-k * s_dy / count - bcoef * d);
  }
  copy_any(a, scale_);
  copy_any(bsc, shift_);
  copy_any(csh, neg_mean_);
  Tensor& dx = ensure(dx_, xc_.shape(), dy.device());
  Tensor& t = ensure(tmp_, xc_.shape(), dy.device());
  e.channel_affine(dy, c_, scale_, zeros_, dx);
  e.channel_affine(xc_, c_, shift_, neg_mean_, t);
  e.add(dx, t, dx);
  return dx;
}

namespace {

// A SyncBatchNorm with `bn`'s parameters and statistics.
nn::ModulePtr synced(nn::BatchNorm2d& bn, comm::Communicator& comm) {
  auto sync = std::make_unique<SyncBatchNorm>(bn.channels(), comm, bn.eps(), bn.momentum());
  const auto from = bn.parameters(), to = sync->parameters();
  for (size_t k = 0; k < from.size(); ++k) copy_any(from[k]->value, to[k]->value);
  const auto fb = bn.buffers(), tb = sync->buffers();
  for (size_t k = 0; k < fb.size(); ++k) copy_any(fb[k]->value, tb[k]->value);
  return sync;
}

}  // namespace

int convert_sync_batchnorm(nn::Module& root, comm::Communicator& comm) {
  int replaced = 0;
  if (auto* seq = dynamic_cast<nn::Sequential*>(&root)) {
    for (size_t i = 0; i < seq->size(); ++i) {
      if (auto* bn = dynamic_cast<nn::BatchNorm2d*>(&(*seq)[i])) {
        seq->replace(i, synced(*bn, comm));
        ++replaced;
      }
    }
  }
  for (auto& [name, child] : root.children()) replaced += convert_sync_batchnorm(*child, comm);
  return replaced;
}

void SyncBatchNormSink::layer_added(nn::ModulePtr& layer) {
  if (auto* bn = dynamic_cast<nn::BatchNorm2d*>(layer.get()))
    layer = synced(*bn, comm_);
  else
    convert_sync_batchnorm(*layer, comm_);
  if (next_) next_->layer_added(layer);
}

void SyncBatchNormSink::unit_built(const std::vector<nn::Module*>& entries) {
  if (next_) next_->unit_built(entries);
}

}  // namespace dtrain::parallel

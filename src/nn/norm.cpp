#include "dtrain/nn/layers.h"

namespace dtrain::nn {

BatchNorm2d::BatchNorm2d(int64_t channels, float eps, float momentum) : c_(channels), eps_(eps), momentum_(momentum) {
  gamma_ = &add_parameter("weight", Tensor::full({channels}, 1.f));
  beta_ = &add_parameter("bias", Tensor::zeros({channels}));
  running_mean_ = &add_buffer("running_mean", Tensor::zeros({channels}));
  running_var_ = &add_buffer("running_var", Tensor::full({channels}, 1.f));
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4 && x.size(1) == c_, kind() << " needs (N, " << c_ << ", H, W), got " << x.str());
  keep(x_, x);
  Tensor& y = ensure(y_, x.shape(), x.device());
  Engine& e = engine(x);
  if (training_) {
    ensure(save_mean_, {c_}, x.device());
    ensure(save_invstd_, {c_}, x.device());
    e.batchnorm_forward_train(x, c_, gamma_->value, beta_->value, eps_, momentum_, running_mean_->value,
                              running_var_->value, save_mean_, save_invstd_, y);
  } else {
    e.batchnorm_forward_infer(x, c_, gamma_->value, beta_->value, eps_, running_mean_->value, running_var_->value, y);
  }
  return y;
}

Tensor BatchNorm2d::backward(const Tensor& dy) {
  DT_CHECK(training_, kind() << ": backward after an evaluation forward");
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).batchnorm_backward(x_, dy, c_, gamma_->value, save_mean_, save_invstd_, dx, grad_into(*gamma_, frozen_dgamma_),
                              grad_into(*beta_, frozen_dbeta_));
  grad_ready(*gamma_);
  grad_ready(*beta_);
  return dx;
}

LayerNorm::LayerNorm(int64_t features, float eps) : d_(features), eps_(eps) {
  gamma_ = &add_parameter("weight", Tensor::full({features}, 1.f));
  beta_ = &add_parameter("bias", Tensor::zeros({features}));
}

Tensor LayerNorm::forward(const Tensor& x) {
  DT_CHECK(x.dim() >= 1 && x.size(-1) == d_, kind() << " got " << x.str());
  keep(x_, x);
  int64_t rows = x.numel() / d_;
  ensure(mean_, {rows}, x.device());
  ensure(rstd_, {rows}, x.device());
  Tensor& y = ensure_output(y_, x.shape(), x.device());
  engine(x).layernorm_forward(x, gamma_->value, beta_->value, eps_, mean_, rstd_, y);
  return y;
}

Tensor LayerNorm::backward(const Tensor& dy) {
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).layernorm_backward(x_, dy, gamma_->value, mean_, rstd_, dx, grad_into(*gamma_, frozen_dgamma_),
                                grad_into(*beta_, frozen_dbeta_));
  grad_ready(*gamma_);
  grad_ready(*beta_);
  return dx;
}

RMSNorm::RMSNorm(int64_t features, float eps) : d_(features), eps_(eps) {
  gamma_ = &add_parameter("weight", Tensor::full({features}, 1.f));
}

Tensor RMSNorm::forward(const Tensor& x) {
  DT_CHECK(x.dim() >= 1 && x.size(-1) == d_, kind() << " got " << x.str());
  keep(x_, x);
  ensure(rstd_, {x.numel() / d_}, x.device());
  Tensor& y = ensure_output(y_, x.shape(), x.device());
  engine(x).rmsnorm_forward(x, gamma_->value, eps_, rstd_, y);
  return y;
}

Tensor RMSNorm::backward(const Tensor& dy) {
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).rmsnorm_backward(x_, dy, gamma_->value, rstd_, dx, grad_into(*gamma_, frozen_dgamma_));
  grad_ready(*gamma_);
  return dx;
}

}  // namespace dtrain::nn

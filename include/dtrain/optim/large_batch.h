#pragma once
// Large-batch optimizers with layer-wise trust ratios.
//  LARS (You et al. 2017): per parameter tensor, local_lr = eta * ||w|| / (||g|| + wd * ||w||);
//    buf = momentum * buf + (g + wd * w); w -= lr * local_lr * buf.
//  LAMB (You et al. 2019): Adam direction r = m_hat / (sqrt(v_hat) + eps) + wd * w;
//    w -= lr * (||w|| / ||r||) * r.
// One-dimensional tensors (biases, normalisation scales) take the plain update (trust ratio 1), as
// the reference implementations do.
#include "dtrain/optim/optimizer.h"

namespace dtrain::optim {

struct LarsOptions {
  float momentum = 0.9f, weight_decay = 0.f, eta = 0.001f;
};
class LARS : public Optimizer {
 public:
  LARS(std::vector<nn::Parameter*> params, LarsOptions o);
  std::string kind() const override { return "lars"; }
  void step(float lr) override;
  std::vector<StateTensor> state() override;

 private:
  LarsOptions o_;
  std::vector<Tensor> buf_;
};

struct LambOptions {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-6f, weight_decay = 0.f;
};
class LAMB : public Optimizer {
 public:
  LAMB(std::vector<nn::Parameter*> params, LambOptions o);
  std::string kind() const override { return "lamb"; }
  void step(float lr) override;
  std::vector<StateTensor> state() override;

 private:
  LambOptions o_;
  std::vector<Tensor> m_, v_, scratch_;
};

}  // namespace dtrain::optim

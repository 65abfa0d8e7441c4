#include "dtrain/optim/large_batch.h"

#include <cmath>

namespace dtrain::optim {

LARS::LARS(std::vector<nn::Parameter*> params, LarsOptions o)
    : Optimizer({ParamGroup{std::move(params), o.weight_decay}}), o_(o) {
  DT_INPUT_CHECK(o.eta > 0.f, "lars: trust coefficient (--lars-eta) must be > 0");
  for (nn::Parameter* p : params_) buf_.push_back(zeros_on(p->value.shape(), p->value.device()));
}

void LARS::step(float lr) {
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter* p = params_[i];
    Engine& e = engine_for(p->value.device());
    float local = 1.f;
    if (p->value.dim() > 1) {
      double wn = std::sqrt(e.sum_squares(p->value)), gn = std::sqrt(e.sum_squares(p->grad));
      if (wn > 0 && gn > 0) local = static_cast<float>(o_.eta * wn / (gn + o_.weight_decay * wn));
    }
    e.sgd_update(p->value, p->grad, buf_[i], lr * local, o_.momentum, 0.f, o_.weight_decay, false);
  }
  ++steps_;
}

std::vector<StateTensor> LARS::state() {
  std::vector<StateTensor> s;
  for (size_t i = 0; i < params_.size(); ++i) s.push_back({params_[i]->name + ".momentum", &buf_[i]});
  return s;
}

LAMB::LAMB(std::vector<nn::Parameter*> params, LambOptions o)
    : Optimizer({ParamGroup{std::move(params), o.weight_decay}}), o_(o) {
  DT_INPUT_CHECK(o.beta1 >= 0.f && o.beta1 < 1.f && o.beta2 >= 0.f && o.beta2 < 1.f, "lamb: betas must be in [0, 1)");
  for (nn::Parameter* p : params_) {
    m_.push_back(zeros_on(p->value.shape(), p->value.device()));
    v_.push_back(zeros_on(p->value.shape(), p->value.device()));
    scratch_.push_back(zeros_on(p->value.shape(), p->value.device()));
  }
}

// The Adam update with lr = 1 and decoupled decay, applied to a copy u of w, leaves
// u = w - wd*w - m_hat/(sqrt(v_hat)+eps) = w - r; so r = w - u, and w += lr * trust * (u - w).
void LAMB::step(float lr) {
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter* p = params_[i];
    Engine& e = engine_for(p->value.device());
    Tensor& u = scratch_[i];
    e.copy(p->value, u);
    e.adam_update(u, p->grad, m_[i], v_[i], 1.f, o_.beta1, o_.beta2, o_.eps, o_.weight_decay, true, steps_);
    e.axpy(-1.f, p->value, u);  // u = -r
    float trust = 1.f;
    if (p->value.dim() > 1) {
      double wn = std::sqrt(e.sum_squares(p->value)), rn = std::sqrt(e.sum_squares(u));
      if (wn > 0 && rn > 0) trust = static_cast<float>(wn / rn);
    }
    e.axpy(lr * trust, u, p->value);
  }
}

std::vector<StateTensor> LAMB::state() {
  std::vector<StateTensor> s;
  for (size_t i = 0; i < params_.size(); ++i) {
    s.push_back({params_[i]->name + ".exp_avg", &m_[i]});
    s.push_back({params_[i]->name + ".exp_avg_sq", &v_[i]});
  }
  return s;
}

}  // namespace dtrain::optim

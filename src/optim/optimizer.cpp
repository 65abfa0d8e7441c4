#include "dtrain/optim/optimizer.h"

#include <algorithm>
#include <cmath>

namespace dtrain::optim {

std::vector<ParamGroup> decay_groups(const std::vector<nn::Parameter*>& params, float weight_decay,
                                     const std::vector<std::string>& no_decay) {
  ParamGroup decayed{{}, weight_decay}, plain{{}, 0.f};
  for (nn::Parameter* p : params) {
    const bool named = std::find(no_decay.begin(), no_decay.end(), p->name) != no_decay.end();
    (p->value.dim() >= 2 && !named ? decayed : plain).params.push_back(p);
  }
  std::vector<ParamGroup> groups;
  for (ParamGroup* g : {&decayed, &plain})
    if (!g->params.empty()) groups.push_back(std::move(*g));
  return groups;
}

std::map<std::string, Tensor> state_by_name(const std::vector<StateTensor>& state) {
  std::map<std::string, Tensor> out;
  for (const StateTensor& st : state) out[st.name] = to_host(*st.value).clone();
  return out;
}

void load_state_by_name(const std::map<std::string, Tensor>& saved, const std::vector<StateTensor>& state) {
  for (const StateTensor& st : state) {
    auto it = saved.find(st.name);
    DT_INPUT_CHECK(it != saved.end(), "no optimizer state " << st.name);
    DT_INPUT_CHECK(it->second.shape() == st.value->shape(), "optimizer state " << st.name << " is " << it->second.str()
                                                                               << ", the optimizer holds "
                                                                               << st.value->str());
    copy_any(it->second, *st.value);
  }
}

Optimizer::Optimizer(std::vector<ParamGroup> groups) {
  for (const ParamGroup& g : groups) {
    DT_INPUT_CHECK(g.weight_decay >= 0.f, "weight decay must be >= 0, got " << g.weight_decay);
    params_.insert(params_.end(), g.params.begin(), g.params.end());
    weight_decay_.insert(weight_decay_.end(), g.params.size(), g.weight_decay);
  }
}

void Optimizer::zero_grad() {
  for (nn::Parameter* p : params_) engine_for(p->grad.device()).fill(p->grad, 0.f);
}

SGD::SGD(std::vector<nn::Parameter*> params, SgdOptions o) : SGD({ParamGroup{std::move(params), o.weight_decay}}, o) {}

SGD::SGD(std::vector<ParamGroup> groups, SgdOptions o) : Optimizer(std::move(groups)), o_(o) {
  DT_INPUT_CHECK(o.momentum >= 0.f && o.weight_decay >= 0.f, "sgd: momentum and weight decay must be >= 0");
  DT_INPUT_CHECK(!o.nesterov || (o.momentum > 0.f && o.dampening == 0.f),
                 "sgd: Nesterov momentum needs momentum > 0 and zero dampening");
  for (nn::Parameter* p : params_) buf_.push_back(zeros_on(p->value.shape(), p->value.device()));
}

void SGD::step(float lr) {
  // PyTorch initialises the momentum buffer with the first gradient (no dampening on step 1);
  // a zero buffer with dampening 0 gives exactly that.
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter* p = params_[i];
    float damp = steps_ == 0 ? 0.f : o_.dampening;
    engine_for(p->value.device())
        .sgd_update(p->value, p->grad, buf_[i], lr, o_.momentum, damp, weight_decay_[i], o_.nesterov);
  }
  ++steps_;
}

std::vector<StateTensor> SGD::state() {
  std::vector<StateTensor> s;
  for (size_t i = 0; i < params_.size(); ++i) s.push_back({params_[i]->name + ".momentum", &buf_[i]});
  return s;
}

Adam::Adam(std::vector<nn::Parameter*> params, AdamOptions o)
    : Adam({ParamGroup{std::move(params), o.weight_decay}}, o) {}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions o) : Optimizer(std::move(groups)), o_(o) {
  DT_INPUT_CHECK(o.beta1 >= 0.f && o.beta1 < 1.f && o.beta2 >= 0.f && o.beta2 < 1.f,
                 "adam: betas must be in [0, 1), got " << o.beta1 << ", " << o.beta2);
  DT_INPUT_CHECK(o.eps > 0.f, "adam: eps must be > 0");
  for (nn::Parameter* p : params_) {
    m_.push_back(zeros_on(p->value.shape(), p->value.device()));
    v_.push_back(zeros_on(p->value.shape(), p->value.device()));
  }
}

void Adam::step(float lr) {
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter* p = params_[i];
    engine_for(p->value.device())
        .adam_update(p->value, p->grad, m_[i], v_[i], lr, o_.beta1, o_.beta2, o_.eps, weight_decay_[i], o_.decoupled,
                     steps_);
  }
}

std::vector<StateTensor> Adam::state() {
  std::vector<StateTensor> s;
  for (size_t i = 0; i < params_.size(); ++i) {
    s.push_back({params_[i]->name + ".exp_avg", &m_[i]});
    s.push_back({params_[i]->name + ".exp_avg_sq", &v_[i]});
  }
  return s;
}

double grad_norm(const std::vector<nn::Parameter*>& params) {
  double ss = 0;
  for (nn::Parameter* p : params) ss += engine_for(p->grad.device()).sum_squares(p->grad);
  return std::sqrt(ss);
}

double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm) {
  double norm = grad_norm(params);
  if (max_norm > 0 && norm > max_norm) {
    float k = static_cast<float>(max_norm / (norm + 1e-6));
    for (nn::Parameter* p : params) engine_for(p->grad.device()).scale(p->grad, k);
  }
  return norm;
}

}  // namespace dtrain::optim

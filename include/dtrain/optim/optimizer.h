#pragma once
// Optimizers over a model's parameters, fp32 master weights. Each parameter's state tensors are
// named (for checkpoints) and live on the parameter's device.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"

namespace dtrain::optim {

struct StateTensor {
  std::string name;  // "<param>.momentum", "<param>.exp_avg", ...
  Tensor* value;
};

// Parameters that share a weight decay (as PyTorch's parameter groups): an optimizer takes several,
// e.g. the matrices decayed and the biases, gains and position table not.
struct ParamGroup {
  std::vector<nn::Parameter*> params;
  float weight_decay = 0.f;
};

// The usual split: matrices (dim >= 2) decay by `weight_decay`; vectors (biases, norm gains) and the
// parameters named in `no_decay` (e.g. a position table) do not. Empty groups are left out.
std::vector<ParamGroup> decay_groups(const std::vector<nn::Parameter*>& params, float weight_decay,
                                     const std::vector<std::string>& no_decay = {});

// Optimizer state by name ("<param>.<state>"), as host copies: what a checkpoint keeps of it.
std::map<std::string, Tensor> state_by_name(const std::vector<StateTensor>& state);
// The inverse: each state tensor takes the entry of its name (InputError naming it when the entry
// is missing or has another shape).
void load_state_by_name(const std::map<std::string, Tensor>& saved, const std::vector<StateTensor>& state);

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  virtual std::string kind() const = 0;
  // One update with learning rate `lr` (from the schedule) using the gradients as they are.
  virtual void step(float lr) = 0;
  void zero_grad();
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  virtual std::vector<StateTensor> state() = 0;
  const std::vector<nn::Parameter*>& params() const { return params_; }  // every group's, in order

 protected:
  std::vector<nn::Parameter*> params_;
  std::vector<float> weight_decay_;  // per parameter, from its group
  int64_t steps_ = 0;
};

struct SgdOptions {
  float momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
};
class SGD : public Optimizer {
 public:
  SGD(std::vector<nn::Parameter*> params, SgdOptions o);  // one group, decayed by o.weight_decay
  SGD(std::vector<ParamGroup> groups, SgdOptions o);      // each group's own decay
  std::string kind() const override { return "sgd"; }
  void step(float lr) override;
  std::vector<StateTensor> state() override;
  void set_momentum(float m) { o_.momentum = m; }  // population-based training's perturbation

 private:
  SgdOptions o_;
  std::vector<Tensor> buf_;
};

struct AdamOptions {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  bool decoupled = false;  // true: AdamW
};
class Adam : public Optimizer {
 public:
  Adam(std::vector<nn::Parameter*> params, AdamOptions o);  // one group, decayed by o.weight_decay
  Adam(std::vector<ParamGroup> groups, AdamOptions o);      // each group's own decay
  std::string kind() const override { return o_.decoupled ? "adamw" : "adam"; }
  void step(float lr) override;
  std::vector<StateTensor> state() override;

 private:
  AdamOptions o_;
  std::vector<Tensor> m_, v_;
};

// Scales all gradients so their global L2 norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm);
double grad_norm(const std::vector<nn::Parameter*>& params);

}  // namespace dtrain::optim

#pragma once
// Module: hand-written forward and backward per layer (no tape). A module keeps what its backward
// needs from the last forward. Parameter gradients accumulate; when a module's backward has made a
// parameter's gradient final it fires the grad-ready hook, so data parallel can start sending.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::nn {

struct Parameter {
  std::string name;  // dotted path, e.g. "features.0.weight"
  Tensor value;
  Tensor grad;
};

// A named tensor that is state but not trained (BatchNorm running statistics).
struct Buffer {
  std::string name;
  Tensor value;
};

using GradReadyHook = std::function<void(Parameter&)>;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  virtual Tensor backward(const Tensor& dy) = 0;
  virtual std::string kind() const = 0;

  // Parameters and buffers with dotted names, in forward order.
  std::vector<Parameter*> parameters();
  std::vector<Buffer*> buffers();
  int64_t parameter_count();

  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }
  void set_grad_ready_hook(GradReadyHook hook);  // on this module and all below it
  // Whether backward must produce d(input). The model's first layer need not (its input is the
  // data): for a first convolution that is a whole backward-data pass saved.
  virtual void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  // Children, for traversal (containers override).
  virtual std::vector<std::pair<std::string, Module*>> children() { return {}; }

 protected:
  // Leaf modules register their own tensors once, in the constructor.
  Parameter& add_parameter(const std::string& name, Tensor value);
  Buffer& add_buffer(const std::string& name, Tensor value);
  void grad_ready(Parameter& p) {
    if (hook_) hook_(p);
  }
  Engine& engine(const Tensor& t) { return engine_for(t.device()); }
  // Reuses `buf` when it already has shape `s`, so steady-state steps allocate nothing.
  static Tensor& ensure(Tensor& buf, const Shape& s, Device device = Device::cpu());

  bool training_ = true;
  bool needs_input_grad_ = true;

 private:
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* bufs);
  std::vector<std::unique_ptr<Parameter>> params_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::string> param_names_, buffer_names_;  // local names ("weight")
  GradReadyHook hook_;
};

using ModulePtr = std::unique_ptr<Module>;

}  // namespace dtrain::nn

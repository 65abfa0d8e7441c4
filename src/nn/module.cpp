#include "dtrain/nn/module.h"

namespace dtrain::nn {

Parameter& Module::add_parameter(const std::string& name, Tensor value) {
  auto p = std::make_unique<Parameter>();
  p->name = name;
  p->grad = Tensor::zeros(value.shape(), value.dtype(), value.device());
  p->value = std::move(value);
  params_.push_back(std::move(p));
  param_names_.push_back(name);
  return *params_.back();
}

Buffer& Module::add_buffer(const std::string& name, Tensor value) {
  buffers_.push_back(std::make_unique<Buffer>(Buffer{name, std::move(value)}));
  buffer_names_.push_back(name);
  return *buffers_.back();
}

void Module::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* bufs) {
  // Names are paths from the module the traversal started at ("3.weight").
  for (size_t i = 0; params && i < params_.size(); ++i) {
    params_[i]->name = prefix + param_names_[i];
    params->push_back(params_[i].get());
  }
  for (size_t i = 0; bufs && i < buffers_.size(); ++i) {
    buffers_[i]->name = prefix + buffer_names_[i];
    bufs->push_back(buffers_[i].get());
  }
  for (auto& [name, child] : children()) child->collect(prefix + name + ".", params, bufs);
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  collect("", &out, nullptr);
  return out;
}

std::vector<Buffer*> Module::buffers() {
  std::vector<Buffer*> out;
  collect("", nullptr, &out);
  return out;
}

int64_t Module::parameter_count() {
  int64_t n = 0;
  for (Parameter* p : parameters()) n += p->value.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children()) child->train(on);
}

void Module::set_grad_ready_hook(GradReadyHook hook) {
  hook_ = hook;
  for (auto& [name, child] : children()) child->set_grad_ready_hook(hook);
}

Tensor& Module::ensure(Tensor& buf, const Shape& s, Device device) {
  if (!buf.defined() || buf.shape() != s || buf.device() != device) buf = Tensor::empty(s, DType::F32, device);
  return buf;
}

}  // namespace dtrain::nn

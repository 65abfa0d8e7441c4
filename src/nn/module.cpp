#include "dtrain/nn/module.h"

#include <algorithm>
#include <map>

#include "dtrain/core/env.h"

namespace dtrain::nn {

namespace {
thread_local Phase g_phase = Phase::Forward;
}

PhaseScope::PhaseScope(Phase p) : prev_(g_phase) { g_phase = p; }
PhaseScope::~PhaseScope() { g_phase = prev_; }
Phase PhaseScope::current() { return g_phase; }

void update_working_copies(const std::vector<Parameter*>& params, MathPrecision p) {
  const bool on = (p == MathPrecision::BF16 || p == MathPrecision::F16) && env::get_long("DTRAIN_WORKING_COPIES") != 0;
  const DType dt = p == MathPrecision::F16 ? DType::F16 : DType::BF16;
  for (Parameter* w : params) {
    if (!w->gemm_weight) continue;
    if (!on) {
      w->working = Tensor();
      continue;
    }
    if (!w->working.defined() || w->working.dtype() != dt || w->working.device() != w->value.device() ||
        w->working.shape() != w->value.shape())
      w->working = Tensor::empty(w->value.shape(), dt, w->value.device());
    engine_for(w->value.device()).cast(w->value, w->working);
  }
}

const Tensor& gemm_operand(const Engine& e, const Parameter& w, int64_t m, int64_t n) {
  if (!w.working.defined() || !e.rounds_gemm(m, n)) return w.value;
  const DType dt = e.math_precision() == MathPrecision::F16 ? DType::F16 : DType::BF16;
  return w.working.dtype() == dt ? w.working : w.value;
}

Parameter& Module::add_parameter(const std::string& name, Tensor value) {
  auto p = std::make_unique<Parameter>();
  p->name = name;
  p->grad = zeros_on(value.shape(), value.device(), value.dtype());
  p->value = std::move(value);
  params_.push_back(std::move(p));
  param_names_.push_back(name);
  return *params_.back();
}

void Module::rename_parameter(const std::string& from, const std::string& to) {
  auto it = std::find(param_names_.begin(), param_names_.end(), from);
  DT_CHECK(it != param_names_.end(), kind() << " has no parameter " << from);
  *it = to;
}

Buffer& Module::add_buffer(const std::string& name, Tensor value, bool host) {
  buffers_.push_back(std::make_unique<Buffer>(Buffer{name, std::move(value), host}));
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
  for (auto& [name, child] : children()) child->collect(child_prefix(prefix, name), params, bufs);
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

void Module::to(Device device) {
  auto move = [&](Tensor& t) {
    if (!t.defined() || t.device() == device) return;
    Tensor moved = Tensor::empty(t.shape(), t.dtype(), device);
    copy_any(t, moved);
    t = moved;
  };
  for (Parameter* p : parameters()) {  // a tied parameter is listed once per owner: moved once
    move(p->value);
    move(p->grad);
    p->working = Tensor();  // made again on the new device by update_working_copies
  }
  for (Buffer* b : buffers())
    if (!b->host) move(b->value);
  release_activations();
}

Device device_of(Module& m) {
  const std::vector<Parameter*> params = m.parameters();
  return params.empty() ? Device::cpu() : params.front()->value.device();
}

std::vector<std::vector<Module*>> ShardUnits::by_unit() const {
  std::vector<std::vector<Module*>> units;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto u = static_cast<size_t>(unit_of[i]);
    if (units.size() <= u) units.resize(u + 1);
    units[u].push_back(entries[i]);
  }
  return units;
}

void UnitSink::layer_added(std::unique_ptr<Module>& layer) {
  if (!layer->parameters().empty()) unit_built({layer.get()});
}

void drop_values(Parameter& p) {
  const Shape none(p.value.shape().size(), 0);
  p.value = Tensor::empty(none, DType::F32, p.value.device());
  p.grad = Tensor::empty(none, DType::F32, p.value.device());
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

void Module::start_decoding(int64_t capacity) {
  for (auto& [name, child] : children()) child->start_decoding(capacity);
}

void Module::decode_at(int64_t position) {
  for (auto& [name, child] : children()) child->decode_at(position);
}

void Module::set_grad_ready_hook(GradReadyHook hook) {
  hook_ = hook;
  for (auto& [name, child] : children()) child->set_grad_ready_hook(hook);
}

Tensor Module::run_forward(const Tensor& x) {
  if (pass_hooks_ && pass_hooks_->before_forward) pass_hooks_->before_forward();
  Tensor y = forward(x);
  if (pass_hooks_ && pass_hooks_->after_forward) pass_hooks_->after_forward();
  return y;
}

Tensor Module::run_backward(const Tensor& dy) {
  if (pass_hooks_ && pass_hooks_->before_backward) pass_hooks_->before_backward();
  Tensor dx = backward(dy);
  if (pass_hooks_ && pass_hooks_->after_backward) pass_hooks_->after_backward();
  return dx;
}

void Module::track(Tensor& slot, bool scratch) {
  Tensor* p = &slot;
  if (std::find(activation_slots_.begin(), activation_slots_.end(), p) != activation_slots_.end() ||
      std::find(scratch_slots_.begin(), scratch_slots_.end(), p) != scratch_slots_.end())
    return;
  (g_phase == Phase::Forward && !scratch ? activation_slots_ : scratch_slots_).push_back(p);
}

void Module::activation_slots(std::vector<Tensor*>& out) {
  out.insert(out.end(), activation_slots_.begin(), activation_slots_.end());
  for (auto& [name, child] : children()) child->activation_slots(out);
}

void Module::slots_of(bool scratch, std::vector<Tensor*>& out) {
  const auto& mine = scratch ? scratch_slots_ : activation_slots_;
  out.insert(out.end(), mine.begin(), mine.end());
  for (auto& [name, child] : children()) child->slots_of(scratch, out);
}

std::vector<Tensor> Module::take_buffers(bool scratch) {
  std::vector<Tensor*> slots;
  slots_of(scratch, slots);
  std::vector<Tensor> out;
  out.reserve(slots.size());
  for (Tensor* t : slots) {
    out.push_back(std::move(*t));
    *t = Tensor();
  }
  return out;
}

void Module::give_buffers(std::vector<Tensor>&& buffers, bool scratch) {
  std::vector<Tensor*> slots;
  slots_of(scratch, slots);
  for (size_t i = 0; i < slots.size() && i < buffers.size(); ++i) *slots[i] = std::move(buffers[i]);
  buffers.clear();
}

ActivationStash Module::stash_activations() {
  std::vector<Tensor*> slots;
  activation_slots(slots);
  ActivationStash stash;
  stash.reserve(slots.size());
  for (Tensor* t : slots) stash.emplace_back(t, std::move(*t));
  for (Tensor* t : slots) *t = Tensor();
  return stash;
}

void Module::restore_activations(ActivationStash&& stash) {
  for (auto& [slot, t] : stash) *slot = std::move(t);
  stash.clear();
}

void Module::release_activations() {
  std::vector<Tensor*> slots;
  activation_slots(slots);
  for (Tensor* t : slots) *t = Tensor();
}

namespace {
// Distinct storage: views of one buffer count once, at the largest extent seen.
size_t distinct_bytes(const std::vector<const Tensor*>& ts) {
  std::map<const void*, size_t> seen;
  for (const Tensor* t : ts)
    if (t->defined()) {
      size_t& b = seen[t->storage_id()];
      b = std::max(b, t->storage_bytes());
    }
  size_t total = 0;
  for (auto& [id, b] : seen) total += b;
  return total;
}
}  // namespace

size_t Module::activation_bytes() {
  std::vector<Tensor*> slots;
  activation_slots(slots);
  return distinct_bytes(std::vector<const Tensor*>(slots.begin(), slots.end()));
}

size_t Module::stash_bytes(const ActivationStash& stash) {
  std::vector<const Tensor*> ts;
  for (auto& [slot, t] : stash) ts.push_back(&t);
  return distinct_bytes(ts);
}

Tensor& Module::ensure_temp(Tensor& buf, const Shape& s, Device device, DType dtype) {
  track(buf, true);
  if (!buf.defined() || buf.shape() != s || buf.device() != device || buf.dtype() != dtype)
    buf = Tensor::empty(s, dtype, device);
  return buf;
}

Tensor& Module::ensure(Tensor& buf, const Shape& s, Device device, DType dtype) {
  track(buf);
  if (!buf.defined() || buf.shape() != s || buf.device() != device || buf.dtype() != dtype)
    buf = Tensor::empty(s, dtype, device);
  return buf;
}

}  // namespace dtrain::nn

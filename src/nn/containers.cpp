#include "dtrain/nn/layers.h"

namespace dtrain::nn {

std::unique_ptr<Sequential> Sequential::stage_of(std::unique_ptr<Sequential> whole, size_t begin, size_t end) {
  DT_CHECK(whole && begin < end && end <= whole->size(),
           "Sequential::stage_of: layers [" << begin << ", " << end << ") of " << (whole ? whole->size() : 0));
  auto stage = std::make_unique<Sequential>();
  for (size_t i = begin; i < end; ++i) stage->add(std::move(whole->layers_[i]), whole->names_[i]);
  stage->first_name_ = whole->first_name_ + begin;
  stage->training_ = whole->training_;  // the layers keep their own flags
  return stage;
}

Sequential& Sequential::add(ModulePtr m, std::optional<std::string> name) {
  layers_.push_back(std::move(m));
  names_.push_back(std::move(name));
  if (sink_) sink_->layer_added(layers_.back());
  return *this;
}

ModulePtr Sequential::replace(size_t i, ModulePtr m) {
  DT_CHECK(i < layers_.size(), "Sequential::replace(" << i << ") of " << layers_.size() << " layers");
  DT_CHECK(!sink_, "Sequential::replace during a shard-by-shard build (the sink has the old layer's block)");
  std::swap(layers_[i], m);
  return m;
}

// Without an input gradient, no layer up to and including the first one with parameters needs
// one either (Flatten then Linear: the Linear's d(input) would be thrown away).
void Sequential::set_needs_input_grad(bool needed) {
  needs_input_grad_ = needed;
  for (auto& l : layers_) {
    l->set_needs_input_grad(needed);
    if (needed || !l->parameters().empty()) break;
  }
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& l : layers_) h = l->run_forward(h);
  return h;
}

Tensor Sequential::backward(const Tensor& dy) {
  Tensor g = dy;
  for (auto it = layers_.rbegin(); it != layers_.rend() && g.defined(); ++it) g = (*it)->run_backward(g);
  return g;  // undefined when the input gradient was not asked for
}

ShardUnits Sequential::shard_units() {
  ShardUnits units;
  for (auto& l : layers_) {
    if (l->parameters().empty()) continue;
    units.unit_of.push_back(static_cast<int>(units.entries.size()));
    units.entries.push_back(l.get());
  }
  return units;
}

std::vector<std::pair<std::string, Module*>> Sequential::children() {
  std::vector<std::pair<std::string, Module*>> out;
  for (size_t i = 0; i < layers_.size(); ++i)
    out.emplace_back(names_[i] ? *names_[i] : std::to_string(first_name_ + i), layers_[i].get());
  return out;
}

// Between steps: the activations of an earlier forward are dropped.
std::vector<Shape> layer_boundary_shapes(Sequential& model, const Shape& input) {
  DT_CHECK(!input.empty() && input[0] >= 1, "layer_boundary_shapes: input " << shape_str(input) << " has no batch");
  const bool was_training = model.training();
  model.eval();  // no running statistics updated, no dropout drawn
  Shape one = input;
  one[0] = 1;
  Tensor h = zeros_on(one, device_of(model));
  std::vector<Shape> shapes{input};
  for (size_t i = 0; i < model.size(); ++i) {
    h = model[i].forward(h);
    DT_CHECK(h.dim() >= 1 && h.size(0) == 1, model[i].kind() << " turned a batch of 1 into " << h.str());
    Shape s = h.shape();
    s[0] = input[0];
    shapes.push_back(s);
  }
  model.release_activations();
  model.train(was_training);
  return shapes;
}

Residual::Residual(ModulePtr body, ModulePtr shortcut, ResidualNames names, ModulePtr after)
    : body_(std::move(body)), shortcut_(std::move(shortcut)), after_(std::move(after)), names_(std::move(names)) {
  DT_CHECK(!names_.flat_body || dynamic_cast<Sequential*>(body_.get()),
           "Residual: a flat-named body must be a Sequential");
}

Tensor Residual::forward(const Tensor& x) {
  Tensor a = body_->forward(x);
  Tensor b = shortcut_ ? shortcut_->forward(x) : x;
  DT_CHECK(a.shape() == b.shape(), "Residual: body gives " << a.str() << " but shortcut gives " << b.str());
  Tensor& y = ensure(y_, a.shape(), x.device());
  engine(x).add(a, b, y);
  return after_ ? after_->forward(y) : y;
}

Tensor Residual::backward(const Tensor& dy_after) {
  const Tensor dy = after_ ? after_->backward(dy_after) : dy_after;
  Tensor g_body = body_->backward(dy);
  Tensor& dx = ensure(dx_, g_body.shape(), dy.device());
  if (shortcut_) {
    Tensor g_short = shortcut_->backward(dy);
    engine(dy).add(g_body, g_short, dx);
  } else {
    engine(dy).add(g_body, dy, dx);
  }
  return dx;
}

std::vector<std::pair<std::string, Module*>> Residual::children() {
  std::vector<std::pair<std::string, Module*>> out{{"body", body_.get()}};
  if (names_.flat_body) out = body_->children();
  if (shortcut_) out.emplace_back(names_.shortcut, shortcut_.get());
  if (after_) out.emplace_back("after", after_.get());
  return out;
}

Checkpointed::Checkpointed(ModulePtr body, std::shared_ptr<std::vector<Tensor>> pool)
    : body_(std::move(body)), pool_(pool ? std::move(pool) : std::make_shared<std::vector<Tensor>>()) {}

void Checkpointed::set_needs_input_grad(bool needed) {
  needs_input_grad_ = needed;
  body_->set_needs_input_grad(needed);
}

Tensor Checkpointed::forward(const Tensor& x) {
  keep(x_, x);
  PhaseScope fwd(Phase::Forward);
  body_->give_buffers(std::move(*pool_), false);
  Tensor y = body_->forward(x);
  // The body's buffers go on to the next block, so its output is copied out first.
  ensure(y_, y.shape(), y.device());
  engine(y).copy(y, y_);
  *pool_ = body_->take_buffers(false);
  return y_;
}

Tensor Checkpointed::backward(const Tensor& dy) {
  {
    PhaseScope fwd(Phase::Forward);
    body_->give_buffers(std::move(*pool_), false);
    body_->forward(x_);  // the same input and weights: the same activations
  }
  Tensor dx;
  {
    PhaseScope bwd(Phase::Backward);
    dx = body_->backward(dy);
  }
  *pool_ = body_->take_buffers(false);
  return dx;
}

}  // namespace dtrain::nn

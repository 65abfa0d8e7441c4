// measure_layer_costs (pipeline.h): per-layer forward + backward times for balancing image stages.
#include <algorithm>
#include <limits>

#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/nn/layers.h"
#include "dtrain/parallel/pipeline.h"

namespace dtrain::parallel {

namespace {

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  copy_any(t, c);
  return c;
}

// The gradients and buffers of a model, copied when made and copied back when destroyed, so that
// passes run only to time them leave the model as it was.
class SavedTrainingState {
 public:
  explicit SavedTrainingState(nn::Module& m) : params_(m.parameters()), buffers_(m.buffers()) {
    for (nn::Parameter* p : params_) grads_.push_back(copy_of(p->grad));
    for (nn::Buffer* b : buffers_) values_.push_back(copy_of(b->value));
  }
  ~SavedTrainingState() {
    for (size_t i = 0; i < params_.size(); ++i) copy_any(grads_[i], params_[i]->grad);
    for (size_t i = 0; i < buffers_.size(); ++i) copy_any(values_[i], buffers_[i]->value);
  }
  SavedTrainingState(const SavedTrainingState&) = delete;
  SavedTrainingState& operator=(const SavedTrainingState&) = delete;

 private:
  std::vector<nn::Parameter*> params_;
  std::vector<nn::Buffer*> buffers_;
  std::vector<Tensor> grads_, values_;
};

// Seconds of each layer's forward plus its backward in one training pass over `x`. The engine is
// synchronised around each layer, so a GPU's queued work is charged to the layer that queued it.
std::vector<double> time_layers(nn::Sequential& model, const Tensor& x, Engine& e) {
  std::vector<double> seconds(model.size(), 0.0);
  Tensor h = x;
  for (size_t i = 0; i < model.size(); ++i) {
    const double t0 = now_s();
    h = model[i].forward(h);
    e.synchronize();
    seconds[i] = now_s() - t0;
  }
  Tensor g = Tensor::empty(h.shape(), DType::F32, h.device());
  e.fill(g, 1.f);
  nn::PhaseScope backward(nn::Phase::Backward);
  for (size_t i = model.size(); i-- > 0 && g.defined();) {  // undefined: no layer below needs d(input)
    const double t0 = now_s();
    g = model[i].backward(g);
    e.synchronize();
    seconds[i] += now_s() - t0;
  }
  return seconds;
}

Tensor random_input(const Shape& shape, Device device) {
  Rng rng(17);
  Tensor host = Tensor::empty(shape);
  for (int64_t i = 0; i < host.numel(); ++i) host.f32()[i] = rng.uniform(-1.f, 1.f);
  Tensor x = Tensor::empty(shape, DType::F32, device);
  copy_any(host, x);
  return x;
}

}  // namespace

std::vector<double> measure_layer_costs(nn::Sequential& model, const Shape& input, comm::Communicator& comm,
                                        int repeats) {
  DT_CHECK(repeats >= 1 && model.size() >= 1 && model.training(),
           "measure_layer_costs needs a model in training mode with layers, and repeats >= 1 (got " << repeats << ")");
  const Device device = nn::device_of(model);
  Engine& e = engine_for(device);
  const Tensor x = random_input(input, device);
  std::vector<double> best(model.size(), std::numeric_limits<double>::infinity());
  {
    SavedTrainingState saved(model);
    time_layers(model, x, e);  // untimed: primitives are made for these shapes
    for (int r = 0; r < repeats; ++r) {
      const std::vector<double> s = time_layers(model, x, e);
      for (size_t i = 0; i < s.size(); ++i) best[i] = std::min(best[i], s[i]);
    }
    model.release_activations();
  }
  Tensor costs = Tensor::empty({static_cast<int64_t>(best.size())});
  for (size_t i = 0; i < best.size(); ++i) costs.f32()[i] = static_cast<float>(best[i]);
  comm.allreduce(costs, comm::ReduceOp::Min)->wait();
  return std::vector<double>(costs.f32(), costs.f32() + costs.numel());
}

}  // namespace dtrain::parallel

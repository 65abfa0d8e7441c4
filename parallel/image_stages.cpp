// An image model's pipeline stages (pipeline.h): each layer's boundary shapes and costs measured
// while the model is drawn, and a stage drawn without the other stages' values.
#include <algorithm>
#include <limits>

#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/nn/layers.h"
#include "dtrain/parallel/pipeline.h"

namespace dtrain::parallel {

namespace {

Tensor random_input(const Shape& shape, Device device) {
  Rng rng(17);
  Tensor host = Tensor::empty(shape);
  for (int64_t i = 0; i < host.numel(); ++i) host.f32()[i] = rng.uniform(-1.f, 1.f);
  Tensor x = Tensor::empty(shape, DType::F32, device);
  copy_any(host, x);
  return x;
}

void drop_layer_values(nn::Module& layer) {
  for (nn::Parameter* p : layer.parameters()) nn::drop_values(*p);
}

// Runs each layer as the model's constructor adds it, on a random batch of the shape the layers
// before it give, then drops its values: the next layer's input shape, and its time.
class ProbeSink final : public nn::UnitSink {
 public:
  ProbeSink(const Shape& input, Device device, int repeats) : device_(device), repeats_(repeats) {
    probe.boundaries.push_back(input);
  }
  void unit_built(const std::vector<nn::Module*>&) override {
    DT_CHECK(false, "probe_layers measures the top-level layers of a Sequential only");
  }
  void layer_added(nn::ModulePtr& layer) override {
    nn::Module& m = *layer;
    m.to(device_);
    const Tensor x = random_input(probe.boundaries.back(), device_);
    Engine& e = engine_for(device_);
    double best = std::numeric_limits<double>::infinity();
    Shape out;
    // Pass 0 is untimed: oneDNN and cuDNN make their primitives on a shape's first call.
    for (int r = 0; r <= repeats_; ++r) {
      const double t0 = now_s();
      const Tensor y = m.forward(x);
      out = y.shape();
      if (repeats_ > 0) {
        Tensor g = Tensor::empty(y.shape(), DType::F32, device_);
        e.fill(g, 1.f);
        nn::PhaseScope backward(nn::Phase::Backward);
        m.backward(g);
      }
      e.synchronize();  // a GPU's queued work is charged to the layer that queued it
      if (r > 0) best = std::min(best, now_s() - t0);
    }
    DT_CHECK(!out.empty() && out[0] == x.size(0),
             m.kind() << " turned a batch of " << x.size(0) << " into " << shape_str(out));
    m.release_activations();
    drop_layer_values(m);
    probe.boundaries.push_back(out);
    probe.seconds.push_back(repeats_ > 0 ? best : 0.0);
  }
  LayerProbe probe;

 private:
  Device device_;
  int repeats_;
};

// Hands the layers [begin, end) on to `next` (or keeps them as drawn) and drops the others' values.
class StageSink final : public nn::UnitSink {
 public:
  StageSink(int begin, int end, nn::UnitSink* next) : begin_(begin), end_(end), next_(next) {}
  void unit_built(const std::vector<nn::Module*>&) override {
    DT_CHECK(false, "draw_stage cuts the top-level layers of a Sequential only");
  }
  void layer_added(nn::ModulePtr& layer) override {
    const int i = added_++;
    if (i < begin_ || i >= end_)
      drop_layer_values(*layer);
    else if (next_)
      next_->layer_added(layer);
  }

 private:
  int begin_, end_, added_ = 0;
  nn::UnitSink* next_;
};

}  // namespace

LayerProbe probe_layers(nn::ModelSpec spec, const Shape& input, Device device, int repeats) {
  DT_CHECK(repeats >= 0 && !input.empty() && input[0] >= 1,
           "probe_layers: repeats " << repeats << " on a batch of shape " << shape_str(input));
  ProbeSink sink(input, device, repeats);
  spec.sink = &sink;
  nn::make_sequential_model(spec);
  return std::move(sink.probe);
}

std::vector<double> least_over_ranks(const std::vector<double>& seconds, comm::Communicator& comm) {
  Tensor least = Tensor::empty({static_cast<int64_t>(seconds.size())});
  for (size_t i = 0; i < seconds.size(); ++i) least.f32()[i] = static_cast<float>(seconds[i]);
  comm.allreduce(least, comm::ReduceOp::Min)->wait();
  return std::vector<double>(least.f32(), least.f32() + least.numel());
}

std::unique_ptr<nn::Sequential> draw_stage(nn::ModelSpec spec, int begin, int end) {
  StageSink sink(begin, end, spec.sink);
  spec.sink = &sink;
  std::unique_ptr<nn::Sequential> whole = nn::make_sequential_model(spec);
  DT_CHECK(begin >= 0 && begin < end && end <= static_cast<int>(whole->size()),
           "draw_stage: layers [" << begin << ", " << end << ") of " << whole->size());
  return nn::Sequential::stage_of(std::move(whole), static_cast<size_t>(begin), static_cast<size_t>(end));
}

}  // namespace dtrain::parallel

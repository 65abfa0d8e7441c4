// Structured pruning made physical (include/dtrain/nn/shrink.h).
#include "dtrain/nn/shrink.h"

#include <map>

#include "dtrain/kernels/engine.h"

namespace dtrain::nn {

namespace {

// A Conv2d or Linear: its weight (K, ...), its bias (K) or null, and the output channels it keeps.
struct Producer {
  size_t layer;
  Parameter* w;
  Parameter* b;
  std::vector<int64_t> kept;
};

Tensor host(const Tensor& t) { return t.device().is_cpu() ? t : to_host(t); }

// The rows of the producer's weight that are not pruned whole: a weight or the bias is non-zero.
std::vector<int64_t> live_rows(const Producer& p) {
  const Tensor w = host(p.w->value);
  const Tensor b = p.b ? host(p.b->value) : Tensor{};
  const int64_t rows = w.size(0), per = w.numel() / rows;
  std::vector<int64_t> kept;
  for (int64_t r = 0; r < rows; ++r) {
    bool live = b.defined() && b.f32()[r] != 0.f;
    for (int64_t j = 0; j < per && !live; ++j) live = w.f32()[r * per + j] != 0.f;
    if (live) kept.push_back(r);
  }
  if (kept.empty()) kept.push_back(0);  // a layer without channels is no model: one stays (it computes 0)
  return kept;
}

std::vector<int64_t> all_of(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// src viewed as (K, C, rest): rows `rows`, input channels `cols`, into dst (its shape says how many).
void take(const Tensor& src, int64_t in_channels, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
          Tensor& dst, const std::string& name) {
  const Tensor s = host(src);
  const int64_t k = s.size(0), rest = s.numel() / (k * in_channels);
  const auto kr = static_cast<int64_t>(rows.size()), kc = static_cast<int64_t>(cols.size());
  DT_CHECK(dst.numel() == kr * kc * rest, "prune-export: " << name << " keeps " << kr << " x " << kc << " x " << rest
                                                           << " values, the shrunk model holds " << dst.str());
  Tensor d = Tensor::empty(dst.shape());
  float* o = d.f32();
  for (int64_t r : rows)
    for (int64_t c : cols)
      for (int64_t j = 0; j < rest; ++j) *o++ = s.f32()[(r * in_channels + c) * rest + j];
  copy_any(d, dst);
}

// The Conv2d/Linear layers of `model`; throws naming any layer that does not keep a 0 channel 0.
std::vector<Producer> producers(Sequential& model, const Shape& input) {
  Shape batched{1};
  batched.insert(batched.end(), input.begin(), input.end());
  const std::vector<Shape> shapes = layer_boundary_shapes(model, batched);
  std::vector<Producer> out;
  for (size_t i = 0; i < model.size(); ++i) {
    Module& m = model[i];
    const size_t rank = shapes[i].size() - 1;  // dimensions per sample at the layer's input
    if (auto* c = dynamic_cast<Conv2d*>(&m); c && rank == 3) {
      out.push_back({i, &c->weight(), c->bias(), {}});
    } else if (auto* l = dynamic_cast<Linear*>(&m); l && rank == 1) {
      out.push_back({i, &l->weight(), l->bias(), {}});
    } else if (!dynamic_cast<Activation*>(&m) && !dynamic_cast<Pool2d*>(&m) && !dynamic_cast<Flatten*>(&m) &&
               !dynamic_cast<Dropout*>(&m)) {
      throw InputError("prune-export: layer " + std::to_string(i) + " (" + m.kind() +
                       ") is not supported (shrinking runs Conv2d, Linear over a flat input, ReLU, GELU, pooling, "
                       "Flatten and Dropout)");
    }
  }
  DT_INPUT_CHECK(out.size() >= 2,
                 "prune-export: the model has " << out.size() << " Conv2d/Linear layer(s): no hidden channel to drop");
  return out;
}

}  // namespace

ShrunkModel shrink_pruned_channels(Sequential& model, const ModelSpec& spec) {
  std::vector<Producer> prods = producers(model, spec.input);
  std::vector<int64_t> widths;
  size_t dropped = 0;
  for (size_t j = 0; j + 1 < prods.size(); ++j) {
    prods[j].kept = live_rows(prods[j]);
    widths.push_back(static_cast<int64_t>(prods[j].kept.size()));
    dropped += static_cast<size_t>(prods[j].w->value.size(0)) - prods[j].kept.size();
  }
  prods.back().kept = all_of(prods.back().w->value.size(0));  // the classes
  DT_INPUT_CHECK(dropped > 0,
                 "prune-export: no output channel has all-zero weights and bias, nothing to drop "
                 "(prune whole channels with --prune-structured true)");
  ShrunkModel out{with_widths(spec, widths), nullptr, {}};
  out.model = make_sequential_model(out.spec);
  std::map<std::string, Parameter*> params;
  for (Parameter* p : out.model->parameters()) params[p->name] = p;
  for (size_t j = 0; j < prods.size(); ++j) {
    const Producer& p = prods[j];
    const int64_t in = j == 0 ? 1 : prods[j - 1].w->value.size(0);
    const std::vector<int64_t> cols = j == 0 ? all_of(1) : prods[j - 1].kept;
    DT_INPUT_CHECK((p.w->value.numel() / p.w->value.size(0)) % in == 0,
                   "prune-export: layer " << p.layer << " (" << model[p.layer].kind() << ") reads "
                                          << p.w->value.numel() / p.w->value.size(0)
                                          << " inputs, not a whole number per channel of the " << in
                                          << " of the layer before");
    take(p.w->value, in, p.kept, cols, params.at(p.w->name)->value, p.w->name);
    if (p.b) take(p.b->value, 1, p.kept, all_of(1), params.at(p.b->name)->value, p.b->name);
    out.layers.push_back(std::to_string(p.layer) + " " + model[p.layer].kind() + ": " +
                         std::to_string(p.w->value.size(0)) + " -> " + std::to_string(p.kept.size()) +
                         " output channels");
  }
  std::map<std::string, Buffer*> buffers;  // dropout streams: the same shapes
  for (Buffer* b : model.buffers()) buffers[b->name] = b;
  for (Buffer* b : out.model->buffers()) copy_any(host(buffers.at(b->name)->value), b->value);
  out.model->eval();
  return out;
}

}  // namespace dtrain::nn

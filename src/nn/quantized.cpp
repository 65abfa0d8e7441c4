// Post-training int8 quantization (include/dtrain/nn/quantized.h): calibration, the translation of
// a Sequential into int8 steps, and their forward.
#include "dtrain/nn/quantized.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

namespace dtrain::nn {

using int8::QType;

namespace {

constexpr int kMaxBuffers = 8;  // activation buffers an int8 forward may name (ResNet blocks use 3)

float max_abs(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : to_host(t);
  const float* p = h.f32();
  float m = 0.f;
  for (int64_t i = 0; i < h.numel(); ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

void note(Int8Ranges& r, const std::string& key, const Tensor& y) {
  float& m = r[key];
  m = std::max(m, max_abs(y));
}

// `m`'s forward on x, noting max |y| at the output of every module inside under its path. A
// Residual is run part by part so its body and shortcut get their own ranges.
Tensor observe(Module& m, const std::string& path, const Tensor& x, Int8Ranges& r) {
  Tensor y;
  if (auto* res = dynamic_cast<Residual*>(&m)) {
    const Tensor a = observe(res->body(), join(path, "body"), x, r);
    const Tensor b = res->shortcut() ? observe(*res->shortcut(), join(path, "shortcut"), x, r) : x;
    y = Tensor::empty(a.shape(), DType::F32, a.device());
    engine_for(a.device()).add(a, b, y);
  } else if (auto* s = dynamic_cast<Sequential*>(&m)) {
    y = x;
    for (auto& [name, child] : s->children()) y = observe(*child, join(path, name), y, r);
  } else {
    y = m.forward(x);
  }
  if (!path.empty()) note(r, path, y);
  return y;
}

Tensor host(const Tensor& t) { return t.device().is_cpu() ? t : to_host(t); }

// A convolution before quantization: geometry, weights (K, C, R, S) and bias (K) in f32.
struct FloatConv {
  int8::ConvShape g;
  std::vector<float> w, b;
};

std::vector<float> values(const Tensor& t) {
  const Tensor h = host(t);
  return std::vector<float>(h.f32(), h.f32() + h.numel());
}

FloatConv from_conv(Conv2d& c, const Shape& image) {
  FloatConv f{{image[0], image[1], image[2], c.out_channels(), c.kernel(), c.kernel(), c.stride(), c.pad()},
              values(c.weight().value),
              c.bias() ? values(c.bias()->value) : std::vector<float>(static_cast<size_t>(c.out_channels()), 0.f)};
  return f;
}

// A Linear over the flattened (C, H, W) image: its (K, C*H*W) weights are a (K, C, H, W) kernel.
// `averaged`: the Linear reads the image's global average (K, C), so each of the H*W positions
// gets w / (H W).
FloatConv from_linear(Linear& l, const Shape& image, bool averaged) {
  const Tensor& w = l.weight().value;
  const int64_t k = w.size(0), hw = image[1] * image[2];
  FloatConv f{{image[0], image[1], image[2], k, image[1], image[2], 1, 0},
              {},
              l.bias() ? values(l.bias()->value) : std::vector<float>(static_cast<size_t>(k), 0.f)};
  f.w = values(w);
  if (!averaged) return f;
  std::vector<float> spread(static_cast<size_t>(k * image[0] * hw));
  for (size_t i = 0; i < f.w.size(); ++i)
    std::fill_n(spread.begin() + static_cast<std::ptrdiff_t>(i * hw), hw, f.w[i] / static_cast<float>(hw));
  f.w = std::move(spread);
  return f;
}

// Evaluation mode's BatchNorm after the convolution: per output channel k, with a = gamma / sqrt(var
// + eps), w[k] *= a and b[k] = (b[k] - mean) a + beta.
void fold_batchnorm(const BatchNorm2d& bn, FloatConv& f) {
  const std::vector<float> gamma = values(bn.gamma()), beta = values(bn.beta()), mean = values(bn.running_mean()),
                           var = values(bn.running_var());
  const size_t per = f.w.size() / static_cast<size_t>(f.g.k);
  for (size_t k = 0; k < static_cast<size_t>(f.g.k); ++k) {
    const float a = gamma[k] / std::sqrt(var[k] + bn.eps());
    for (size_t i = 0; i < per; ++i) f.w[k * per + i] *= a;
    f.b[k] = (f.b[k] - mean[k]) * a + beta[k];
  }
}

// Per output channel k: scale[k] = max |w[k, :]| / 63, q = round(w / scale) in [-63, 63] (7 bits, int8.h).
Int8Layer quantized(const FloatConv& f) {
  Int8Layer l;
  l.conv = f.g;
  l.bias = f.b;
  const int64_t k = f.g.k, per = static_cast<int64_t>(f.w.size()) / k;
  l.weights.resize(f.w.size());
  l.weight_scales.resize(static_cast<size_t>(k));
  int8::quantize_rows_symmetric(f.w.data(), k, per, int8::kWeightMax, l.weights.data(), l.weight_scales.data());
  return l;
}

std::string describe(const std::string& path, const Module& m) { return "layer " + path + " (" + m.kind() + ")"; }

[[noreturn]] void refuse(const std::string& path, const Module& m, const std::string& why = "") {
  throw InputError("int8: " + describe(path, m) + " is not supported" + (why.empty() ? "" : " (" + why + ")") +
                   " (int8 runs Conv2d (with a BatchNorm2d after it), Linear over a flat input or a global average "
                   "pool, a ReLU right after either, Residual blocks, MaxPool2d without padding, Flatten and Dropout)");
}

// The children of a Sequential being translated, with their paths.
struct Children {
  std::string prefix;
  std::vector<std::pair<std::string, Module*>> list;
  Module* at(size_t j) const { return j < list.size() ? list[j].second : nullptr; }
  std::string path(size_t j) const { return join(prefix, list[j].first); }
};

// Walks the model, emitting int8 steps into `spec`; `image_` is the (C, H, W) of the activation
// being translated, `flat_` whether it is read as one vector (after Flatten or a Linear).
class Translator {
 public:
  Translator(const Int8Ranges& ranges, Int8Spec& spec, const Shape& input)
      : ranges_(ranges),
        spec_(spec),
        image_(input.size() == 3 ? input : Shape{shape_numel(input), 1, 1}),
        flat_(input.size() != 3) {}

  // The layers of the Sequential `m` (path `prefix`) reading buffer `in`; the buffers in `busy` hold
  // values still needed and are not written. Returns the buffer of the output.
  int sequence(Module& m, const std::string& prefix, int in, const std::vector<int>& busy);

 private:
  // A Conv2d, a Linear, or a GlobalAvgPool and the Linear reading it, at child i, with the
  // BatchNorm2d after a Conv2d folded; appends its step and returns how many children it took.
  size_t weighted(const Children& c, size_t i, int& cur, const std::vector<int>& busy);
  void max_pool(const Pool2d& p, const std::string& path, int& cur, const std::vector<int>& busy);
  int residual(Residual& r, const std::string& path, int x, std::vector<int> busy);
  // A ReLU at child j fuses into the last step (its output then u8 with the ReLU's range).
  bool fuse_relu(const Children& c, size_t j);
  // Appends `l` reading buffer `src`, writing the lowest buffer neither `src` nor busy; returns it.
  int push(Int8Layer l, int src, const std::vector<int>& busy);
  float range(const std::string& path) const {
    auto it = ranges_.find(path);
    DT_INPUT_CHECK(it != ranges_.end(), "int8: no calibrated range for layer " << path);
    return it->second;
  }

  const Int8Ranges& ranges_;
  Int8Spec& spec_;
  Shape image_;
  bool flat_;
};

int Translator::push(Int8Layer l, int src, const std::vector<int>& busy) {
  l.src = src;
  l.dst = 0;
  while (l.dst == src || std::find(busy.begin(), busy.end(), l.dst) != busy.end()) ++l.dst;
  spec_.layers.push_back(std::move(l));
  return spec_.layers.back().dst;
}

bool Translator::fuse_relu(const Children& c, size_t j) {
  auto* act = dynamic_cast<Activation*>(c.at(j));
  if (!act || act->op() != Unary::Relu) return false;
  spec_.layers.back().relu = true;
  spec_.layers.back().out_range = range(c.path(j));
  return true;
}

int Translator::sequence(Module& m, const std::string& prefix, int in, const std::vector<int>& busy) {
  if (!dynamic_cast<Sequential*>(&m)) refuse(prefix, m, "a residual branch must be a Sequential");
  const Children c{prefix, m.children()};
  int cur = in;
  for (size_t i = 0; i < c.list.size();) {
    Module& layer = *c.list[i].second;
    const std::string path = c.path(i);
    auto* pool = dynamic_cast<Pool2d*>(&layer);
    auto* res = dynamic_cast<Residual*>(&layer);
    if ((dynamic_cast<Conv2d*>(&layer) && !flat_) || (dynamic_cast<Linear*>(&layer) && flat_) ||
        (dynamic_cast<GlobalAvgPool*>(&layer) && !flat_)) {
      i += weighted(c, i, cur, busy);
      continue;
    }
    if (pool && pool->pool_kind() == PoolKind::Max && pool->pad() == 0 && !flat_) {
      max_pool(*pool, path, cur, busy);
    } else if (dynamic_cast<Flatten*>(&layer)) {
      flat_ = true;  // the same bytes, read whole by the next Linear
    } else if (dynamic_cast<Dropout*>(&layer)) {
      // identity in evaluation
    } else if (res && !flat_) {
      cur = residual(*res, path, cur, busy);
      i += fuse_relu(c, i + 1);
    } else if (dynamic_cast<Sequential*>(&layer)) {
      cur = sequence(layer, path, cur, busy);
    } else {
      refuse(path, layer);
    }
    ++i;
  }
  return cur;
}

size_t Translator::weighted(const Children& c, size_t i, int& cur, const std::vector<int>& busy) {
  Module& m = *c.at(i);
  auto* conv = dynamic_cast<Conv2d*>(&m);
  const bool averaged = dynamic_cast<GlobalAvgPool*>(&m) != nullptr;
  auto* lin = dynamic_cast<Linear*>(averaged ? c.at(i + 1) : &m);
  if (averaged && !lin) refuse(c.path(i), m, "a global average pool is supported right before a Linear");
  const int64_t reads = averaged ? image_[0] : shape_numel(image_);
  if ((lin && lin->weight().value.size(1) != reads) || (conv && conv->in_channels() != image_[0]))
    refuse(c.path(i), m, "its input is not the layer before's");
  FloatConv f = conv ? from_conv(*conv, image_) : from_linear(*lin, image_, averaged);
  size_t used = averaged ? 2 : 1;
  if (auto* bn = dynamic_cast<BatchNorm2d*>(c.at(i + used)); bn && conv) {
    fold_batchnorm(*bn, f);
    ++used;
  }
  Int8Layer l = quantized(f);
  l.name = averaged ? describe(c.path(i + 1), *lin) : describe(c.path(i), m);
  l.out_range = range(c.path(i + used - 1));
  image_ = {f.g.k, f.g.out_h(), f.g.out_w()};
  flat_ = !conv;
  cur = push(std::move(l), cur, busy);
  return used + (fuse_relu(c, i + used) ? 1 : 0);
}

void Translator::max_pool(const Pool2d& p, const std::string& path, int& cur, const std::vector<int>& busy) {
  Int8Layer l;
  l.kind = Int8Layer::Kind::MaxPool;
  l.name = describe(path, p);
  l.pool_c = image_[0], l.pool_h = image_[1], l.pool_w = image_[2];
  l.pool_kernel = p.kernel(), l.pool_stride = p.stride();
  image_ = {image_[0], (image_[1] - l.pool_kernel) / l.pool_stride + 1,
            (image_[2] - l.pool_kernel) / l.pool_stride + 1};
  cur = push(std::move(l), cur, busy);
}

// The shortcut (into a fresh buffer, or x itself) first, then the body, whose last convolution
// adds the shortcut in place: its output buffer is the shortcut's.
int Translator::residual(Residual& r, const std::string& path, int x, std::vector<int> busy) {
  if (std::find(busy.begin(), busy.end(), x) != busy.end())
    refuse(path, r, "its input is still needed by an enclosing block");
  if (r.after() || r.names().flat_body)
    refuse(path, r, "int8 takes residual blocks written as dtrain's own (body and shortcut named so, the ReLU after "
                    "the block)");
  const Shape in_image = image_;
  busy.push_back(x);
  const int s = r.shortcut() ? sequence(*r.shortcut(), join(path, "shortcut"), x, busy) : x;
  const Shape short_image = image_;
  image_ = in_image;
  busy.push_back(s);
  const size_t first = spec_.layers.size();
  sequence(r.body(), join(path, "body"), x, busy);
  Int8Layer& last = spec_.layers.back();
  if (spec_.layers.size() == first || last.kind != Int8Layer::Kind::Conv || last.relu || image_ != short_image)
    refuse(path, r, "its body must end in a Conv2d (and BatchNorm2d) giving the shortcut's shape");
  last.dst = s;
  last.residual = true;
  last.out_range = range(path);
  return s;
}

float act_scale(float range, QType t) {
  const float qmax = t == QType::U8 ? 255.f : 127.f;
  return range > 0.f ? range / qmax : 1.f;
}

}  // namespace

Int8Ranges calibrate_ranges(Sequential& model, const std::vector<Tensor>& batches) {
  DT_INPUT_CHECK(!batches.empty(), "int8 calibration needs at least one batch");
  const bool was_training = model.training();
  model.eval();
  Int8Ranges r;
  for (const Tensor& b : batches) {
    note(r, "input", b);
    observe(model, "", b, r);
  }
  model.train(was_training);
  return r;
}

Int8Spec quantize_model(Sequential& model, const Shape& input, const Int8Ranges& ranges) {
  auto in = ranges.find("input");
  DT_INPUT_CHECK(in != ranges.end(), "int8: the calibrated ranges have no input range");
  Int8Spec spec;
  spec.input = input;
  spec.input_range = in->second;
  Translator(ranges, spec, input).sequence(model, "", 0, {});
  DT_INPUT_CHECK(!spec.layers.empty() && spec.layers.back().kind == Int8Layer::Kind::Conv && !spec.layers.back().relu &&
                     !spec.layers.back().residual,
                 "int8: the model must end with a Conv2d or Linear giving the logits (no ReLU or pooling after it)");
  spec.layers.back().out_range = 0.f;  // f32 logits
  return spec;
}

namespace {

// What an activation buffer holds at a point of the int8 forward.
struct Held {
  QType type;
  float scale;
  int64_t elems;  // per sample
};

// Checks that step `i` reads a written buffer of the size it expects: a damaged int8 checkpoint
// gives an InputError here instead of a read out of bounds.
const Held& input_of(const Int8Layer& l, size_t i, const std::vector<std::optional<Held>>& held, int64_t elems) {
  DT_INPUT_CHECK(l.src >= 0 && l.src < kMaxBuffers && l.dst >= 0 && l.dst < kMaxBuffers && l.src != l.dst,
                 "int8: step " << i << " (" << l.name << ") names buffers " << l.src << " -> " << l.dst);
  DT_INPUT_CHECK(held[l.src] && held[l.src]->elems == elems,
                 "int8: step " << i << " (" << l.name << ") reads " << elems << " values per sample from buffer "
                               << l.src << ", which holds " << (held[l.src] ? held[l.src]->elems : 0));
  return *held[l.src];
}

}  // namespace

Int8Model::Int8Model(const Int8Spec& spec) : input_(spec.input) {
  DT_INPUT_CHECK(!spec.layers.empty(), "int8: a model without layers");
  std::vector<std::optional<Held>> held(kMaxBuffers);
  const float in_scale = act_scale(spec.input_range, input_type_);
  input_inv_scale_ = 1.f / in_scale;
  most_ = shape_numel(input_);
  held[0] = Held{input_type_, in_scale, most_};
  int buffers = 1;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const Int8Layer& l = spec.layers[i];
    const bool last = i + 1 == spec.layers.size();
    Step s{nullptr, nullptr, l.src, l.dst};
    Held out{};
    if (l.kind == Int8Layer::Kind::MaxPool) {
      DT_INPUT_CHECK(!last, "int8: the last step must be a convolution giving the logits");
      const Held& in = input_of(l, i, held, l.pool_c * l.pool_h * l.pool_w);
      s.pool = std::make_unique<int8::Int8MaxPool>(l.pool_c, l.pool_h, l.pool_w, l.pool_kernel, l.pool_stride, in.type);
      out = {in.type, in.scale, l.pool_c * s.pool->out_h() * s.pool->out_w()};
    } else {
      const Held& in = input_of(l, i, held, l.conv.c * l.conv.h * l.conv.w);
      out.type = last ? QType::F32 : l.relu ? QType::U8 : QType::S8;
      out.scale = last ? 1.f : act_scale(l.out_range, out.type);
      out.elems = l.conv.k * l.conv.out_h() * l.conv.out_w();
      int8::Int8Add add;
      if (l.residual) {
        DT_INPUT_CHECK(!last && held[l.dst] && held[l.dst]->elems == out.elems,
                       "int8: step " << i << " (" << l.name << ") adds buffer " << l.dst
                                     << ", which holds no shortcut of its output's size");
        add = {held[l.dst]->type, held[l.dst]->scale / out.scale};
      }
      std::vector<float> out_scales(l.weight_scales.size()), bias_acc(l.weight_scales.size());
      for (size_t k = 0; k < out_scales.size(); ++k) {
        out_scales[k] = in.scale * l.weight_scales[k] / out.scale;
        bias_acc[k] = l.bias[k] / (in.scale * l.weight_scales[k]);
      }
      s.conv = std::make_unique<int8::Int8Conv2d>(l.conv, in.type, out.type, l.relu, l.weights, std::move(bias_acc),
                                                  std::move(out_scales), add);
      if (last) classes_ = out.elems;
    }
    held[l.dst] = out;
    most_ = std::max(most_, out.elems);
    buffers = std::max(buffers, std::max(l.src, l.dst) + 1);
    steps_.push_back(std::move(s));
  }
  bufs_.resize(static_cast<size_t>(buffers));
}

Tensor Int8Model::forward(const Tensor& x) {
  DT_INPUT_CHECK(
      x.dim() == static_cast<int64_t>(input_.size()) + 1 && Shape(x.shape().begin() + 1, x.shape().end()) == input_,
      "int8 model: input " << x.str() << " is not a batch of " << shape_str(input_));
  const int64_t n = x.size(0);
  const Shape image = input_.size() == 3 ? input_ : Shape{shape_numel(input_), 1, 1};
  for (auto& b : bufs_) b.resize(static_cast<size_t>(n * most_));
  Tensor host = x.device().is_cpu() ? x : to_host(x);
  int8::quantize_nchw_to_nhwc(host.f32(), n, image[0], image[1], image[2], input_inv_scale_, input_type_,
                              bufs_[0].data());
  Tensor logits = Tensor::empty({n, classes_});
  for (size_t i = 0; i < steps_.size(); ++i) {
    Step& s = steps_[i];
    void* dst = i + 1 == steps_.size() ? logits.raw() : static_cast<void*>(bufs_[s.dst].data());
    if (s.conv)
      s.conv->forward(n, bufs_[s.src].data(), dst);
    else
      s.pool->forward(n, bufs_[s.src].data(), dst);
  }
  return logits;
}

WeightOnlyReport quantize_linear_weights_int8(Module& model) {
  WeightOnlyReport r;
  if (auto* linear = dynamic_cast<Linear*>(&model)) {
    const auto [before, after] = linear->quantize_weights_int8();
    return {1, before, after};
  }
  for (auto& [name, child] : model.children()) {
    const WeightOnlyReport c = quantize_linear_weights_int8(*child);
    r.layers += c.layers;
    r.f32_bytes += c.f32_bytes;
    r.int8_bytes += c.int8_bytes;
  }
  return r;
}

}  // namespace dtrain::nn

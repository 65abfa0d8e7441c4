// Post-training int8 quantization (include/dtrain/nn/quantized.h): calibration, the translation of
// a Sequential into int8 steps, and their forward.
#include "dtrain/nn/quantized.h"

#include <algorithm>
#include <cmath>

namespace dtrain::nn {

using int8::QType;

static float max_abs(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : to_host(t);
  const float* p = h.f32();
  float m = 0.f;
  for (int64_t i = 0; i < h.numel(); ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

std::vector<float> calibrate_ranges(Sequential& model, const std::vector<Tensor>& batches) {
  DT_INPUT_CHECK(!batches.empty(), "int8 calibration needs at least one batch");
  const bool was_training = model.training();
  model.eval();
  std::vector<float> r(model.size() + 1, 0.f);
  for (const Tensor& b : batches) {
    Tensor x = b;
    r[0] = std::max(r[0], max_abs(x));
    for (size_t i = 0; i < model.size(); ++i) {
      x = model[i].forward(x);
      r[i + 1] = std::max(r[i + 1], max_abs(x));
    }
  }
  model.train(was_training);
  return r;
}

// Per output channel k: scale[k] = max |w[k, :]| / 127, q = round(w / scale) in [-127, 127].
static void quantize_weights(const Tensor& w, Int8Layer& l) {
  Tensor h = w.device().is_cpu() ? w : to_host(w);
  const int64_t k = h.size(0), per = h.numel() / k;
  const float* p = h.f32();
  l.weights.resize(static_cast<size_t>(h.numel()));
  l.weight_scales.resize(static_cast<size_t>(k));
  for (int64_t o = 0; o < k; ++o) {
    float m = 0.f;
    for (int64_t i = 0; i < per; ++i) m = std::max(m, std::fabs(p[o * per + i]));
    const float s = m > 0.f ? m / 127.f : 1.f;
    l.weight_scales[o] = s;
    for (int64_t i = 0; i < per; ++i)
      l.weights[o * per + i] = static_cast<int8_t>(std::clamp(std::nearbyint(p[o * per + i] / s), -127.f, 127.f));
  }
}

static std::vector<float> bias_values(Parameter* b, int64_t k) {
  if (!b) return std::vector<float>(static_cast<size_t>(k), 0.f);
  Tensor h = b->value.device().is_cpu() ? b->value : to_host(b->value);
  return std::vector<float>(h.f32(), h.f32() + k);
}

// `image` is the (C, H, W) the layer reads, channels-last in the int8 buffers; it becomes the output's.
static Int8Layer conv_step(Conv2d& c, Shape& image) {
  Int8Layer l;
  l.conv = {image[0], image[1], image[2], c.out_channels(), c.kernel(), c.kernel(), c.stride(), c.pad()};
  quantize_weights(c.weight().value, l);
  l.bias = bias_values(c.bias(), c.out_channels());
  image = {l.conv.k, l.conv.out_h(), l.conv.out_w()};
  return l;
}

static Int8Layer linear_step(Linear& f, Shape& image) {
  const Tensor& w = f.weight().value;  // (K, C*H*W): over the NCHW flattening, a (K, C, H, W) kernel
  Int8Layer l;
  l.conv = {image[0], image[1], image[2], w.size(0), image[1], image[2], 1, 0};
  quantize_weights(w, l);
  l.bias = bias_values(f.bias(), w.size(0));
  image = {w.size(0), 1, 1};
  return l;
}

static Int8Layer pool_step(Pool2d& p, Shape& image) {
  Int8Layer l;
  l.kind = Int8Layer::Kind::MaxPool;
  l.pool_c = image[0], l.pool_h = image[1], l.pool_w = image[2];
  l.pool_kernel = p.kernel(), l.pool_stride = p.stride();
  image = {image[0], (image[1] - p.kernel()) / p.stride() + 1, (image[2] - p.kernel()) / p.stride() + 1};
  return l;
}

Int8Spec quantize_model(Sequential& model, const Shape& input, const std::vector<float>& ranges) {
  DT_INPUT_CHECK(ranges.size() == model.size() + 1, "int8: " << ranges.size() << " calibrated ranges for a model of "
                                                             << model.size() << " layers");
  Shape batched{1};
  batched.insert(batched.end(), input.begin(), input.end());
  const std::vector<Shape> shapes = layer_boundary_shapes(model, batched);
  Int8Spec spec;
  spec.input = input;
  spec.input_range = ranges[0];
  Shape image = input.size() == 3 ? input : Shape{shape_numel(input), 1, 1};
  bool after_conv = false;  // the previous layer was a Conv2d/Linear (a ReLU here fuses into it)
  for (size_t i = 0; i < model.size(); ++i) {
    Module& m = model[i];
    const std::string name = "layer " + std::to_string(i) + " (" + m.kind() + ")";
    const size_t rank = shapes[i].size() - 1;  // dimensions per sample at this layer's input
    auto* conv = dynamic_cast<Conv2d*>(&m);
    auto* lin = dynamic_cast<Linear*>(&m);
    auto* pool = dynamic_cast<Pool2d*>(&m);
    auto* act = dynamic_cast<Activation*>(&m);
    Int8Layer l;
    if (conv && rank == 3) {
      l = conv_step(*conv, image);
    } else if (lin && rank == 1) {
      l = linear_step(*lin, image);
    } else if (pool && pool->pool_kind() == PoolKind::Max && pool->pad() == 0 && rank == 3) {
      l = pool_step(*pool, image);
    } else if (dynamic_cast<Flatten*>(&m) || dynamic_cast<Dropout*>(&m)) {
      continue;  // Flatten: the same bytes; Dropout: identity in evaluation
    } else if (act && act->op() == Unary::Relu && after_conv) {
      spec.layers.back().relu = true;
      spec.layers.back().out_range = ranges[i + 1];
      after_conv = false;
      continue;
    } else {
      throw InputError("int8: " + name +
                       " is not supported (int8 runs Conv2d, Linear over a flat input, a ReLU right after either, "
                       "MaxPool2d without padding, Flatten and Dropout)");
    }
    l.name = name;
    after_conv = l.kind == Int8Layer::Kind::Conv;
    if (after_conv) l.out_range = ranges[i + 1];
    spec.layers.push_back(std::move(l));
  }
  DT_INPUT_CHECK(!spec.layers.empty() && spec.layers.back().kind == Int8Layer::Kind::Conv && !spec.layers.back().relu,
                 "int8: the model must end with a Conv2d or Linear giving the logits (no ReLU or pooling after it)");
  spec.layers.back().out_range = 0.f;  // f32 logits
  return spec;
}

static float act_scale(float range, QType t) {
  const float qmax = t == QType::U8 ? 255.f : 127.f;
  return range > 0.f ? range / qmax : 1.f;
}

Int8Model::Int8Model(const Int8Spec& spec) : input_(spec.input) {
  DT_INPUT_CHECK(!spec.layers.empty(), "int8: a model without layers");
  float x_scale = act_scale(spec.input_range, input_type_);
  input_inv_scale_ = 1.f / x_scale;
  QType cur = input_type_;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const Int8Layer& l = spec.layers[i];
    Step s;
    if (l.kind == Int8Layer::Kind::MaxPool) {
      s.pool = std::make_unique<int8::Int8MaxPool>(l.pool_c, l.pool_h, l.pool_w, l.pool_kernel, l.pool_stride, cur);
      s.out_per_sample = l.pool_c * s.pool->out_h() * s.pool->out_w();
    } else {
      const bool last = i + 1 == spec.layers.size();
      const QType out = last ? QType::F32 : l.relu ? QType::U8 : QType::S8;
      const float y_scale = last ? 1.f : act_scale(l.out_range, out);
      std::vector<float> out_scales(l.weight_scales.size()), bias_acc(l.weight_scales.size());
      for (size_t k = 0; k < out_scales.size(); ++k) {
        out_scales[k] = x_scale * l.weight_scales[k] / y_scale;
        bias_acc[k] = l.bias[k] / (x_scale * l.weight_scales[k]);
      }
      s.conv = std::make_unique<int8::Int8Conv2d>(l.conv, cur, out, l.relu, l.weights, std::move(bias_acc),
                                                   std::move(out_scales));
      s.out_per_sample = l.conv.k * l.conv.out_h() * l.conv.out_w();
      cur = out;
      x_scale = y_scale;
      if (last) classes_ = s.out_per_sample;
    }
    steps_.push_back(std::move(s));
  }
}

Tensor Int8Model::forward(const Tensor& x) {
  DT_INPUT_CHECK(x.dim() == static_cast<int64_t>(input_.size()) + 1 &&
                     Shape(x.shape().begin() + 1, x.shape().end()) == input_,
                 "int8 model: input " << x.str() << " is not a batch of " << shape_str(input_));
  const int64_t n = x.size(0);
  const Shape image = input_.size() == 3 ? input_ : Shape{shape_numel(input_), 1, 1};
  int64_t most = shape_numel(image);
  for (const Step& s : steps_) most = std::max(most, s.out_per_sample);
  a_.resize(static_cast<size_t>(n * most));
  b_.resize(static_cast<size_t>(n * most));
  Tensor host = x.device().is_cpu() ? x : to_host(x);
  int8::quantize_nchw_to_nhwc(host.f32(), n, image[0], image[1], image[2], input_inv_scale_, input_type_, a_.data());
  Tensor logits = Tensor::empty({n, classes_});
  for (size_t i = 0; i < steps_.size(); ++i) {
    void* dst = i + 1 == steps_.size() ? logits.raw() : static_cast<void*>(b_.data());
    if (steps_[i].conv)
      steps_[i].conv->forward(n, a_.data(), dst);
    else
      steps_[i].pool->forward(n, a_.data(), dst);
    std::swap(a_, b_);
  }
  return logits;
}

}  // namespace dtrain::nn

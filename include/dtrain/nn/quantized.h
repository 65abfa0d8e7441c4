#pragma once
// Post-training int8 quantization of an image classifier for CPU inference (oneDNN int8 kernels,
// include/dtrain/kernels/int8.h); at the end, weight-only int8 for any model's Linear layers (the GPT).
//
// What is quantized: Conv2d and Linear become s8-weight convolutions (7-bit weights, one symmetric
// scale per output channel, see int8.h), each with the BatchNorm2d right after a Conv2d folded into
// its weights and bias (evaluation mode's affine map) and the ReLU that follows fused (its output
// then u8); MaxPool2d runs on the int8 values; a GlobalAvgPool followed by a Linear becomes one
// convolution whose kernel covers the whole image with the Linear's weights / (H W) at every
// position (exact, no rounding of the average); a Residual block's shortcut (identity, or a Conv2d
// + BatchNorm2d) is added by the body's last convolution before the ReLU after the block (int8.h's
// addend); Flatten and Dropout (identity in evaluation) vanish; the last Conv2d/Linear writes f32
// logits. Activations are quantized symmetrically with the scale max|x| / 127 (s8) or / 255 (u8,
// after a ReLU), max|x| measured at every module's output over the calibration batches (a maximum,
// so the same batches give bitwise the same ranges in any order or thread count). Any other layer
// (a BatchNorm2d not after a Conv2d, GELU, LayerNorm, average pooling, ...) is refused with an
// InputError naming it.
#include <map>
#include <string>
#include <vector>

#include "dtrain/kernels/int8.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

// One step of the int8 forward: a convolution (a Linear is the one whose kernel covers its whole
// input, see int8.h) or a max pool, reading activation buffer `src` and writing buffer `dst`.
// Buffer 0 holds the quantized input; the last step writes the logits instead of a buffer.
struct Int8Layer {
  enum class Kind : uint8_t { Conv, MaxPool };
  Kind kind = Kind::Conv;
  std::string name;  // the fp32 model's layer ("layer 4.0.body.0 (Conv2d(16, 16, k=3, s=1, p=1))"), for messages
  int src = 0, dst = 1;
  // Conv: geometry, weights (K, C, R, S) s8 with their scales (K), bias (K, model units, f32),
  // whether a ReLU is fused; output u8 after a ReLU, f32 for the last layer, s8 otherwise.
  int8::ConvShape conv{};
  bool relu = false;
  bool residual = false;  // adds what `dst` holds (a block's shortcut) before the ReLU
  std::vector<int8_t> weights;
  std::vector<float> weight_scales, bias;
  // MaxPool: kernel and stride over a (c, h, w) input.
  int64_t pool_c = 0, pool_h = 0, pool_w = 0, pool_kernel = 0, pool_stride = 0;
  // max |y| calibrated at the step's output (a conv's); 0 for the f32 logits and for a pool,
  // which keeps its input's scale.
  float out_range = 0.f;
};

struct Int8Spec {
  Shape input;              // per sample, (C, H, W) or (F)
  float input_range = 0.f;  // max |x| of the (normalised) input
  std::vector<Int8Layer> layers;
};

// max |y| at the output of every module of a model, by its path ("3", "4.0.body.1", as parameter
// names spell it), and max |x| of the input under "input".
using Int8Ranges = std::map<std::string, float>;

// The ranges of `model` over `batches`, in evaluation mode (no state changes).
Int8Ranges calibrate_ranges(Sequential& model, const std::vector<Tensor>& batches);

// The int8 form of `model` (inputs of shape `input`, per sample) with the ranges of
// calibrate_ranges. Throws InputError naming the first layer int8 cannot run.
Int8Spec quantize_model(Sequential& model, const Shape& input, const Int8Ranges& ranges);

// Runs an Int8Spec. Not thread-safe (buffers and primitives are reused between calls).
class Int8Model {
 public:
  // Throws InputError when the steps do not chain (a step reading a buffer no step wrote, shapes
  // that do not meet): what a damaged int8 checkpoint gives.
  explicit Int8Model(const Int8Spec& spec);
  // x (N, ...input) f32 -> logits (N, classes) f32.
  Tensor forward(const Tensor& x);
  int64_t classes() const { return classes_; }

 private:
  Shape input_;
  float input_inv_scale_;
  struct Step {
    std::unique_ptr<int8::Int8Conv2d> conv;
    std::unique_ptr<int8::Int8MaxPool> pool;
    int src, dst;
  };
  std::vector<Step> steps_;
  int8::QType input_type_ = int8::QType::S8;
  int64_t classes_ = 0;
  int64_t most_ = 0;                        // elements per sample of the largest activation
  std::vector<std::vector<uint8_t>> bufs_;  // activation buffers, by Int8Layer::src / dst
};

// Weight-only int8 of every Linear layer in `model` (the GPT's attention and MLP projections; the
// tied embedding and unembedding stay f32): for `dtrain generate --int8` and `dtrain eval --int8`
// of a GPT. Returns the weight bytes of those layers before and after.
struct WeightOnlyReport {
  int64_t layers = 0, f32_bytes = 0, int8_bytes = 0;
};
WeightOnlyReport quantize_linear_weights_int8(nn::Module& model);

}  // namespace dtrain::nn

#pragma once
// Int8 inference primitives on the CPU, through oneDNN's int8 convolution and pooling.
//
// Activations are channels-last (N, H, W, C), quantized symmetrically with zero point 0: a value v
// is held as q = round(v / scale) (round to nearest even, saturated), u8 after a ReLU, s8 otherwise.
// Weights are s8 in 7 bits, [-63, 63], with one scale per output channel: oneDNN's kernels on
// processors without VNNI (AVX2; AVX-512 before Cascade Lake) multiply u8 by s8 in pairs summed into
// 16 bits (vpmaddubsw), which 2 x 255 x 127 overflows and 2 x 255 x 63 does not, and the same
// weights give the same results on every processor (an int8 checkpoint runs anywhere). A Linear
// layer is the convolution whose kernel covers its whole input: (K, C*H*W) weights over a flattened
// NCHW image are (K, C, H, W) weights with no padding, so one primitive serves both and the flatten
// needs no permutation.
//
// The arithmetic of Int8Conv2d, which tests reproduce exactly:
//   acc[n,p,q,k] = sum over c, r, s of x_q * w_q                       (int32)
//   v            = out_scale[k] * (acc + bias_acc[k])                  (f32; bias in accumulator units)
//   y            = saturate(round_even(relu ? max(v, 0) : v))          (u8 / s8), or v itself (f32)
// For a u8/s8 output out_scale[k] = x_scale * w_scale[k] / y_scale; for an f32 output (logits)
// out_scale[k] = x_scale * w_scale[k]. bias_acc[k] = bias[k] / (x_scale * w_scale[k]).
// A convolution that ends a residual block adds what its output buffer holds on entry (the
// shortcut, a_q of type add.type) before the ReLU, in place (oneDNN's sum post-op):
//   v            = out_scale[k] * (acc + bias_acc[k]) + add.scale * a_q    (add.scale = a_scale / y_scale)
#include <cstdint>
#include <memory>
#include <vector>

namespace dtrain::int8 {

enum class QType : uint8_t { U8, S8, F32 };
constexpr int kWeightMax = 63;  // weights in [-kWeightMax, kWeightMax]
const char* qtype_name(QType t);
size_t qtype_size(QType t);

struct ConvShape {
  int64_t c, h, w;                // input channels and image
  int64_t k, r, s, stride, pad;   // output channels, kernel, stride, padding (both sides)
  int64_t out_h() const { return (h + 2 * pad - r) / stride + 1; }
  int64_t out_w() const { return (w + 2 * pad - s) / stride + 1; }
};

// The addend of a residual convolution: its type (u8 or s8, held in the output buffer) and scale.
struct Int8Add {
  QType type = QType::F32;  // F32: no addend
  float scale = 0.f;
};

class Int8Conv2d {
 public:
  // weights (K, C, R, S) s8 in [-63, 63]; bias_acc and out_scales (K). Primitives are built per batch size on
  // first use and kept (the last, short batch of an epoch gets its own).
  Int8Conv2d(const ConvShape& g, QType in, QType out, bool relu, std::vector<int8_t> weights,
             std::vector<float> bias_acc, std::vector<float> out_scales, Int8Add add = {});
  ~Int8Conv2d();
  Int8Conv2d(Int8Conv2d&&) noexcept;
  // x (N, H, W, C) of type `in`; y (N, P, Q, K) of type `out` (with an addend: holding it on entry).
  void forward(int64_t n, const void* x, void* y);
  const ConvShape& shape() const { return g_; }
  QType out_type() const { return out_; }

 private:
  struct Impl;
  ConvShape g_;
  QType out_;
  std::unique_ptr<Impl> impl_;
};

// Max pooling of u8 or s8 channels-last images (no padding): exact, the scale passes through.
class Int8MaxPool {
 public:
  Int8MaxPool(int64_t c, int64_t h, int64_t w, int64_t kernel, int64_t stride, QType type);
  ~Int8MaxPool();
  Int8MaxPool(Int8MaxPool&&) noexcept;
  void forward(int64_t n, const void* x, void* y);  // (N, H, W, C) -> (N, P, Q, C)
  int64_t out_h() const { return (h_ - kernel_) / stride_ + 1; }
  int64_t out_w() const { return (w_ - kernel_) / stride_ + 1; }

 private:
  struct Impl;
  int64_t c_, h_, w_, kernel_, stride_;
  QType type_;
  std::unique_ptr<Impl> impl_;
};

// Symmetric per-row quantization of w (rows, cols): scales[r] = max |w[r, :]| / qmax (1 for a zero
// row), q[r, c] = round_even(w[r, c] / scales[r]) in [-qmax, qmax].
void quantize_rows_symmetric(const float* w, int64_t rows, int64_t cols, int qmax, int8_t* q, float* scales);

// Weight-only int8 (activations stay f32): a (N, K) weight matrix held as s8 in 8 bits, [-127, 127],
// one scale per row; a quarter of the f32 bytes.
struct WeightOnlyInt8 {
  int64_t rows = 0, cols = 0;
  std::vector<int8_t> q;     // (rows, cols)
  std::vector<float> scale;  // (rows)
  static WeightOnlyInt8 from(const float* w, int64_t rows, int64_t cols);
};

// y (M, N) = x (M, K) . dequant(w)^T, w (N, K), by oneDNN's f32 GEMM on dequantized rows. Few rows
// of x (M < 64: generation, bound by reading the weights): rows of w a cache-sized panel at a time,
// one GEMM per panel, so the weights cross memory as int8. Many rows (bound by arithmetic): all of w
// at once and one GEMM. The dequantized rows go to one scratch buffer per thread, shared by every
// layer (at most one layer's f32 weights). Threads: oneDNN's.
void gemm_weight_only_int8(const float* x, int64_t m, const WeightOnlyInt8& w, float* y);

// x (N, C, H, W) f32 -> y (N, H, W, C) of `type` (U8 or S8): y = saturate(round_even(x * inv_scale)).
void quantize_nchw_to_nhwc(const float* x, int64_t n, int64_t c, int64_t h, int64_t w, float inv_scale, QType type,
                           void* y);

}  // namespace dtrain::int8

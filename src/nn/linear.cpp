#include <cmath>

#include "dtrain/kernels/int8.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

// PyTorch's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias, so the two
// frameworks start from the same distribution and their accuracies can be compared.
std::pair<Tensor, Tensor> Linear::init(int64_t in, int64_t out, bool bias, Rng& rng) {
  DT_CHECK(in > 0 && out > 0, "Linear(" << in << ", " << out << ")");
  const float bound = 1.f / std::sqrt(static_cast<float>(in));
  auto uniform = [&](const Shape& s) {
    Tensor t = Tensor::empty(s);
    float* p = t.f32();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = rng.uniform(-bound, bound);
    return t;
  };
  Tensor w = uniform({out, in});
  Tensor b = bias ? uniform({out}) : Tensor();
  return {w, b};
}

Linear::Linear(int64_t in, int64_t out, bool bias, Rng& rng) : in_(in), out_(out) {
  auto [w, b] = init(in, out, bias, rng);
  set_parameters(w, b);
}

void Linear::set_parameters(const Tensor& full_weight, const Tensor& full_bias) {
  Placement rows = output_rows(full_weight.shape());
  w_ = &add_part("weight", full_weight, rows.split() ? std::move(rows) : input_columns(full_weight.shape()));
  DT_CHECK(w_->value.dim() == 2 && w_->value.size(0) == out_ && w_->value.size(1) == in_,
           kind() << " given weight " << w_->value.str());
  w_->gemm_weight = true;
  if (full_bias.defined()) {
    b_ = &add_part("bias", full_bias, output_rows(full_bias.shape()));
    DT_CHECK(b_->value.numel() == out_, kind() << " given bias " << b_->value.str());
  }
}

Parameter& Linear::add_part(const std::string& name, const Tensor& full, Placement placement) {
  Parameter& p = add_parameter(name, own_part(placement, full));
  p.placement = std::move(placement);
  return p;
}

// y (M, out) = x (M, in) . W^T (in, out)
Tensor& Linear::project(const Tensor& x) {
  DT_CHECK(x.dim() >= 1 && x.size(-1) == in_, kind()
                                                  << " got input " << x.str() << " (last dim must be " << in_ << ")");
  Engine& e = engine(x);
  if (copy_input_) {
    const MathPrecision mp = e.math_precision();
    const bool low = (mp == MathPrecision::BF16 || mp == MathPrecision::F16) && x.dtype() == DType::F32;
    const DType held = !low ? x.dtype() : mp == MathPrecision::F16 ? DType::F16 : DType::BF16;
    Tensor& c = ensure(x_copy_, x.shape(), x.device(), held);
    if (low)
      e.cast(x, c);
    else
      e.copy(x, c);
    x_ = Tensor();
  } else {
    keep(x_, x);
  }
  const int64_t m = x.numel() / in_;
  Shape ys = x.shape();
  ys.back() = out_;
  Tensor& y = ensure_output(y_, ys, x.device());
  if (w8_) {
    DT_CHECK(x.device().is_cpu() && x.dtype() == DType::F32,
             kind() << " with int8 weights takes f32 on the CPU, got " << x.str());
    int8::gemm_weight_only_int8(x.f32(), m, *w8_, y.f32());
    return y;
  }
  e.gemm(false, true, m, out_, in_, 1.f, reads_copy(e, m, out_) ? x_copy_ : x, gemm_operand(e, *w_, m, out_), 0.f, y);
  return y;
}

// Whether an m x n GEMM may read the low-precision input copy in place of the input: the engine
// would round the input to that precision for it anyway (the same products, one rounding less).
bool Linear::reads_copy(const Engine& e, int64_t m, int64_t n) const {
  if (!copy_input_ || !x_copy_.defined() || !e.rounds_gemm(m, n)) return false;
  return x_copy_.dtype() == (e.math_precision() == MathPrecision::F16 ? DType::F16 : DType::BF16);
}

void Linear::add_bias(Tensor& y) {
  if (b_) engine(y).add_row_bias(y, b_->value);
}

std::pair<int64_t, int64_t> Linear::quantize_weights_int8() {
  DT_CHECK(!w8_, kind() << ": weights are int8 already");
  DT_INPUT_CHECK(w_->value.device().is_cpu() && w_->value.dtype() == DType::F32,
                 "int8 weights: " << kind() << " holds " << w_->value.str() << " (f32 on the CPU needed)");
  w8_ = std::make_shared<int8::WeightOnlyInt8>(int8::WeightOnlyInt8::from(w_->value.f32(), out_, in_));
  const int64_t before = w_->value.nbytes();
  w_->value = Tensor();
  x_ = Tensor();
  return {before, static_cast<int64_t>(w8_->q.size() + 4 * w8_->scale.size())};
}

Tensor Linear::forward(const Tensor& x) {
  Tensor& y = project(x);
  add_bias(y);
  if (lora_a_) lora_forward(x, y);
  return y;
}

void Linear::add_lora(const std::vector<std::pair<int64_t, int64_t>>& blocks, int64_t rank, float alpha, Rng& rng) {
  DT_INPUT_CHECK(!lora_a_ && !w8_ && rank > 0 && !blocks.empty(), kind() << ": LoRA of rank " << rank);
  const int64_t nr = static_cast<int64_t>(blocks.size()) * rank, out = full_out();
  Tensor mask = Tensor::zeros({out, nr});  // the full layer's, then this slice's rows
  for (size_t k = 0; k < blocks.size(); ++k) {
    const auto [first, rows] = blocks[k];
    DT_INPUT_CHECK(first >= 0 && rows > 0 && first + rows <= out, kind() << ": LoRA rows " << first << " + " << rows);
    for (int64_t r = first; r < first + rows; ++r)
      for (int64_t j = 0; j < rank; ++j) mask.f32()[r * nr + static_cast<int64_t>(k) * rank + j] = 1.f;
  }
  const Tensor a = Linear::init(full_in(), nr, false, rng).first;
  lora_a_ = &add_part("lora_A", a, input_columns(a.shape()));
  lora_mask_ = own_part(output_rows(mask.shape()), mask);
  lora_b_ = &add_part("lora_B", Tensor::zeros(mask.shape()), output_rows(mask.shape()));
  lora_scale_ = alpha / static_cast<float>(rank);
}

// y += s (x A^T) B^T, t = x A^T kept for backward.
void Linear::lora_forward(const Tensor& x, Tensor& y) {
  Engine& e = engine(x);
  const int64_t m = x.numel() / in_, nr = lora_a_->value.size(0);
  ensure(lora_t_, {m, nr}, x.device());
  e.gemm(false, true, m, nr, in_, 1.f, x, lora_a_->value, 0.f, lora_t_);
  e.gemm(false, true, m, out_, nr, lora_scale_, lora_t_, lora_b_->value, 1.f, y);  // partial where y is
  sum_lora_activations(lora_t_);                                                   // whole for dB
}

// dB += s dy^T t (its trained blocks only), dt = s dy B, dx += dt A, dA += dt^T x.
void Linear::lora_backward(const Tensor& dy, const Tensor& x, Tensor* dx) {
  Engine& e = engine(dy);
  const int64_t m = dy.numel() / out_, nr = lora_a_->value.size(0);
  if (lora_mask_.device() != dy.device()) {
    Tensor on = Tensor::empty(lora_mask_.shape(), DType::F32, dy.device());
    copy_any(lora_mask_, on);
    lora_mask_ = on;
  }
  share_gradient(*lora_b_, false);
  e.gemm(true, false, out_, nr, m, lora_scale_, dy, lora_t_, 1.f, lora_b_->grad);
  e.mul(lora_b_->grad, lora_mask_, lora_b_->grad);
  share_gradient(*lora_b_, true);
  grad_ready(*lora_b_);
  ensure_temp(lora_dt_, {m, nr}, dy.device());
  e.gemm(false, false, m, nr, out_, lora_scale_, dy, lora_b_->value, 0.f, lora_dt_);
  if (dx) e.gemm(false, false, m, in_, nr, 1.f, lora_dt_, lora_a_->value, 1.f, *dx);  // partial where dx is
  sum_lora_gradients(lora_dt_);                                                       // whole for dA
  e.gemm(true, false, nr, in_, m, 1.f, lora_dt_, x, 1.f, lora_a_->grad);
  grad_ready(*lora_a_);
}

const Tensor& Linear::saved_input(Device dev) {
  if (!copy_input_) return x_;
  if (x_copy_.dtype() == DType::F32) return x_copy_;
  Tensor& w = ensure_temp(x_wide_, x_copy_.shape(), dev);
  engine(x_copy_).cast(x_copy_, w);  // exact: bf16 values widened
  return w;
}

// dW (out, in) += dy^T (out, M) . x (M, in); db += sum_rows dy; dx (M, in) = dy (M, out) . W (out, in)
Tensor Linear::backward(const Tensor& dy) {
  DT_CHECK(!w8_, kind() << ": no backward through int8 weights (inference only)");
  Engine& e = engine(dy);
  const int64_t m = (copy_input_ ? x_copy_ : x_).numel() / in_;
  DT_CHECK(dy.numel() == m * out_, kind() << " backward got " << dy.str());
  // dW reads the bf16/f16 input copy as it is where its GEMM rounds to that precision, else the
  // input (the copy widened to f32).
  const Tensor& x = reads_copy(e, out_, in_) ? x_copy_ : saved_input(dy.device());
  // Where both GEMMs round dy to bf16/f16, it is rounded once, into scratch (the same numbers).
  const Tensor* g = &dy;
  if (needs_input_grad_ && dy.dtype() == DType::F32 && e.rounds_gemm(out_, in_) && e.rounds_gemm(m, in_)) {
    const DType low = e.math_precision() == MathPrecision::F16 ? DType::F16 : DType::BF16;
    Tensor& r = ensure_temp(dy_low_, dy.shape(), dy.device(), low);
    e.cast(dy, r);
    g = &r;
  }
  if (!w_->frozen) {
    share_gradient(*w_, false);
    e.gemm(true, false, out_, in_, m, 1.f, *g, x, 1.f, w_->grad);  // a frozen weight's is zero
    share_gradient(*w_, true);
  }
  grad_ready(*w_);
  if (b_) {
    if (!b_->frozen) {
      share_gradient(*b_, false);
      e.row_bias_grad(dy, b_->grad);
      share_gradient(*b_, true);
    }
    grad_ready(*b_);
  }
  if (!needs_input_grad_) {
    if (lora_a_) lora_backward(dy, saved_input(dy.device()), nullptr);
    return Tensor();
  }
  Tensor& dx = ensure(dx_, x.shape(), dy.device());
  e.gemm(false, false, m, in_, out_, 1.f, *g, gemm_operand(e, *w_, m, in_), 0.f, dx);
  if (lora_a_) lora_backward(dy, saved_input(dy.device()), &dx);
  return dx;
}

}  // namespace dtrain::nn

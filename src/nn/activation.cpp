#include <cstring>

#include "dtrain/nn/layers.h"

namespace dtrain::nn {

Tensor Activation::forward(const Tensor& x) {
  keep(x_, x);
  Tensor& y = ensure_output(y_, x.shape(), x.device());
  engine(x).unary_forward(op_, x, y);
  return y;
}

Tensor Activation::backward(const Tensor& dy) {
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).unary_backward(op_, x_, dy, dx);
  return dx;
}

Tensor SwiGLU::forward(const Tensor& x) {
  DT_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, kind() << " needs [..., 2F], got " << x.str());
  keep(x_, x);
  Shape s = x.shape();
  s.back() /= 2;
  Tensor& y = ensure_output(y_, s, x.device());
  engine(x).swiglu_forward(x, y);
  return y;
}

Tensor SwiGLU::backward(const Tensor& dy) {
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).swiglu_backward(x_, dy, dx);
  return dx;
}

Dropout::Dropout(float p, uint64_t seed) : p_(p) {
  DT_INPUT_CHECK(p >= 0.f && p < 1.f, "dropout probability must be in [0, 1), got " << p);
  Tensor state = Tensor::empty({4}, DType::I64);
  auto words = Rng(seed).state();
  std::memcpy(state.raw(), words.data(), sizeof words);
  rng_state_ = &add_buffer("rng_state", state, /*host=*/true);
}

Tensor Dropout::forward(const Tensor& x) {
  if (!training_ || p_ == 0.f) {
    mask_ = Tensor();
    return x;
  }
  ensure(mask_, x.shape(), x.device());
  Tensor& y = ensure(y_, x.shape(), x.device());
  std::array<uint64_t, 4> words;
  std::memcpy(words.data(), rng_state_->value.raw(), sizeof words);
  Rng rng;
  rng.set_state(words);
  uint64_t seed = rng.next();
  words = rng.state();
  std::memcpy(rng_state_->value.raw(), words.data(), sizeof words);
  engine(x).dropout_forward(x, p_, seed, mask_, y);
  return y;
}

Tensor Dropout::backward(const Tensor& dy) {
  if (!mask_.defined()) return dy;
  Tensor& dx = ensure(dx_, dy.shape(), dy.device());
  engine(dy).mul(dy, mask_, dx);
  return dx;
}

// The input is kept (a reference: its producer holds it anyway) for its shape, as a slot, so a
// pipeline's micro-batches each reshape to their own.
Tensor Flatten::forward(const Tensor& x) {
  keep(x_, x);
  return x.reshape({x.size(0), -1});
}

Tensor Flatten::backward(const Tensor& dy) { return dy.reshape(x_.shape()); }

}  // namespace dtrain::nn

#include "dtrain/nn/layers.h"

namespace dtrain::nn {

Tensor Activation::forward(const Tensor& x) {
  x_ = x;
  Tensor& y = ensure(y_, x.shape(), x.device());
  engine(x).unary_forward(op_, x, y);
  return y;
}

Tensor Activation::backward(const Tensor& dy) {
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).unary_backward(op_, x_, dy, dx);
  return dx;
}

Dropout::Dropout(float p, uint64_t seed) : p_(p), rng_(seed) {
  DT_INPUT_CHECK(p >= 0.f && p < 1.f, "dropout probability must be in [0, 1), got " << p);
}

Tensor Dropout::forward(const Tensor& x) {
  if (!training_ || p_ == 0.f) {
    mask_ = Tensor();
    return x;
  }
  ensure(mask_, x.shape(), x.device());
  Tensor& y = ensure(y_, x.shape(), x.device());
  engine(x).dropout_forward(x, p_, rng_.next(), mask_, y);
  return y;
}

Tensor Dropout::backward(const Tensor& dy) {
  if (!mask_.defined()) return dy;
  Tensor& dx = ensure(dx_, dy.shape(), dy.device());
  engine(dy).mul(dy, mask_, dx);
  return dx;
}

Tensor Flatten::forward(const Tensor& x) {
  in_shape_ = x.shape();
  return x.reshape({x.size(0), -1});
}

Tensor Flatten::backward(const Tensor& dy) { return dy.reshape(in_shape_); }

}  // namespace dtrain::nn

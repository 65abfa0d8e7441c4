#include "dtrain/nn/layers.h"

namespace dtrain::nn {

Pool2d::Pool2d(PoolKind kind, int64_t kernel, int64_t stride, int64_t pad)
    : kind_(kind), kernel_(kernel), stride_(stride), pad_(pad) {
  DT_CHECK(kernel > 0 && stride > 0 && pad >= 0 && 2 * pad <= kernel, "bad pooling arguments");
}

std::string Pool2d::kind() const {
  return std::string(kind_ == PoolKind::Max ? "MaxPool2d" : "AvgPool2d") + "(k=" + std::to_string(kernel_) +
         ", s=" + std::to_string(stride_) + ")";
}

Pool2dGeom Pool2d::geom(const Tensor& x) const {
  return Pool2dGeom{x.size(0), x.size(1), x.size(2), x.size(3), kernel_, stride_, pad_};
}

// The argmax (`state_`) and the input (for its geometry) are slots, so several micro-batches of a
// pipeline can be in flight, each with its own.
Tensor Pool2d::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4, kind() << " needs (N, C, H, W), got " << x.str());
  const Pool2dGeom g = geom(x);
  DT_CHECK(g.out_h() > 0 && g.out_w() > 0, kind() << ": input " << x.str() << " is smaller than the window");
  keep(x_, x);
  Tensor& y = ensure(y_, {g.n, g.c, g.out_h(), g.out_w()}, x.device());
  engine(x).pool2d_forward(g, kind_, x, y, training_ ? &engine_state(state_) : nullptr);
  return y;
}

Tensor Pool2d::backward(const Tensor& dy) {
  const Pool2dGeom g = geom(x_);
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  engine(dy).pool2d_backward(g, kind_, dy, state_, dx);
  return dx;
}

// The constant vector 1/HW on the data's device (made once per size and device; not a slot).
const Tensor& GlobalAvgPool::averaging(int64_t hw, Device device) {
  if (!ones_.defined() || ones_.numel() != hw || ones_.device() != device) {
    ones_ = Tensor::empty({hw}, DType::F32, device);
    engine_for(device).fill(ones_, 1.f / static_cast<float>(hw));
  }
  return ones_;
}

Tensor GlobalAvgPool::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4, "GlobalAvgPool needs (N, C, H, W), got " << x.str());
  keep(x_, x);
  int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  Tensor& y = ensure(y_, {n, c}, x.device());
  // y (N*C, 1) = x (N*C, HW) . ones(HW, 1) / HW, as a GEMV on the engine.
  engine(x).gemm(false, false, n * c, 1, hw, 1.f, x, averaging(hw, x.device()), 0.f, y);
  return y;
}

Tensor GlobalAvgPool::backward(const Tensor& dy) {
  int64_t hw = x_.size(2) * x_.size(3);
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  // dx (N*C, HW) = dy (N*C, 1) . ones(1, HW) / HW
  engine(dy).gemm(false, false, dy.numel(), hw, 1, 1.f, dy, averaging(hw, dy.device()), 0.f, dx);
  return dx;
}

}  // namespace dtrain::nn

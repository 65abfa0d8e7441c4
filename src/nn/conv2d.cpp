#include <cmath>

#include "dtrain/nn/layers.h"

namespace dtrain::nn {

Conv2d::Conv2d(int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride, int64_t pad, bool bias, Rng& rng)
    : in_(in_ch), out_(out_ch), kernel_(kernel), stride_(stride), pad_(pad) {
  DT_CHECK(in_ch > 0 && out_ch > 0 && kernel > 0 && stride > 0 && pad >= 0, "bad Conv2d arguments");
  // PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = C*R*S.
  float bound = 1.f / std::sqrt(static_cast<float>(in_ch * kernel * kernel));
  Tensor w = Tensor::empty({out_ch, in_ch, kernel, kernel});
  for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = rng.uniform(-bound, bound);
  w_ = &add_parameter("weight", w);
  if (bias) {
    Tensor b = Tensor::empty({out_ch});
    for (int64_t i = 0; i < out_ch; ++i) b.f32()[i] = rng.uniform(-bound, bound);
    b_ = &add_parameter("bias", b);
  }
}

std::string Conv2d::kind() const {
  return "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) + ", k=" + std::to_string(kernel_) +
         ", s=" + std::to_string(stride_) + ", p=" + std::to_string(pad_) + ")";
}

Conv2dGeom Conv2d::geom(const Tensor& x) const {
  return Conv2dGeom{x.size(0), in_, x.size(2), x.size(3), out_, kernel_, kernel_, stride_, pad_};
}

Tensor Conv2d::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4 && x.size(1) == in_, kind() << " needs input (N, " << in_ << ", H, W), got " << x.str());
  DT_CHECK(x.size(2) + 2 * pad_ >= kernel_ && x.size(3) + 2 * pad_ >= kernel_,
           kind() << ": input " << x.str() << " is smaller than the kernel");
  keep(x_, x);
  Conv2dGeom g = geom(x);
  Tensor& y = ensure(y_, {g.n, g.k, g.out_h(), g.out_w()}, x.device());
  engine(x).conv2d_forward(g, x, w_->value, b_ ? b_->value : no_bias_, y);
  return y;
}

Tensor Conv2d::backward(const Tensor& dy) {
  Conv2dGeom g = geom(x_);
  Engine& e = engine(dy);
  if (!w_->frozen || (b_ && !b_->frozen))
    e.conv2d_backward_weights(g, x_, dy, grad_into(*w_, frozen_dw_), b_ ? grad_into(*b_, frozen_db_) : no_bias_);
  grad_ready(*w_);
  if (b_) grad_ready(*b_);
  if (!needs_input_grad_) return Tensor();
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  e.conv2d_backward_data(g, dy, w_->value, dx);
  return dx;
}

}  // namespace dtrain::nn

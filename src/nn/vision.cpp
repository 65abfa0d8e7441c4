#include "dtrain/nn/vision.h"

namespace dtrain::nn {

// ------------------------------------------------------------------ PatchTokens
PatchTokens::PatchTokens(int64_t width, bool class_token) : d_(width) {
  DT_CHECK(width > 0, "PatchTokens: width " << width);
  if (class_token) cls_ = &add_parameter("class_token", Tensor::zeros({1, 1, width}));
}

// [N, D, P] -> [N, P, D] by one axis swap; the class token and the patches are then copied into
// each sample's rows (two contiguous copies per sample).
Tensor PatchTokens::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 4 && x.size(1) == d_, kind() << " needs (N, " << d_ << ", h, w), got " << x.str());
  keep(x_, x);
  const int64_t n = x.size(0), p = x.size(2) * x.size(3), t = p + (cls_ ? 1 : 0);
  Engine& e = engine(x);
  Tensor& y = ensure(y_, {n, t, d_}, x.device());
  if (!cls_) {
    e.permute_0213(x, n, d_, p, 1, y);
    return y;
  }
  Tensor& tokens = ensure_temp(tokens_, {n, p, d_}, x.device());
  e.permute_0213(x, n, d_, p, 1, tokens);
  const Tensor rows = y.reshape({n * t, d_}), patches = tokens.reshape({n * p, d_});
  const Tensor cls = cls_->value.reshape({1, d_});
  for (int64_t b = 0; b < n; ++b) {
    Tensor cls_row = rows.slice0(b * t, b * t + 1), patch_rows = rows.slice0(b * t + 1, (b + 1) * t);
    e.copy(cls, cls_row);
    e.copy(patches.slice0(b * p, (b + 1) * p), patch_rows);
  }
  return y;
}

Tensor PatchTokens::backward(const Tensor& dy) {
  const int64_t n = x_.size(0), p = x_.size(2) * x_.size(3), t = p + (cls_ ? 1 : 0);
  DT_CHECK(dy.numel() == n * t * d_, kind() << " backward got " << dy.str());
  Engine& e = engine(dy);
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  if (!cls_) {
    e.permute_0213(dy, n, p, d_, 1, dx);
    return dx;
  }
  Tensor& dtokens = ensure_temp(dtokens_, {n, p, d_}, dy.device());
  const Tensor rows = dy.reshape({n * t, d_}), dpatches = dtokens.reshape({n * p, d_});
  for (int64_t b = 0; b < n; ++b) {
    Tensor patch_rows = dpatches.slice0(b * p, (b + 1) * p);
    e.copy(rows.slice0(b * t + 1, (b + 1) * t), patch_rows);
    if (cls_->frozen) continue;
    Tensor dcls = cls_->grad.reshape({d_});
    e.axpy(1.f, rows.slice0(b * t, b * t + 1).reshape({d_}), dcls);
  }
  grad_ready(*cls_);
  e.permute_0213(dtokens, n, p, d_, 1, dx);
  return dx;
}

// ------------------------------------------------------------------ PositionEmbedding
PositionEmbedding::PositionEmbedding(int64_t tokens, int64_t width, Rng& rng) : t_(tokens), d_(width) {
  DT_CHECK(tokens > 0 && width > 0, "PositionEmbedding: " << tokens << " tokens of width " << width);
  Tensor pos = Tensor::empty({1, tokens, width});
  for (int64_t i = 0; i < pos.numel(); ++i) pos.f32()[i] = 0.02f * rng.normal();
  pos_ = &add_parameter("pos_embedding", pos);
}

Tensor PositionEmbedding::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 3 && x.size(1) == t_ && x.size(2) == d_,
           kind() << " needs (N, " << t_ << ", " << d_ << "), got " << x.str());
  Engine& e = engine(x);
  Tensor& y = ensure(y_, x.shape(), x.device());
  e.copy(x, y);
  Tensor rows = y.reshape({x.size(0), t_ * d_});
  e.add_row_bias(rows, pos_->value.reshape({t_ * d_}));
  return y;
}

Tensor PositionEmbedding::backward(const Tensor& dy) {
  if (!pos_->frozen) {
    Tensor dpos = pos_->grad.reshape({t_ * d_});
    engine(dy).row_bias_grad(dy.reshape({dy.numel() / (t_ * d_), t_ * d_}), dpos);
  }
  grad_ready(*pos_);
  return dy;  // d(x + pos)/dx is the identity
}

// ------------------------------------------------------------------ FirstToken
Tensor FirstToken::forward(const Tensor& x) {
  DT_CHECK(x.dim() == 3, kind() << " needs (N, T, D), got " << x.str());
  keep(x_, x);
  const int64_t n = x.size(0), t = x.size(1), d = x.size(2);
  Engine& e = engine(x);
  Tensor& y = ensure(y_, {n, d}, x.device());
  const Tensor rows = x.reshape({n * t, d});
  for (int64_t b = 0; b < n; ++b) {
    Tensor row = y.slice0(b, b + 1);
    e.copy(rows.slice0(b * t, b * t + 1), row);
  }
  return y;
}

Tensor FirstToken::backward(const Tensor& dy) {
  const int64_t n = x_.size(0), t = x_.size(1), d = x_.size(2);
  Engine& e = engine(dy);
  Tensor& dx = ensure(dx_, x_.shape(), dy.device());
  e.fill(dx, 0.f);
  const Tensor rows = dx.reshape({n * t, d});
  for (int64_t b = 0; b < n; ++b) {
    Tensor row = rows.slice0(b * t, b * t + 1);
    e.copy(dy.slice0(b, b + 1), row);
  }
  return dx;
}

// ------------------------------------------------------------------ the encoder block
ModulePtr make_vit_block(int64_t width, int64_t heads, int64_t mlp, float eps, Rng& rng) {
  auto attention = std::make_unique<SelfAttention>(width, heads, rng);
  attention->set_causal(false);
  attention->name_as_torch_multihead();
  auto attend = std::make_unique<Sequential>();
  attend->add(std::make_unique<LayerNorm>(width, eps), "ln_1");
  attend->add(std::move(attention), "self_attention");
  auto ff = std::make_unique<Sequential>();  // torchvision's MLP: Linear, GELU, Dropout, Linear, Dropout
  ff->add(std::make_unique<Linear>(width, mlp, true, rng), "0");
  ff->add(GELUExact(), "1");
  ff->add(std::make_unique<Linear>(mlp, width, true, rng), "3");
  auto feed = std::make_unique<Sequential>();
  feed->add(std::make_unique<LayerNorm>(width, eps), "ln_2");
  feed->add(std::move(ff), "mlp");
  auto block = std::make_unique<Sequential>();
  block->add(std::make_unique<Residual>(std::move(attend), nullptr, ResidualNames{true}), "");
  block->add(std::make_unique<Residual>(std::move(feed), nullptr, ResidualNames{true}), "");
  return block;
}

}  // namespace dtrain::nn

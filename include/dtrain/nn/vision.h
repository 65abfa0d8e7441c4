#pragma once
// Vision-transformer pieces, as torchvision's VisionTransformer has them: a patch convolution's grid
// as tokens with a learned class token, a learned position embedding, the encoder block, and the
// class token read out for the head. Model files use them (docs/models.md).
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

// (N, D, h, w) -> (N, h*w + 1, D): the patch grid in row-major order as tokens, after a learned
// class token (parameter "class_token", [1, 1, D], zeros as torchvision starts it); without
// `class_token`, (N, h*w, D).
class PatchTokens : public Module {
 public:
  PatchTokens(int64_t width, bool class_token);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "PatchTokens(" + std::to_string(d_) + ")"; }

 private:
  int64_t d_;
  Parameter* cls_ = nullptr;
  Tensor x_, y_, dx_, tokens_, dtokens_;  // x_ for its shape; tokens_ [N, h*w, D] (scratch)
};

// (N, T, D) -> (N, T, D) + "pos_embedding" ([1, T, D], drawn from N(0, 0.02^2) as torchvision does).
class PositionEmbedding : public Module {
 public:
  PositionEmbedding(int64_t tokens, int64_t width, Rng& rng);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override {
    return "PositionEmbedding(" + std::to_string(t_) + ", " + std::to_string(d_) + ")";
  }

 private:
  int64_t t_, d_;
  Parameter* pos_;
  Tensor y_;
};

// (N, T, D) -> (N, D): token 0, the class token a ViT's head reads.
class FirstToken : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "FirstToken"; }

 private:
  Tensor x_, y_, dx_;  // x_ for its shape
};

// torchvision's ViT EncoderBlock on (N, T, D): x + attention(ln_1(x)), then + mlp(ln_2(.)), where the
// attention is bidirectional over `heads` heads and mlp = Linear(D, mlp), exact GELU, Linear(mlp, D).
// Parameters named as torchvision's: ln_1, self_attention.in_proj_weight, .in_proj_bias,
// .out_proj.*, ln_2, mlp.0, mlp.3.
ModulePtr make_vit_block(int64_t width, int64_t heads, int64_t mlp, float eps, Rng& rng);

}  // namespace dtrain::nn

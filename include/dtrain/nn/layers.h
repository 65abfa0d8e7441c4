#pragma once
// The layers. Shapes: Linear (..., in) -> (..., out); images NCHW; conv weights (K, C, R, S).
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "dtrain/core/rng.h"
#include "dtrain/nn/module.h"

namespace dtrain::int8 {
struct WeightOnlyInt8;
}

namespace dtrain::nn {

// Whether a parameter's (or a checkpoint tensor's) name is a LoRA adapter's (Linear::add_lora).
inline bool is_lora_adapter(const std::string& name) { return name.ends_with(".lora_A") || name.ends_with(".lora_B"); }

class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias, Rng& rng);
  Tensor forward(const Tensor& x) override;  // x (..., in) -> (..., out)
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Linear(" + std::to_string(in_) + ", " + std::to_string(out_) + ")"; }
  Parameter& weight() { return *w_; }  // (out, in)
  Parameter* bias() { return b_; }
  // Keeps its own copy of the input for backward instead of a reference to the producer's buffer,
  // in bf16/f16 when the engine multiplies in that type (the GEMM rounds its operands to it anyway, so
  // nothing changes but the bytes held): the producer's output can then be a temporary.
  void set_copy_input(bool on) { copy_input_ = on; }
  // Inference with int8 weights (weight-only, int8.h's WeightOnlyInt8; activations stay f32): the f32
  // weight is quantized per output row and released, forward multiplies through the int8 copy, and
  // backward is refused. CPU only. Returns the weight bytes before and after.
  std::pair<int64_t, int64_t> quantize_weights_int8();
  bool weights_int8() const { return w8_ != nullptr; }

  // LoRA (Hu et al., 2021): y += (alpha / rank) (x A^T) B^T with adapters over row blocks of the
  // outputs, `blocks` (first row, rows) each (a fused q/k/v projection adapts q and v apart). A
  // [n rank, in] is drawn from `rng` as PyTorch's kaiming-uniform (PEFT's), B [out, n rank] is zero
  // and only its diagonal blocks are trained (the rest stays zero). Parameters "lora_A", "lora_B".
  void add_lora(const std::vector<std::pair<int64_t, int64_t>>& blocks, int64_t rank, float alpha, Rng& rng);
  bool has_lora() const { return lora_a_ != nullptr; }

  // PyTorch's default initialisation of a full in -> out layer: weight [out, in] then bias [out]
  // (undefined when `bias` is false), both U(-1/sqrt(in), 1/sqrt(in)), drawn in that order.
  static std::pair<Tensor, Tensor> init(int64_t in, int64_t out, bool bias, Rng& rng);

 protected:
  // For layers that hold a slice of a bigger one (tensor parallel): `in` x `out` are the local
  // sizes, and the subclass gives set_parameters the full layer's tensors.
  Linear(int64_t in, int64_t out) : in_(in), out_(out) {}
  // Registers this slice's parts of the full layer's weight and bias, each with its placement.
  void set_parameters(const Tensor& full_weight, const Tensor& full_bias);
  // A slice of a bigger layer says how: the full layer's sizes and where its parts lie of a full
  // tensor whose rows are the outputs ([full out, k]: the weight, the bias, LoRA's B) and of one
  // whose columns are the inputs ([k, full in]: the weight, LoRA's A); a split tensor is one of
  // them. LoRA's rank-space activations x A^T are partial sums where the inputs are split, their
  // gradient where the outputs are: the sum over the slices' ranks, in place. One layer: the
  // whole, nothing to sum.
  virtual int64_t full_in() const { return in_; }
  virtual int64_t full_out() const { return out_; }
  virtual Placement output_rows(const Shape& /*full*/) const { return {}; }
  virtual Placement input_columns(const Shape& /*full*/) const { return {}; }
  // Registers parameter `name` as this slice's part of `full`, placed by `placement`.
  Parameter& add_part(const std::string& name, const Tensor& full, Placement placement);
  virtual void sum_lora_activations(Tensor&) {}
  virtual void sum_lora_gradients(Tensor&) {}
  // Rows this slice shares with other ranks (a replicated head's) get only part of their gradient
  // from this rank's backward: called before backward adds to `p`'s gradient (set the accumulated
  // rows aside) and after (sum the new part over the sharers, add the rows set aside).
  virtual void share_gradient(Parameter&, bool /*after*/) {}
  // y = x . W^T without the bias, in this layer's output buffer; add_bias finishes forward.
  Tensor& project(const Tensor& x);
  void add_bias(Tensor& y);

  int64_t in_, out_;
  Parameter* w_ = nullptr;
  Parameter* b_ = nullptr;
  Tensor x_, y_, dx_;
  bool copy_input_ = false;
  Tensor x_copy_, x_wide_;  // the input copy (bf16, f16 or f32); its f32 widening in backward (scratch)
  // The input backward multiplies by: x_, or x_copy_ widened to f32.
  const Tensor& saved_input(Device dev);
  bool reads_copy(const Engine& e, int64_t m, int64_t n) const;
  Tensor dy_low_;                             // dy rounded once for both backward GEMMs (scratch)
  std::shared_ptr<int8::WeightOnlyInt8> w8_;  // set by quantize_weights_int8
  Parameter* lora_a_ = nullptr;               // add_lora's adapters
  Parameter* lora_b_ = nullptr;
  float lora_scale_ = 0.f;
  Tensor lora_mask_;         // [out, n rank]: 1 on B's trained blocks, on the parameters' device
  Tensor lora_t_, lora_dt_;  // x A^T [M, n rank] (kept for backward) and its gradient (scratch)
  void lora_forward(const Tensor& x, Tensor& y);
  void lora_backward(const Tensor& dy, const Tensor& x, Tensor* dx);
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride, int64_t pad, bool bias, Rng& rng);
  Tensor forward(const Tensor& x) override;  // (N, C, H, W) -> (N, K, P, Q)
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override;
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel() const { return kernel_; }
  int64_t stride() const { return stride_; }
  int64_t pad() const { return pad_; }
  Parameter& weight() { return *w_; }  // (K, C, R, S)
  Parameter* bias() { return b_; }

 private:
  Conv2dGeom geom(const Tensor& x) const;
  int64_t in_, out_, kernel_, stride_, pad_;
  Parameter* w_;
  Parameter* b_ = nullptr;
  Tensor x_, y_, dx_, no_bias_;
  Tensor frozen_dw_, frozen_db_;  // grad_into's scratch
};

class Pool2d : public Module {
 public:
  Pool2d(PoolKind kind, int64_t kernel, int64_t stride, int64_t pad = 0);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override;
  PoolKind pool_kind() const { return kind_; }
  int64_t kernel() const { return kernel_; }
  int64_t stride() const { return stride_; }
  int64_t pad() const { return pad_; }

 private:
  Pool2dGeom geom(const Tensor& x) const;
  PoolKind kind_;
  int64_t kernel_, stride_, pad_;
  Tensor x_, y_, dx_, state_;  // x_ for its shape: the geometry of this micro-batch's backward
};
inline ModulePtr MaxPool2d(int64_t k, int64_t s, int64_t p = 0) {
  return std::make_unique<Pool2d>(PoolKind::Max, k, s, p);
}
inline ModulePtr AvgPool2d(int64_t k, int64_t s, int64_t p = 0) {
  return std::make_unique<Pool2d>(PoolKind::Avg, k, s, p);
}

// (N, C, H, W) -> (N, C): mean over H*W.
class GlobalAvgPool : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "GlobalAvgPool"; }

 private:
  const Tensor& averaging(int64_t hw, Device device);
  Tensor x_, y_, dx_, ones_;  // x_ for its shape (a slot, so each micro-batch has its own)
};

class Activation : public Module {
 public:
  explicit Activation(Unary op) : op_(op) {}
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return op_ == Unary::Relu ? "ReLU" : op_ == Unary::Gelu ? "GELU(tanh)" : "GELU"; }
  Unary op() const { return op_; }

 private:
  Unary op_;
  Tensor x_, y_, dx_;
};
inline ModulePtr ReLU() { return std::make_unique<Activation>(Unary::Relu); }
inline ModulePtr GELU() { return std::make_unique<Activation>(Unary::Gelu); }
inline ModulePtr GELUExact() { return std::make_unique<Activation>(Unary::GeluExact); }

class Dropout : public Module {
 public:
  Dropout(float p, uint64_t seed);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Dropout(" + std::to_string(p_) + ")"; }

 private:
  float p_;
  Buffer* rng_state_;  // i64[4]: the xoshiro state, a buffer so checkpoints resume the same masks
  Tensor mask_, y_, dx_;
};

// (N, ...) -> (N, prod(...)); a view, no copy.
class Flatten : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Flatten"; }

 private:
  Tensor x_;  // for its shape (a slot, so each micro-batch has its own)
};

class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t channels, float eps = 1e-5f, float momentum = 0.1f);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "BatchNorm2d(" + std::to_string(c_) + ")"; }
  int64_t channels() const { return c_; }
  float eps() const { return eps_; }
  float momentum() const { return momentum_; }
  // Evaluation mode's per-channel affine map, y = gamma (x - mean) / sqrt(var + eps) + beta.
  const Tensor& gamma() const { return gamma_->value; }
  const Tensor& beta() const { return beta_->value; }
  const Tensor& running_mean() const { return running_mean_->value; }
  const Tensor& running_var() const { return running_var_->value; }

 private:
  int64_t c_;
  float eps_, momentum_;
  Parameter *gamma_, *beta_;
  Buffer *running_mean_, *running_var_;
  Tensor x_, y_, dx_, save_mean_, save_invstd_;
  Tensor frozen_dgamma_, frozen_dbeta_;  // grad_into's scratch
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t features, float eps = 1e-5f);
  Tensor forward(const Tensor& x) override;  // normalises the last dimension
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "LayerNorm(" + std::to_string(d_) + ")"; }

 private:
  int64_t d_;
  float eps_;
  Parameter *gamma_, *beta_;
  Tensor x_, y_, dx_, mean_, rstd_;
  Tensor frozen_dgamma_, frozen_dbeta_;  // grad_into's scratch
};

// RMSNorm (the Llama family's): y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t features, float eps = 1e-5f);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "RMSNorm(" + std::to_string(d_) + ")"; }

 private:
  int64_t d_;
  float eps_;
  Parameter* gamma_;
  Tensor x_, y_, dx_, rstd_;
  Tensor frozen_dgamma_;  // grad_into's scratch
};

// SwiGLU over a fused gate/up projection: x [..., 2F] (gate in the first F features, up in the
// last F) -> silu(gate) * up [..., F].
class SwiGLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "SwiGLU"; }

 private:
  Tensor x_, y_, dx_;
};

class Sequential : public Module {
 public:
  Sequential() = default;
  // Layers [begin, end) of `whole` as a Sequential of their own (a pipeline stage); the other
  // layers are dropped. The stage names its layers as `whole` did ("3", "4", ...), so parameters
  // and buffers keep their names in the whole model ("3.weight", "4.0.body.1.running_mean") in any
  // layout, and checkpoints and comparisons name the same tensors.
  static std::unique_ptr<Sequential> stage_of(std::unique_ptr<Sequential> whole, size_t begin, size_t end);
  // Appends a layer named `name` in parameter paths ("conv1.weight", as PyTorch's named modules);
  // without a name, by its index; named "", it adds no level (its parameters are named as if they
  // were the Sequential's own).
  Sequential& add(ModulePtr m, std::optional<std::string> name = std::nullopt);
  // ZeRO-3's shard-by-shard build (parallel/zero/sharded_init.h): each layer with parameters added
  // from now on is handed to `sink` as a unit of its own (shard_units' units), which keeps this
  // rank's block of it and leaves its values empty. Null: the layers keep their values.
  void set_unit_sink(UnitSink* sink) { sink_ = sink; }
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Sequential"; }
  void set_needs_input_grad(bool needed) override;
  ShardUnits shard_units() override;  // every layer with parameters
  std::vector<std::pair<std::string, Module*>> children() override;
  size_t size() const { return layers_.size(); }
  Module& operator[](size_t i) { return *layers_[i]; }
  // Swaps layer i for another (SyncBatchNorm conversion); returns the old one.
  ModulePtr replace(size_t i, ModulePtr m);

 private:
  std::vector<ModulePtr> layers_;
  std::vector<std::optional<std::string>> names_;  // per layer; none: its index
  size_t first_name_ = 0;                          // the index of layers_[0] in the whole model (see stage_of)
  UnitSink* sink_ = nullptr;
};

// The activation shapes at the layer boundaries of `model` for an input of shape `input` (batch
// first): shapes[i] is the input of layer i, shapes[model.size()] the output. Found by a forward
// in evaluation mode on a batch of 1 (every layer keeps the batch as dimension 0), so no state
// changes: BatchNorm running statistics, dropout streams and the training flag stay as they were.
// A pipeline stage of layers [b, e) receives shapes[b] and sends shapes[e].
std::vector<Shape> layer_boundary_shapes(Sequential& model, const Shape& input);

// y = after(body(x) + shortcut(x)); shortcut is the identity when null, so is `after`.
// How the parameters are named: by default "body.<i>...." and "shortcut.<i>....". With `flat_body`
// the body's layers (a Sequential) name themselves directly under the block and the shortcut is
// named `shortcut_name`: torchvision's BasicBlock/Bottleneck ("conv1", "bn1", ..., "downsample.0").
struct ResidualNames {
  bool flat_body = false;
  std::string shortcut = "shortcut";
};
class Residual : public Module {
 public:
  Residual(ModulePtr body, ModulePtr shortcut = nullptr, ResidualNames names = {}, ModulePtr after = nullptr);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Residual"; }
  std::vector<std::pair<std::string, Module*>> children() override;
  Module& body() { return *body_; }
  Module* shortcut() { return shortcut_.get(); }  // null: the identity
  Module* after() { return after_.get(); }        // null: none
  const ResidualNames& names() const { return names_; }

 private:
  ModulePtr body_, shortcut_, after_;
  ResidualNames names_;
  Tensor y_, dx_;
};

// Activation checkpointing: forward keeps only the body's input and output and frees the body's
// activations; backward runs the body's forward again, then its backward, then frees them again.
// Less memory for one more forward per step. The body's forward must be deterministic (no dropout).
// Transparent in parameter names.
class Checkpointed : public Module {
 public:
  // Blocks of one structure may share `pool`: the activations of whichever block ran last, handed
  // to the next one, so recomputation allocates nothing in steady state.
  explicit Checkpointed(ModulePtr body, std::shared_ptr<std::vector<Tensor>> pool = nullptr);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "Checkpointed(" + body_->kind() + ")"; }
  std::vector<std::pair<std::string, Module*>> children() override { return {{"", body_.get()}}; }
  void set_needs_input_grad(bool needed) override;

 private:
  ModulePtr body_;
  std::shared_ptr<std::vector<Tensor>> pool_;
  Tensor x_, y_;
};

// Mean softmax cross-entropy over a batch of logits (N, C) with i32 labels (N).
class SoftmaxCrossEntropy {
 public:
  virtual ~SoftmaxCrossEntropy() = default;
  // Returns the mean loss; `correct` receives the number of argmax hits.
  virtual float forward(const Tensor& logits, const Tensor& labels, int64_t* correct = nullptr);
  // d(mean loss)/d(logits), times `scale` (the loss scale, or 1/micro-steps).
  virtual Tensor backward(float scale = 1.f);
  virtual double last_loss_sum() const { return loss_sum_; }
  // forward() without waiting for the device: the loss sum, the argmax hits and a bad-label flag are
  // added into `stats` (kXentStatsFloats f32 on the logits' device; Engine::softmax_xent_accumulate)
  // for the caller to read when it logs. backward() follows as after forward().
  virtual void accumulate(const Tensor& logits, const Tensor& labels, Tensor& stats);

 private:
  Tensor labels_, probs_, dlogits_;
  double loss_sum_ = 0;
};

// The cross-entropy of a head that scores its own targets (GptHead::score_next): its input is the
// rows' softmax statistics [3, M] (row max, sum of exponentials, target logit, over the whole
// vocabulary), the loss of row i log(sumexp_i) + max_i - target_i (none where the label is
// kIgnoreLabel); no argmax hits. backward gives the head d(mean loss)/d(sum of the rows' losses),
// times `scale`: one f32 on the host.
class HeadCrossEntropy : public SoftmaxCrossEntropy {
 public:
  float forward(const Tensor& row_stats, const Tensor& labels, int64_t* correct = nullptr) override;
  Tensor backward(float scale = 1.f) override;
  double last_loss_sum() const override { return loss_sum_; }
  void accumulate(const Tensor& row_stats, const Tensor& labels, Tensor& stats) override;

 private:
  int64_t rows_ = 0;
  double loss_sum_ = 0;
};

// Knowledge distillation's soft-target term: T^2 times the mean over rows of
// KL(softmax(teacher / T) || softmax(student / T)) for logits (N, C) on the host. The T^2 keeps its
// gradient, T (p_student - p_teacher) / N, on the scale of the hard-label cross-entropy's.
class SoftTargetLoss {
 public:
  explicit SoftTargetLoss(float temperature = 4.f);
  float temperature() const { return t_; }
  // The softened distributions of both, for backward; `teacher` is read only here. No host sync.
  void prepare(const Tensor& student, const Tensor& teacher);
  // prepare, and the mean loss (read on the host).
  float forward(const Tensor& student, const Tensor& teacher);
  // d(mean loss)/d(student logits), times `scale`.
  Tensor backward(float scale = 1.f);

 private:
  float t_;
  Tensor p_student_, p_teacher_, dlogits_;
};

}  // namespace dtrain::nn

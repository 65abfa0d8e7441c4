#pragma once
// The Engine contract: everything one device computes for training. A rank owns one engine bound
// to one device. All tensors are contiguous row-major; images are NCHW, conv weights OIHW.
// Gradients of parameters are ACCUMULATED (dw += ...) so that micro-batches can add up; the
// optimizer's zero_grad clears them. Activation gradients (dx) are overwritten.
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/core/tensor.h"

namespace dtrain {

class FusedAttention;  // dtrain/kernels/attention.h

struct Conv2dGeom {
  int64_t n, c, h, w;  // input
  int64_t k, r, s;     // output channels, kernel height, width
  int64_t stride = 1, pad = 0;
  int64_t out_h() const { return (h + 2 * pad - r) / stride + 1; }
  int64_t out_w() const { return (w + 2 * pad - s) / stride + 1; }
};

enum class PoolKind { Max, Avg };
struct Pool2dGeom {
  int64_t n, c, h, w;
  int64_t kernel, stride, pad = 0;
  int64_t out_h() const { return (h + 2 * pad - kernel) / stride + 1; }
  int64_t out_w() const { return (w + 2 * pad - kernel) / stride + 1; }
};

// A target without a loss (softmax cross-entropy's labels): a prompt's or padding's.
inline constexpr int32_t kIgnoreLabel = -1;

enum class Unary { Relu, Gelu, GeluExact };  // Gelu: the tanh approximation (GPT-2's)

// Precision of the multiplications inside gemm, gemm_batched and conv2d_* when their operands are
// f32 tensors (mixed precision). Products are always accumulated in f32 and results written in f32;
// master weights, activations and gradients keep their f32 storage.
//   F32   exact fp32 (the default).
//   TF32  CUDA tensor cores with 10-bit mantissas; the CPU engine computes exact fp32.
//   BF16  operands rounded to bfloat16 (CPU: oneDNN AVX512-BF16 kernels; CUDA: cuBLASLt/cuDNN).
//         A permission, not a demand: the CPU keeps fp32 for GEMMs with under 16 rows or columns,
//         where the rounding costs more than the bf16 kernel saves.
//   F16   operands rounded to IEEE half (CUDA tensor cores). The CPU has no fast fp16: its GEMM
//         rounds the operands to half and multiplies in fp32 (fp16 numerics without the speed,
//         enough to exercise loss scaling); its convolutions stay fp32.
enum class MathPrecision { F32, TF32, BF16, F16 };
const char* math_precision_name(MathPrecision p);                 // "fp32", "tf32", "bf16", "fp16"
MathPrecision math_precision_from_name(const std::string& name);  // throws InputError naming the value

class Engine {
 public:
  virtual ~Engine() = default;
  virtual Device device() const = 0;
  virtual std::string describe() const = 0;
  virtual void set_threads(int threads) = 0;
  virtual int threads() const = 0;

  // Mixed precision: see MathPrecision. Applies to later gemm/gemm_batched/conv2d_* calls.
  virtual void set_math_precision(MathPrecision p) { math_ = p; }
  MathPrecision math_precision() const { return math_; }
  // A line for the user about how the math precision runs on this device ("" when natively): the
  // CPU engine says so when bf16 is emulated in fp32 (a processor without AVX512-BF16).
  virtual std::string precision_note() const { return ""; }

  // The op families this engine has beyond its methods below (capabilities: null when it has
  // none, and the family's free functions fall back to what it has). Attention: attention.h.
  virtual FusedAttention* fused_attention() { return nullptr; }

  // Waits for all work queued on this engine (a no-op on the CPU, whose calls are synchronous).
  virtual void synchronize() {}

  // Whether an m x n GEMM of f32 operands multiplies in bf16/f16 under math_precision(), so that
  // a weight's low-precision working copy (nn::Parameter::working) gives the same products as its
  // f32 master. The CPU keeps fp32 for small bf16 products (see MathPrecision).
  virtual bool rounds_gemm(int64_t m, int64_t n) const {
    (void)m, (void)n;
    return math_ == MathPrecision::BF16 || math_ == MathPrecision::F16;
  }

  // ---- GEMM: C[M,N] = alpha * op(A) op(B) + beta * C, row-major, C f32. A and B are each f32,
  // bf16 or f16, at most one low-precision type between them. Both f32: math_precision() decides
  // the multiply. Otherwise the multiply is in the low-precision type, an f32 operand rounded to
  // it (a bf16 weight copy beside f32 activations); accumulation is always f32.
  virtual void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                    const Tensor& b, float beta, Tensor& c) = 0;
  // batch GEMMs over equally strided slices (attention): A_i = a + i*stride_a elements, etc.
  virtual void gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                            const Tensor& a, int64_t stride_a, const Tensor& b, int64_t stride_b, float beta, Tensor& c,
                            int64_t stride_c) = 0;

  // ---- Convolution. x [N,C,H,W], w [K,C,R,S], bias [K] (may be undefined), y [N,K,P,Q].
  virtual void conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) = 0;
  virtual void conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx) = 0;
  // dw += ..., dbias += ... (dbias may be undefined)
  virtual void conv2d_backward_weights(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                       Tensor& dbias) = 0;

  // ---- Pooling. `state` is whatever backward needs (the max pool's argmax workspace); the engine
  // allocates it in forward when training.
  virtual void pool2d_forward(const Pool2dGeom& g, PoolKind kind, const Tensor& x, Tensor& y, Tensor* state) = 0;
  virtual void pool2d_backward(const Pool2dGeom& g, PoolKind kind, const Tensor& dy, const Tensor& state,
                               Tensor& dx) = 0;

  // ---- Normalisation. BatchNorm over [N,C,H*W] per channel c; LayerNorm over the last dim of [M,D].
  // Training forward saves mean and inverse std [C] and updates running stats (momentum as PyTorch).
  virtual void batchnorm_forward_train(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                       float eps, float momentum, Tensor& running_mean, Tensor& running_var,
                                       Tensor& save_mean, Tensor& save_invstd, Tensor& y) = 0;
  virtual void batchnorm_forward_infer(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                       float eps, const Tensor& running_mean, const Tensor& running_var, Tensor& y) = 0;
  // dx overwritten; dgamma, dbeta accumulated.
  virtual void batchnorm_backward(const Tensor& x, const Tensor& dy, int64_t channels, const Tensor& gamma,
                                  const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                                  Tensor& dbeta) = 0;
  virtual void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& mean,
                                 Tensor& rstd, Tensor& y) = 0;
  virtual void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                                  const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) = 0;
  // RMSNorm over the last axis (the Llama family's): rstd [m] = 1 / sqrt(mean(x^2) + eps),
  // y = x * rstd * gamma.
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& rstd, Tensor& y) = 0;
  // dx = rstd * (dy gamma - x rstd^2 mean(dy gamma x)) (overwritten); dgamma += sum over rows of
  // dy x rstd (accumulated).
  virtual void rmsnorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, Tensor& dx,
                                Tensor& dgamma) = 0;

  // ---- Per-channel reductions and maps over x viewed as [N, C, HW] (SyncBatchNorm builds on them).
  // sum[c] = sum x, sumsq[c] = sum x^2 (overwritten), f64 accumulation.
  virtual void channel_sums(const Tensor& x, int64_t channels, Tensor& sum, Tensor& sumsq) = 0;
  // out[c] = sum a*b over N and HW (overwritten).
  virtual void channel_dot(const Tensor& a, const Tensor& b, int64_t channels, Tensor& out) = 0;
  // y = x * scale[c] + shift[c]
  virtual void channel_affine(const Tensor& x, int64_t channels, const Tensor& scale, const Tensor& shift,
                              Tensor& y) = 0;

  // ---- Element-wise.
  virtual void unary_forward(Unary op, const Tensor& x, Tensor& y) = 0;
  virtual void unary_backward(Unary op, const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  // Inverted dropout: mask[i] = keep ? 1/(1-p) : 0, drawn from (seed, i); y = x * mask.
  virtual void dropout_forward(const Tensor& x, float p, uint64_t seed, Tensor& mask, Tensor& y) = 0;
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& y) = 0;  // y = a * b
  virtual void add(const Tensor& a, const Tensor& b, Tensor& y) = 0;  // y = a + b
  virtual void axpy(float alpha, const Tensor& x, Tensor& y) = 0;     // y += alpha * x
  virtual void scale(Tensor& y, float alpha) = 0;                     // y *= alpha
  virtual void fill(Tensor& y, float value) = 0;
  // Same device; the CUDA engine also copies between the host and its device (asynchronously on its
  // compute stream when the host buffer is pinned, otherwise synchronously).
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  virtual void cast(const Tensor& src, Tensor& dst) = 0;  // f32 <-> bf16/f16
  // Rows: y[M,N] += bias[N]; dbias[N] += sum over rows of dy[M,N].
  virtual void add_row_bias(Tensor& y, const Tensor& bias) = 0;
  virtual void row_bias_grad(const Tensor& dy, Tensor& dbias) = 0;
  virtual double sum_squares(const Tensor& x) = 0;  // f64 accumulation
  virtual bool all_finite(const Tensor& x) = 0;
  // Loss scaling: x *= inv_scale; found_inf (f32 [1], same device) is set to 1 when any element of
  // x is inf or NaN and is left unchanged otherwise, so one flag can cover many tensors and be read
  // once per step (one device sync instead of one per tensor).
  virtual void unscale_and_check(Tensor& x, float inv_scale, Tensor& found_inf) = 0;

  // ---- Softmax cross-entropy over logits [M,C] with i32 labels [M]. Writes the probabilities,
  // returns the summed loss and (through `correct`) the count of argmax hits. A label of
  // kIgnoreLabel (-1: a prompt's or padding's target) adds no loss and no hit, and its gradient row
  // is zero; here and in the vocabulary-parallel pieces below.
  virtual double softmax_xent_forward(const Tensor& logits, const Tensor& labels, Tensor& probs, int64_t* correct) = 0;
  // The same without waiting for the device: adds this batch's loss sum, argmax hits and a flag for
  // an out-of-range label into `stats` (an XentStats, on the logits' device), which the caller reads
  // when it needs the figures (a log line), so a GPU step needs no host sync for its loss.
  virtual void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, Tensor& probs, Tensor& stats) = 0;
  // dlogits = (probs - onehot(labels)) * scale
  virtual void softmax_xent_backward(const Tensor& probs, const Tensor& labels, float scale, Tensor& dlogits) = 0;

  // ---- Vocabulary-parallel cross-entropy. logits [M, Vs] hold columns [offset, offset + Vs) of a
  // vocabulary split over ranks; labels i32 [M] index the whole vocabulary. Given the row maxima
  // over all columns (row_max on each slice, then a max-allreduce), the sums below add up across
  // ranks: loss[i] = log(sum_ranks sumexp[i]) + rowmax[i] - sum_ranks target[i].
  virtual void row_max(const Tensor& x, Tensor& out) = 0;  // x [M, N] -> out [M]
  // y[i,j] = exp(scale x[i,j] - m_i) / sum_k exp(scale x[i,k] - m_i), m_i the row's max of scale x:
  // x, y [M, N] (distillation's softened distributions, scale = 1/T).
  virtual void softmax_rows(const Tensor& x, float scale, Tensor& y) = 0;
  // sumexp[i] = sum_j exp(x[i,j] - rowmax[i]); target[i] = x[i, labels[i] - offset] when this slice
  // holds the label, else 0.
  virtual void vocab_xent_partials(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                   Tensor& sumexp, Tensor& target) = 0;
  // dlogits[i,j] = scale * (exp(x[i,j] - rowmax[i]) / sumexp[i] - [j == labels[i] - offset]), with
  // sumexp the total over all ranks.
  virtual void vocab_xent_backward(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                   const Tensor& sumexp, float scale, Tensor& dlogits) = 0;
  // Adds the rows' losses, sum_i log(sumexp[i]) + rowmax[i] - target[i] (the sums over all ranks),
  // into stats' loss_sum, and the rows whose target logit is the row's maximum into its hits (an
  // XentStats on the same device, as softmax_xent_accumulate's), so a step needs no host sync.
  virtual void vocab_xent_loss_accumulate(const Tensor& rowmax, const Tensor& sumexp, const Tensor& target,
                                          const Tensor& labels, Tensor& stats) = 0;

  // ---- Transformer pieces (GPT).
  // y[a,c,b,d] = x[a,b,c,d] for x viewed as [A,B,C,D]: swaps the two middle axes, e.g. attention's
  // [batch, T, heads, head_dim] <-> [batch, heads, T, head_dim]. Swapping B and C inverts it.
  virtual void permute_0213(const Tensor& x, int64_t a, int64_t b, int64_t c, int64_t d, Tensor& y) = 0;
  // Attention softmax over scores viewed as [N, T, T] (N = batch * heads), the scale fused. Causal:
  // probs[n,i,j] = exp(scale*s[n,i,j]) / sum_{k<=i} exp(scale*s[n,i,k]) for j <= i, and 0 for j > i;
  // otherwise (bidirectional, as a ViT's encoder) the sums run over every k.
  virtual void attention_softmax_forward(const Tensor& scores, int64_t t, float scale, bool causal, Tensor& probs) = 0;
  // dscores[n,i,j] = scale * p[n,i,j] * (dp[n,i,j] - sum_k p[n,i,k] dp[n,i,k]) (overwritten; causal:
  // 0 above the diagonal).
  virtual void attention_softmax_backward(const Tensor& probs, const Tensor& dprobs, int64_t t, float scale,
                                          bool causal, Tensor& dscores) = 0;
  // Rotary position embedding, Llama's "rotate half" pairing: x viewed as [N, T, D] (heads of D
  // features at positions pos0 .. pos0+T-1); `table` [P, D] holds cos(p w_i) in its first D/2 columns
  // and sin(p w_i) in its last D/2 for positions p < P. Feature i < D/2 pairs with i + D/2:
  // y_i = x_i cos - x_{i+D/2} sin, y_{i+D/2} = x_{i+D/2} cos + x_i sin; `inverse` rotates back (the
  // gradient). y may be x.
  virtual void rotary(const Tensor& x, int64_t t, const Tensor& table, int64_t pos0, bool inverse, Tensor& y) = 0;
  // SwiGLU: gu [M, 2F] holds the gate in its first F columns and the up projection in its last F;
  // y [M, F] = silu(gate) * up. Backward writes dgu [M, 2F] (overwritten).
  virtual void swiglu_forward(const Tensor& gu, Tensor& y) = 0;
  virtual void swiglu_backward(const Tensor& gu, const Tensor& dy, Tensor& dgu) = 0;
  // Embedding lookup of a table that holds rows [offset, offset + V) of a (maybe larger) vocabulary:
  // ids i32 [N], table [V, C], y [N, C]; y[n] = table[ids[n] - offset], or zeros when ids[n] falls
  // outside this table (so the rows of a vocabulary split over ranks add up by an allreduce).
  virtual void embedding_forward(const Tensor& ids, const Tensor& table, int64_t offset, Tensor& y) = 0;
  // dtable[ids[n] - offset] += dy[n] (accumulated) for the ids inside this table.
  virtual void embedding_backward(const Tensor& ids, const Tensor& dy, int64_t offset, Tensor& dtable) = 0;

  // ---- Top-k gradient sparsification (error feedback), so a bucket is compressed where it lives.
  // idx (i32 [k], 0 < k <= n) = the indices of the k largest |x| of x (f32 [n]); equal magnitudes
  // go to the lower index, and idx comes out in ascending order, so every device agrees.
  virtual void topk_abs(const Tensor& x, int64_t k, Tensor& idx) = 0;
  // vals[j] = x[idx[j]], then x[idx[j]] = 0 (what is sent leaves the residual). vals may be
  // undefined to only clear.
  virtual void gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) = 0;
  // y[idx[j]] += vals[j]; the indices of one call are distinct (one rank's top-k).
  virtual void scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) = 0;

  // ---- The other compressors' encodings (comm::Compressor), on the device that holds the bucket.
  // Payloads are u8 tensors that travel by allgather; decoding adds one rank's payload into y, and
  // the compressor decodes the ranks in rank order, so every rank sums the same bits.
  // 1-bit with error feedback (EF-SignSGD): x f32 [n] holds gradient + residual. payload u8
  // [4 + ceil(n/8)]: the f32 scale = mean |x| (f64 sum), then bit i (LSB first) set when x[i] >= 0.
  // x becomes what was not sent: x[i] -= scale * (x[i] >= 0 ? 1 : -1).
  virtual void sign_encode(Tensor& x, Tensor& payload) = 0;
  // y[i] += scale * (bit i ? 1 : -1) from one rank's payload (y f32 [n]).
  virtual void sign_decode_add(const Tensor& payload, Tensor& y) = 0;
  // QSGD (Alistarh et al.) to s = levels in [1, 127]: payload u8 [4 + n]: the f32 norm ||x|| (f64
  // sum), then the int8 levels q[i] = sign(x[i]) * (floor(l) + [u_i < l - floor(l)]), l = |x[i]| s /
  // norm, capped at s, u_i = fn::hash_uniform(seed, i); all zero when the norm is 0.
  virtual void qsgd_encode(const Tensor& x, int levels, uint64_t seed, Tensor& payload) = 0;
  // y[i] += norm * q[i] / s from one rank's payload.
  virtual void qsgd_decode_add(const Tensor& payload, int levels, Tensor& y) = 0;
  // PowerSGD's P: Gram-Schmidt on the columns of m f32 [rows, cols] (row-major), column by column
  // in f64 sums; a column whose norm is below 1e-20 becomes zero.
  virtual void orthonormalize_columns(Tensor& m) = 0;

  // ---- Optimizer updates over flat parameter / gradient / state tensors.
  virtual void sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                          float dampening, float weight_decay, bool nesterov) = 0;
  virtual void adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1, float beta2,
                           float eps, float weight_decay, bool decoupled, int64_t step) = 0;

 protected:
  MathPrecision math_ = MathPrecision::F32;
};

// Sets an engine's math precision for a scope (a compressor's exact fp32 products inside a bf16 run).
class ScopedMathPrecision {
 public:
  ScopedMathPrecision(Engine& e, MathPrecision p) : e_(e), before_(e.math_precision()) { e.set_math_precision(p); }
  ~ScopedMathPrecision() { e_.set_math_precision(before_); }
  ScopedMathPrecision(const ScopedMathPrecision&) = delete;
  ScopedMathPrecision& operator=(const ScopedMathPrecision&) = delete;

 private:
  Engine& e_;
  MathPrecision before_;
};

// The engine of a device: the CPU engine always exists; the CUDA engine registers itself.
Engine& engine_for(Device device);
// Tensor::zeros on any device: a GPU's memory is cleared by its engine (core does not know engines).
Tensor zeros_on(const Shape& shape, Device device, DType dtype = DType::F32);
// Copies between any two places one engine reaches (host-host, host-GPU, GPU-host); same numel
// and dtype. to_host returns a host tensor with t's contents (t itself when it is on the host).
void copy_any(const Tensor& src, Tensor& dst);
Tensor to_host(const Tensor& t);
// A host copy of `src` that shares nothing with it (a checkpoint's snapshot): written into `reuse`
// when that is a host tensor of src's shape and dtype (no allocation and no page faults: how a
// snapshot arena is reused between checkpoints), otherwise a new tensor.
Tensor host_copy(const Tensor& src, const Tensor* reuse = nullptr);
// A host batch on `device` through a page-locked staging buffer (kept in `st`): stage_async then
// take_staged, so the upload is asynchronous and the buffer is rewritten only after the previous
// upload left it (no device sync between batches needed); on the CPU it is `host` itself.
struct StagedTensor {
  Tensor host, device;
  std::shared_ptr<void> uploaded;  // stage_async: the upload's completion (a CUDA event)
};
Tensor stage_to(const Tensor& host, Device device, StagedTensor& st);
// Prefetch: stage_async queues `host`'s upload into st on the GPU's copy stream (after the compute
// work queued so far, which may still read st's previous batch) and returns at once, so the copy
// overlaps the compute queued after it; take_staged then orders the compute stream after that
// upload (an event, no host wait) and returns the device tensor. stage_async first waits for st's
// previous upload to finish before it rewrites the page-locked buffer. On the CPU, take_staged
// returns `host` itself.
void stage_async(const Tensor& host, Device device, StagedTensor& st);
Tensor take_staged(StagedTensor& st);
// Running totals of softmax_xent_accumulate. Stored in f32 tensors of kXentStatsFloats elements (one
// per batch or step: rows of a [n, kXentStatsFloats] tensor), which Engine::fill(t, 0) zeroes;
// xent_stats reads a host copy of one.
struct XentStats {
  double loss_sum = 0;
  uint64_t hits = 0;
  int32_t bad_label = 0;  // nonzero: some label was outside [0, the logits' width)
  int32_t unused = 0;
};
static_assert(sizeof(XentStats) == 24);
inline constexpr int64_t kXentStatsFloats = sizeof(XentStats) / sizeof(float);
XentStats xent_stats(const Tensor& host_row);  // host_row: kXentStatsFloats f32 on the host

inline Engine& cpu_engine() { return engine_for(Device::cpu()); }
using EngineFactory = std::unique_ptr<Engine> (*)(int device_index);
void register_engine(DeviceType type, EngineFactory factory);

// Makes CUDA devices usable (registers the CUDA engine and its caching allocator). Returns the
// number of visible GPUs, 0 when dtrain was built without CUDA or no GPU is visible. Idempotent;
// call it once before creating tensors on Device::cuda(i).
int enable_cuda();

// Library versions compiled in, for `dtrain info`.
std::string onednn_version();
std::string blas_info();

}  // namespace dtrain

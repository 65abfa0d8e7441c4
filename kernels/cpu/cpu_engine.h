#pragma once
// CpuEngine: GEMM, convolution and pooling through oneDNN; normalisation, element-wise ops and
// reductions as OpenMP loops over the shared functors. Private to kernels/.
#include <omp.h>

#include <algorithm>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>

#include "dtrain/kernels/engine.h"

namespace dtrain::cpu {

// Memory the CPU engine computes on: the host's, or the simulated device's (host RAM marked as a
// device's, see Device); never a GPU's.
inline bool cpu_addressable(const Tensor& t) { return t.device().type != DeviceType::CUDA; }

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

inline dnnl::memory::desc plain(const memory::dims& d, tag t) { return memory::desc(d, dt::f32, t); }

// Conversions over n elements with the bits of dtype.h's scalar functions (round to nearest even;
// NaN stays NaN; AVX512-BF16 flushes f32 subnormals to zero), in AVX512-BF16, AVX2 or F16C
// instructions where the processor has them and across OpenMP threads for long arrays. Defined in
// gemm_lowp.cpp.
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n);
// dst[i] = src[i] rounded to the nearest bf16, kept in f32 (bf16 math emulated in fp32).
void round_to_bf16(const float* src, float* dst, int64_t n);
void f32_to_f16(const float* src, uint16_t* dst, int64_t n);
void f16_to_f32(const uint16_t* src, float* dst, int64_t n);
// dst[i] = src[i] rounded to the nearest IEEE half, kept in f32 (fp16 math emulated in fp32).
void round_to_f16(const float* src, float* dst, int64_t n);

// Runs f(begin, count) over [0, n): on the calling thread when n <= grain (a fork/join costs more
// than the work), else one contiguous slice per OpenMP thread, slice starts a multiple of `align`
// (16 floats keeps the vector kernels' slices on whole registers; a row length keeps rows whole).
template <typename F>
void for_slices(int64_t n, int64_t grain, int64_t align, F f) {
  const int threads = n > grain ? omp_get_max_threads() : 1;
  if (threads <= 1) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + align - 1) / align * align;
    const int64_t begin = id * per, end = std::min(n, begin + per);
    if (begin < end) f(begin, end - begin);
  }
}

// A memory in the layout a primitive wants, reordering from/to the user's plain buffer when the
// layouts differ. The scratch buffer lives in the cache entry so a step allocates nothing.
struct Staged {
  memory::desc want;
  memory scratch;  // empty when `want` equals the user's layout
  dnnl::reorder to_prim, from_prim;
  void init(const dnnl::engine& eng, const memory::desc& user, const memory::desc& wanted, bool in, bool out) {
    want = wanted;
    if (wanted != user) {
      scratch = memory(wanted, eng);
      memory u(user, eng, DNNL_MEMORY_NONE);
      if (in) to_prim = dnnl::reorder(u, scratch);
      if (out) from_prim = dnnl::reorder(scratch, u);
    }
  }
  // The memory the primitive should read: the user's data, reordered when needed.
  memory input(const dnnl::engine& eng, dnnl::stream& s, const memory::desc& user, void* data) {
    memory u(user, eng, data);
    if (!scratch) return u;
    to_prim.execute(s, u, scratch);
    return scratch;
  }
  memory output(const dnnl::engine& eng, const memory::desc& user, void* data) {
    return scratch ? scratch : memory(user, eng, data);
  }
  void finish(const dnnl::engine& eng, dnnl::stream& s, const memory::desc& user, void* data) {
    if (!scratch) return;
    memory u(user, eng, data);
    from_prim.execute(s, scratch, u);
  }
};

struct ConvPrims {
  memory::desc x_md, w_md, b_md, y_md;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Staged fx, fw, fy;
  dnnl::convolution_backward_data::primitive_desc bwd_d_pd;
  dnnl::convolution_backward_data bwd_d;
  Staged dy_d, w_d, dx_d;
  dnnl::convolution_backward_weights::primitive_desc bwd_w_pd;
  dnnl::convolution_backward_weights bwd_w;
  Staged x_w, dy_w, dw_w;
  memory dw_tmp, db_tmp;  // backward-weights results, added into the accumulating gradients
};

// A oneDNN matmul for one GEMM shape: bf16 or f32 operands, f32 accumulation and output; a batch of
// GEMMs at fixed strides is one primitive over 3-D descriptors [batch, rows, cols].
struct MatmulPrims {
  memory::desc a_md, b_md, c_md;
  dnnl::matmul prim;
};

// The shape of one matmul primitive (operand type, batch and strides, transposes, scalars).
struct MatmulShape {
  dt operands;
  int64_t batch;
  bool ta, tb;
  int64_t m, n, k, sa, sb, sc;
  float alpha, beta;
  std::string key() const;
};

// Matmul primitives by shape, least recently used first out past `capacity` entries: a model has a
// handful of GEMM shapes, but a run that keeps changing shapes (generation with a growing context)
// must not keep a primitive for each. Primitives use oneDNN's library-managed scratchpad, which is
// shared between primitives, so a cached primitive holds no large buffer of its own.
class MatmulCache {
 public:
  explicit MatmulCache(size_t capacity) : capacity_(capacity) {}
  // The cached primitive for `shape`, created by `make` on a miss; null when `make` returns null.
  template <typename Make>
  std::shared_ptr<MatmulPrims> get(const MatmulShape& shape, Make make) {
    const std::string key = shape.key();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return it->second->second;
    }
    std::shared_ptr<MatmulPrims> p = make(shape);
    order_.emplace_front(key, p);
    index_[key] = order_.begin();
    if (order_.size() > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return p;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_.size();
  }

 private:
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<MatmulPrims>>> order_;  // most recent first
  std::unordered_map<std::string, decltype(order_)::iterator> index_;
};

struct PoolPrims {
  memory::desc x_md, y_md;
  dnnl::pooling_forward::primitive_desc fwd_pd;
  dnnl::pooling_forward fwd;
  dnnl::pooling_backward::primitive_desc bwd_pd;
  dnnl::pooling_backward bwd;
  size_t workspace_bytes = 0;
  // Max pooling by the engine's own loops (max_pool_forward/backward in conv_pool.cpp) where oneDNN
  // has only a reference implementation for plain NCHW ("simple_nchw" on processors without
  // AVX-512: 12 ms for a 64x16x28x28 forward, against well under 1 ms for the loop).
  bool own_max = false;
};

class CpuEngine final : public Engine {
 public:
  // On the host, or on the simulated device (Device::sim), whose memory is host memory too.
  explicit CpuEngine(Device device = Device::cpu());
  Device device() const override { return device_; }
  std::string describe() const override;
  std::string precision_note() const override;
  // A bf16 precision permits bf16, it does not demand it: a GEMM with fewer than 16 rows or columns
  // (the 10-class classifier) runs faster in fp32 than with the bf16 rounding and matmul set-up.
  bool rounds_gemm(int64_t m, int64_t n) const override {
    return math_ == MathPrecision::F16 || (math_ == MathPrecision::BF16 && std::min(m, n) >= 16);
  }
  // The fused attention of kernels/attention/ in the widest instruction set the processor has.
  FusedAttention* fused_attention() override;
  void set_threads(int threads) override;
  int threads() const override { return threads_; }
  // The oneDNN engine and stream every CPU primitive runs on (the int8 primitives of int8.cpp too).
  dnnl::engine& dnnl_engine() { return eng_; }
  dnnl::stream& dnnl_stream() { return strm_; }

  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a, const Tensor& b,
            float beta, Tensor& c) override;
  void gemm_batched(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                    int64_t sa, const Tensor& b, int64_t sb, float beta, Tensor& c, int64_t sc) override;

  void conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) override;
  void conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx) override;
  void conv2d_backward_weights(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                               Tensor& dbias) override;
  void pool2d_forward(const Pool2dGeom& g, PoolKind kind, const Tensor& x, Tensor& y, Tensor* state) override;
  void pool2d_backward(const Pool2dGeom& g, PoolKind kind, const Tensor& dy, const Tensor& state, Tensor& dx) override;

  void batchnorm_forward_train(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta, float eps,
                               float momentum, Tensor& running_mean, Tensor& running_var, Tensor& save_mean,
                               Tensor& save_invstd, Tensor& y) override;
  void batchnorm_forward_infer(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta, float eps,
                               const Tensor& running_mean, const Tensor& running_var, Tensor& y) override;
  void batchnorm_backward(const Tensor& x, const Tensor& dy, int64_t channels, const Tensor& gamma,
                          const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                          Tensor& dbeta) override;
  void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& mean,
                         Tensor& rstd, Tensor& y) override;
  void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& rstd, Tensor& y) override;
  void rmsnorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, Tensor& dx,
                        Tensor& dgamma) override;

  void channel_sums(const Tensor& x, int64_t channels, Tensor& sum, Tensor& sumsq) override;
  void channel_dot(const Tensor& a, const Tensor& b, int64_t channels, Tensor& out) override;
  void channel_affine(const Tensor& x, int64_t channels, const Tensor& scale, const Tensor& shift, Tensor& y) override;

  void unary_forward(Unary op, const Tensor& x, Tensor& y) override;
  void unary_backward(Unary op, const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void dropout_forward(const Tensor& x, float p, uint64_t seed, Tensor& mask, Tensor& y) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& y) override;
  void add(const Tensor& a, const Tensor& b, Tensor& y) override;
  void axpy(float alpha, const Tensor& x, Tensor& y) override;
  void scale(Tensor& y, float alpha) override;
  void fill(Tensor& y, float value) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void add_row_bias(Tensor& y, const Tensor& bias) override;
  void row_bias_grad(const Tensor& dy, Tensor& dbias) override;
  double sum_squares(const Tensor& x) override;
  bool all_finite(const Tensor& x) override;
  void unscale_and_check(Tensor& x, float inv_scale, Tensor& found_inf) override;

  double softmax_xent_forward(const Tensor& logits, const Tensor& labels, Tensor& probs, int64_t* correct) override;
  void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, Tensor& probs, Tensor& stats) override;
  void softmax_xent_backward(const Tensor& probs, const Tensor& labels, float scale, Tensor& dlogits) override;

  void permute_0213(const Tensor& x, int64_t a, int64_t b, int64_t c, int64_t d, Tensor& y) override;
  void attention_softmax_forward(const Tensor& scores, int64_t t, float scale, bool causal, Tensor& probs) override;
  void attention_softmax_backward(const Tensor& probs, const Tensor& dprobs, int64_t t, float scale, bool causal,
                                  Tensor& dscores) override;
  void row_max(const Tensor& x, Tensor& out) override;
  void softmax_rows(const Tensor& x, float scale, Tensor& y) override;
  void vocab_xent_partials(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                           Tensor& sumexp, Tensor& target) override;
  void vocab_xent_backward(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                           const Tensor& sumexp, float scale, Tensor& dlogits) override;
  void vocab_xent_loss_accumulate(const Tensor& rowmax, const Tensor& sumexp, const Tensor& target,
                                  const Tensor& labels, Tensor& stats) override;
  void rotary(const Tensor& x, int64_t t, const Tensor& table, int64_t pos0, bool inverse, Tensor& y) override;
  void swiglu_forward(const Tensor& gu, Tensor& y) override;
  void swiglu_backward(const Tensor& gu, const Tensor& dy, Tensor& dgu) override;
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t offset, Tensor& y) override;
  void embedding_backward(const Tensor& ids, const Tensor& dy, int64_t offset, Tensor& dtable) override;

  void topk_abs(const Tensor& x, int64_t k, Tensor& idx) override;
  void gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) override;
  void scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) override;
  // compress.cpp
  void sign_encode(Tensor& x, Tensor& payload) override;
  void sign_decode_add(const Tensor& payload, Tensor& y) override;
  void qsgd_encode(const Tensor& x, int levels, uint64_t seed, Tensor& payload) override;
  void qsgd_decode_add(const Tensor& payload, int levels, Tensor& y) override;
  void orthonormalize_columns(Tensor& m) override;

  void sgd_update(Tensor& param, const Tensor& grad, Tensor& buf, float lr, float momentum, float dampening,
                  float weight_decay, bool nesterov) override;
  void adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1, float beta2,
                   float eps, float weight_decay, bool decoupled, int64_t step) override;

 private:
  // gemm_batched with bf16/f16 operands or a bf16/f16 math precision (kernels/cpu/gemm_lowp.cpp).
  void gemm_lowp(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                 int64_t sa, const Tensor& b, int64_t sb, float beta, Tensor& c, int64_t sc);
  // One oneDNN matmul for the whole batch (null when oneDNN has no implementation for the strides).
  std::shared_ptr<MatmulPrims> matmul_prims(const MatmulShape& shape);
  // The batch of f32 GEMMs as one f32 matmul; false when there is none for this shape.
  bool gemm_batched_f32_matmul(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                               const float* a, int64_t sa, const float* b, int64_t sb, float beta, float* c,
                               int64_t sc);
  ConvPrims& conv_prims(const Conv2dGeom& g);
  std::unique_ptr<ConvPrims> make_conv_prims(const Conv2dGeom& g, bool bf16);
  // bf16 convolution math without bf16 primitives (an AVX2-only processor): the inputs are rounded
  // to bf16 values held in f32, and the f32 primitives run on them.
  bool emulate_bf16_conv() const { return math_ == MathPrecision::BF16 && !conv_bf16_native_; }
  const void* conv_input(const Tensor& t, std::vector<float>& rounded) const;
  PoolPrims& pool_prims(const Pool2dGeom& g, PoolKind kind);

  dnnl::engine eng_;
  dnnl::stream strm_;
  int threads_ = 1;
  Device device_;
  std::mutex cache_mu_;
  std::unordered_map<std::string, std::unique_ptr<ConvPrims>> conv_cache_;
  bool conv_bf16_native_ = true;  // false once oneDNN has refused a bf16 convolution here
  std::unordered_map<std::string, std::unique_ptr<PoolPrims>> pool_cache_;
  MatmulCache matmul_cache_{64};
};

}  // namespace dtrain::cpu

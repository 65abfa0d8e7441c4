#pragma once
// CudaEngine: the Engine contract on one GPU. GEMMs through cuBLASLt (cuda_gemm.cpp), convolution,
// pooling and BatchNorm through cuDNN's legacy API (cuda_dnn.cpp), everything else through the .cu
// kernels of kernels.h. All work is queued on one compute stream; methods that return a value to
// the host (losses, norms, finiteness) synchronise that stream, the others return at once.
// Private to kernels/cuda/.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "dtrain/kernels/engine.h"

namespace dtrain::cuda {

struct GemmPlan;  // cuda_gemm.cpp
struct ConvPlan;  // cuda_dnn.cpp
struct PoolPlan;
struct BnPlan;

// What one cuBLASLt call may use as workspace (its heuristics are asked for no more).
inline constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

class CudaEngine final : public Engine {
 public:
  explicit CudaEngine(int device_index);
  ~CudaEngine() override;
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  Device device() const override { return Device::cuda(index_); }
  std::string describe() const override;
  void set_threads(int threads) override { threads_ = threads; }  // host threads do not matter here
  int threads() const override { return threads_; }
  void synchronize() override;

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

  void topk_abs(const Tensor& x, int64_t k, Tensor& idx) override;  // cuda_compress.cpp (CUB radix sort)
  void gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) override;
  void scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) override;
  // cuda_compress.cpp (compress.cu)
  void sign_encode(Tensor& x, Tensor& payload) override;
  void sign_decode_add(const Tensor& payload, Tensor& y) override;
  void qsgd_encode(const Tensor& x, int levels, uint64_t seed, Tensor& payload) override;
  void qsgd_decode_add(const Tensor& payload, int levels, Tensor& y) override;
  void orthonormalize_columns(Tensor& m) override;

  void sgd_update(Tensor& param, const Tensor& grad, Tensor& buf, float lr, float momentum, float dampening,
                  float weight_decay, bool nesterov) override;
  void adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1, float beta2,
                   float eps, float weight_decay, bool decoupled, int64_t step) override;

  cudaStream_t compute() const { return compute_; }
  cudaStream_t comm() const { return comm_; }
  void comm_waits_for_compute();
  void compute_waits_for_comm();
  // See cuda::upload_async: the copy on copy_, after the compute stream's work so far.
  cudaEvent_t upload_async(const Tensor& pinned_src, Tensor& dst);
  void compute_waits_for(cudaEvent_t ev);

 private:
  // Makes this engine's device current for the calling thread (engines of several GPUs may share one).
  void bind() const;
  // Device scratch of at least `bytes` for cuBLASLt / cuDNN workspaces, grown (rarely) and kept.
  void* workspace(size_t bytes);
  // A device tensor of `like`'s element count in `dtype`, holding `like` cast (the low-precision
  // operand copies of mixed precision); memory from the caching allocator.
  Tensor lowp_copy(const Tensor& like, DType dtype);
  // An f32 device tensor of src's values rounded to bf16 (convolution operands under BF16).
  Tensor bf16_rounded(const Tensor& src);
  GemmPlan& gemm_plan(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t batch, int64_t sa, int64_t sb,
                      int64_t sc, DType in, bool tf32, const void* pa, const void* pb, const void* pc);
  ConvPlan& conv_plan(const Conv2dGeom& g, DType dtype);
  PoolPlan& pool_plan(const Pool2dGeom& g, PoolKind kind);
  BnPlan& bn_plan(const Tensor& x, int64_t channels);
  // Copies `count` values from the device scratch area to the host after a stream sync.
  void read_back(const void* dev, void* host, size_t bytes);

  int index_;
  int threads_ = 1;
  cudaStream_t compute_ = nullptr, comm_ = nullptr, copy_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  cudnnHandle_t dnn_ = nullptr;
  Tensor workspace_;              // u8, grows to the largest workspace asked for
  Tensor scalars_;                // u8 [64]: device-side results of reductions
  void* host_scalars_ = nullptr;  // pinned [64], where they are read back
  std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<GemmPlan>> gemm_plans_;
  std::unordered_map<std::string, std::unique_ptr<ConvPlan>> conv_plans_;
  std::unordered_map<std::string, std::unique_ptr<PoolPlan>> pool_plans_;
  std::unordered_map<std::string, std::unique_ptr<BnPlan>> bn_plans_;
};

// The engine of cuda:`index` (through engine_for), checked to be a CudaEngine.
CudaEngine& cuda_engine(int index);

}  // namespace dtrain::cuda

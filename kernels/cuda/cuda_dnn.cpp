// Convolution, pooling and BatchNorm on the CUDA engine through cuDNN 9's legacy API (still shipped
// in cudnn_cnn.h / cudnn_ops.h, and simpler than the graph API for these fixed NCHW layers).
// Descriptors and the fastest algorithms (cudnnFind*, measured once per shape) are cached.
// Mixed precision: under BF16/F16 the inputs are cast to that type, cuDNN runs on tensor cores with
// f32 accumulation, and results are cast back to f32 (gradients of weights then accumulated in f32).
#include <sstream>

#include "cuda_common.h"
#include "cuda_engine.h"
#include "kernels.h"
#include "plans.h"

namespace dtrain::cuda {

namespace {

constexpr size_t kConvWorkspaceLimit = size_t{256} << 20;

cudnnDataType_t dnn_type(DType t) {
  switch (t) {
    case DType::BF16:
      return CUDNN_DATA_BFLOAT16;
    case DType::F16:
      return CUDNN_DATA_HALF;
    default:
      return CUDNN_DATA_FLOAT;
  }
}

cudnnTensorDescriptor_t tensor4d(DType t, int64_t n, int64_t c, int64_t h, int64_t w) {
  cudnnTensorDescriptor_t d = nullptr;
  DT_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
  DT_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, dnn_type(t), static_cast<int>(n), static_cast<int>(c),
                                            static_cast<int>(h), static_cast<int>(w)));
  return d;
}

// The first result that succeeded and fits the workspace limit (cudnnFind* sorts by time).
template <typename Perf>
const Perf& pick(const Perf* perf, int count, const char* what) {
  for (int i = 0; i < count; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].memory <= kConvWorkspaceLimit) return perf[i];
  DT_CHECK(false, "cuDNN found no usable " << what << " algorithm");
  __builtin_unreachable();
}

void check_geom(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& y) {
  DT_CHECK(x.numel() == g.n * g.c * g.h * g.w && w.numel() == g.k * g.c * g.r * g.s &&
               y.numel() == g.n * g.k * g.out_h() * g.out_w(),
           "conv2d geometry does not match tensors x " << x.str() << ", w " << w.str() << ", y " << y.str());
}

}  // namespace

ConvPlan& CudaEngine::conv_plan(const Conv2dGeom& g, DType dtype) {
  std::ostringstream key;
  key << static_cast<int>(dtype) << static_cast<int>(math_) << ':' << g.n << ',' << g.c << ',' << g.h << ',' << g.w
      << ',' << g.k << ',' << g.r << ',' << g.s << ',' << g.stride << ',' << g.pad;
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = conv_plans_[key.str()];
  if (slot) return *slot;
  auto p = std::make_unique<ConvPlan>();
  p->x = tensor4d(dtype, g.n, g.c, g.h, g.w);
  p->y = tensor4d(dtype, g.n, g.k, g.out_h(), g.out_w());
  p->bias = tensor4d(DType::F32, 1, g.k, 1, 1);
  DT_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  DT_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, dnn_type(dtype), CUDNN_TENSOR_NCHW, static_cast<int>(g.k),
                                            static_cast<int>(g.c), static_cast<int>(g.r), static_cast<int>(g.s)));
  DT_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
  int pad = static_cast<int>(g.pad), st = static_cast<int>(g.stride);
  DT_CUDNN_CHECK(
      cudnnSetConvolution2dDescriptor(p->conv, pad, pad, st, st, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  // Strict fp32 unless TF32 tensor cores are allowed: under TF32, and under BF16, whose operands
  // arrive rounded to bf16 (exact in TF32); tensor cores for 16-bit data.
  cudnnMathType_t math = dtype != DType::F32                                            ? CUDNN_TENSOR_OP_MATH
                         : math_ == MathPrecision::TF32 || math_ == MathPrecision::BF16 ? CUDNN_DEFAULT_MATH
                                                                                        : CUDNN_FMA_MATH;
  DT_CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, math));
  slot = std::move(p);
  return *slot;
}

// The algorithm search runs on first use of a shape with real buffers, so it measures the kernels
// that will run. It allocates its own scratch: warm-up only.
static void search(cudnnHandle_t h, ConvPlan& p) {
  if (p.searched) return;
  constexpr int kMax = 8;
  int found = 0;
  cudnnConvolutionFwdAlgoPerf_t fwd[kMax];
  DT_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithm(h, p.x, p.w, p.conv, p.y, kMax, &found, fwd));
  const auto& f = pick(fwd, found, "forward convolution");
  p.fwd = f.algo;
  p.fwd_ws = f.memory;
  cudnnConvolutionBwdDataAlgoPerf_t bd[kMax];
  DT_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithm(h, p.w, p.y, p.conv, p.x, kMax, &found, bd));
  const auto& d = pick(bd, found, "backward-data convolution");
  p.bwd_data = d.algo;
  p.bwd_data_ws = d.memory;
  cudnnConvolutionBwdFilterAlgoPerf_t bf[kMax];
  DT_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithm(h, p.x, p.y, p.conv, p.w, kMax, &found, bf));
  const auto& w = pick(bf, found, "backward-filter convolution");
  p.bwd_filter = w.algo;
  p.bwd_filter_ws = w.memory;
  p.searched = true;
}

// Mixed precision as on the CPU engine: under BF16 the operands (x and w forward, w and dy for
// d(input), x and dy for d(weights)) are rounded to bf16 and the convolution runs on f32 data with
// TF32 tensor cores, where a bf16 value is exact, so the products are the bf16 products, summed in
// f32 into f32 results (cuDNN's legacy API would write bf16 outputs and gradients from bf16
// inputs). Under F16 convolutions stay fp32, as the CPU engine keeps them.
Tensor CudaEngine::bf16_rounded(const Tensor& src) {
  Tensor r = Tensor::empty({src.numel()}, DType::F32, device());
  k::round_to_bf16(src.device_data<float>(), r.device_data<float>(), src.numel(), compute_);
  return r;
}

void CudaEngine::conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  check_geom(g, x, w, y);
  DT_CHECK(x.dtype() == DType::F32 && w.dtype() == DType::F32 && y.dtype() == DType::F32 && x.device() == device() &&
               w.device() == device() && y.device() == device(),
           "conv2d_forward on " << device().str() << " takes f32 tensors on it, got " << x.str() << ", " << w.str()
                                << ", " << y.str());
  bind();
  ConvPlan& p = conv_plan(g, DType::F32);
  search(dnn_, p);
  const float one = 1.f, zero = 0.f;
  const bool bf16 = math_ == MathPrecision::BF16;
  Tensor xr = bf16 ? bf16_rounded(x) : x, wr = bf16 ? bf16_rounded(w) : w;
  DT_CUDNN_CHECK(cudnnConvolutionForward(dnn_, &one, p.x, xr.device_raw(), p.w, wr.device_raw(), p.conv, p.fwd,
                                         workspace(p.fwd_ws), p.fwd_ws, &zero, p.y, y.device_raw()));
  if (bias.defined()) {
    DT_CHECK(bias.numel() == g.k && bias.device() == device(),
             "conv bias " << bias.str() << " for " << g.k << " output channels");
    cudnnTensorDescriptor_t yd = tensor4d(DType::F32, g.n, g.k, g.out_h(), g.out_w());
    cudnnStatus_t st = cudnnAddTensor(dnn_, &one, p.bias, bias.device_raw(), &one, yd, y.device_raw());
    cudnnDestroyTensorDescriptor(yd);
    DT_CUDNN_CHECK(st);
  }
}

void CudaEngine::conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx) {
  check_geom(g, dx, w, dy);
  DT_CHECK(dy.dtype() == DType::F32 && w.dtype() == DType::F32 && dx.dtype() == DType::F32 && dy.device() == device() &&
               w.device() == device() && dx.device() == device(),
           "conv2d_backward_data on " << device().str() << " takes f32 tensors on it, got " << dy.str() << ", "
                                      << w.str() << ", " << dx.str());
  bind();
  ConvPlan& p = conv_plan(g, DType::F32);
  search(dnn_, p);
  const float one = 1.f, zero = 0.f;
  const bool bf16 = math_ == MathPrecision::BF16;
  Tensor wr = bf16 ? bf16_rounded(w) : w, dyr = bf16 ? bf16_rounded(dy) : dy;
  DT_CUDNN_CHECK(cudnnConvolutionBackwardData(dnn_, &one, p.w, wr.device_raw(), p.y, dyr.device_raw(), p.conv,
                                              p.bwd_data, workspace(p.bwd_data_ws), p.bwd_data_ws, &zero, p.x,
                                              dx.device_raw()));
}

void CudaEngine::conv2d_backward_weights(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                         Tensor& dbias) {
  check_geom(g, x, dw, dy);
  DT_CHECK(x.dtype() == DType::F32 && dy.dtype() == DType::F32 && dw.dtype() == DType::F32 && x.device() == device() &&
               dy.device() == device() && dw.device() == device(),
           "conv2d_backward_weights on " << device().str() << " takes f32 tensors on it, got " << x.str() << ", "
                                         << dy.str() << ", " << dw.str());
  bind();
  ConvPlan& p = conv_plan(g, DType::F32);
  search(dnn_, p);
  const float one = 1.f;
  const bool bf16 = math_ == MathPrecision::BF16;
  Tensor xr = bf16 ? bf16_rounded(x) : x, dyr = bf16 ? bf16_rounded(dy) : dy;
  // beta = 1: gradients accumulate (engine contract), in f32.
  DT_CUDNN_CHECK(cudnnConvolutionBackwardFilter(dnn_, &one, p.x, xr.device_raw(), p.y, dyr.device_raw(), p.conv,
                                                p.bwd_filter, workspace(p.bwd_filter_ws), p.bwd_filter_ws, &one, p.w,
                                                dw.device_raw()));
  if (dbias.defined()) {
    DT_CHECK(dbias.numel() == g.k && dbias.device() == device(), "conv dbias " << dbias.str());
    cudnnTensorDescriptor_t yd = tensor4d(DType::F32, g.n, g.k, g.out_h(), g.out_w());
    cudnnStatus_t st = cudnnConvolutionBackwardBias(dnn_, &one, yd, dy.device_raw(), &one, p.bias, dbias.device_raw());
    cudnnDestroyTensorDescriptor(yd);
    DT_CUDNN_CHECK(st);
  }
}

// ------------------------------------------------------------------ pooling
PoolPlan& CudaEngine::pool_plan(const Pool2dGeom& g, PoolKind kind) {
  std::ostringstream key;
  key << static_cast<int>(kind) << ':' << g.n << ',' << g.c << ',' << g.h << ',' << g.w << ',' << g.kernel << ','
      << g.stride << ',' << g.pad;
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = pool_plans_[key.str()];
  if (slot) return *slot;
  auto p = std::make_unique<PoolPlan>();
  p->x = tensor4d(DType::F32, g.n, g.c, g.h, g.w);
  p->y = tensor4d(DType::F32, g.n, g.c, g.out_h(), g.out_w());
  DT_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&p->pool));
  // Average pooling counts the padding, as the CPU engine (and PyTorch's default) does.
  auto mode = kind == PoolKind::Max ? CUDNN_POOLING_MAX : CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING;
  int k = static_cast<int>(g.kernel), s = static_cast<int>(g.stride), pad = static_cast<int>(g.pad);
  DT_CUDNN_CHECK(cudnnSetPooling2dDescriptor(p->pool, mode, CUDNN_NOT_PROPAGATE_NAN, k, k, pad, pad, s, s));
  slot = std::move(p);
  return *slot;
}

// cuDNN's max-pool backward needs x and y instead of an argmax, so the training forward keeps
// copies of both in `state` ([x | y], f32); average pooling needs no state.
void CudaEngine::pool2d_forward(const Pool2dGeom& g, PoolKind kind, const Tensor& x, Tensor& y, Tensor* state) {
  const int64_t nx = g.n * g.c * g.h * g.w, ny = g.n * g.c * g.out_h() * g.out_w();
  DT_CHECK(x.numel() == nx && y.numel() == ny && x.device() == device() && y.device() == device(),
           "pool2d geometry does not match x " << x.str() << ", y " << y.str());
  bind();
  PoolPlan& p = pool_plan(g, kind);
  const float one = 1.f, zero = 0.f;
  DT_CUDNN_CHECK(cudnnPoolingForward(dnn_, p.pool, &one, p.x, x.device_raw(), &zero, p.y, y.device_raw()));
  if (state && kind == PoolKind::Max) {
    if (!state->defined() || state->numel() != nx + ny || state->device() != device())
      *state = Tensor::empty({nx + ny}, DType::F32, device());
    DT_CUDA_CHECK(cudaMemcpyAsync(state->device_f32(), x.device_raw(), x.nbytes(), cudaMemcpyDeviceToDevice, compute_));
    DT_CUDA_CHECK(
        cudaMemcpyAsync(state->device_f32() + nx, y.device_raw(), y.nbytes(), cudaMemcpyDeviceToDevice, compute_));
  }
}

void CudaEngine::pool2d_backward(const Pool2dGeom& g, PoolKind kind, const Tensor& dy, const Tensor& state,
                                 Tensor& dx) {
  const int64_t nx = g.n * g.c * g.h * g.w, ny = g.n * g.c * g.out_h() * g.out_w();
  DT_CHECK(dx.numel() == nx && dy.numel() == ny, "pool2d_backward geometry: dy " << dy.str() << ", dx " << dx.str());
  bind();
  PoolPlan& p = pool_plan(g, kind);
  const float one = 1.f, zero = 0.f;
  // Average pooling reads neither x nor y; dy and dx stand in for them.
  const void* xs = dx.device_raw();
  const void* ys = dy.device_raw();
  if (kind == PoolKind::Max) {
    DT_CHECK(state.defined() && state.numel() == nx + ny,
             "max-pool backward needs the state saved by a training forward");
    xs = state.device_f32();
    ys = state.device_f32() + nx;
  }
  DT_CUDNN_CHECK(
      cudnnPoolingBackward(dnn_, p.pool, &one, p.y, ys, p.y, dy.device_raw(), p.x, xs, &zero, p.x, dx.device_raw()));
}

// ------------------------------------------------------------------ BatchNorm
BnPlan& CudaEngine::bn_plan(const Tensor& x, int64_t channels) {
  DT_CHECK(x.dim() >= 2 && x.size(1) == channels && x.device() == device() && x.dtype() == DType::F32,
           "batchnorm over " << channels << " channels of " << x.str());
  const int64_t n = x.size(0), hw = x.numel() / (x.size(0) * channels);
  std::ostringstream key;
  key << n << ',' << channels << ',' << hw;
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = bn_plans_[key.str()];
  if (slot) return *slot;
  auto p = std::make_unique<BnPlan>();
  p->x = tensor4d(DType::F32, n, channels, hw, 1);
  p->param = tensor4d(DType::F32, 1, channels, 1, 1);
  slot = std::move(p);
  return *slot;
}

// cuDNN's spatial BatchNorm matches the contract: biased variance to normalise, unbiased for the
// running variance, running = (1 - momentum) * running + momentum * batch, saved inverse std.
void CudaEngine::batchnorm_forward_train(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                         float eps, float momentum, Tensor& running_mean, Tensor& running_var,
                                         Tensor& save_mean, Tensor& save_invstd, Tensor& y) {
  BnPlan& p = bn_plan(x, channels);
  DT_CHECK(eps >= CUDNN_BN_MIN_EPSILON,
           "batchnorm eps " << eps << " is below cuDNN's minimum " << CUDNN_BN_MIN_EPSILON);
  bind();
  const float one = 1.f, zero = 0.f;
  DT_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
      dnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, p.x, x.device_raw(), p.x, y.device_raw(), p.param, gamma.device_raw(),
      beta.device_raw(), momentum, running_mean.device_raw(), running_var.device_raw(), eps, save_mean.device_raw(),
      save_invstd.device_raw()));
}

void CudaEngine::batchnorm_forward_infer(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                         float eps, const Tensor& running_mean, const Tensor& running_var, Tensor& y) {
  BnPlan& p = bn_plan(x, channels);
  DT_CHECK(eps >= CUDNN_BN_MIN_EPSILON,
           "batchnorm eps " << eps << " is below cuDNN's minimum " << CUDNN_BN_MIN_EPSILON);
  bind();
  const float one = 1.f, zero = 0.f;
  DT_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
      dnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, p.x, x.device_raw(), p.x, y.device_raw(), p.param, gamma.device_raw(),
      beta.device_raw(), running_mean.device_raw(), running_var.device_raw(), eps));
}

void CudaEngine::batchnorm_backward(const Tensor& x, const Tensor& dy, int64_t channels, const Tensor& gamma,
                                    const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                                    Tensor& dbeta) {
  BnPlan& p = bn_plan(x, channels);
  bind();
  // Parameter gradients accumulate (beta_param = 1), dx is overwritten. eps is unused when the
  // saved statistics are passed; cuDNN's minimum is given.
  const float one = 1.f, zero = 0.f;
  DT_CUDNN_CHECK(cudnnBatchNormalizationBackward(
      dnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, &one, &one, p.x, x.device_raw(), p.x, dy.device_raw(), p.x,
      dx.device_raw(), p.param, gamma.device_raw(), dgamma.device_raw(), dbeta.device_raw(), CUDNN_BN_MIN_EPSILON,
      save_mean.device_raw(), save_invstd.device_raw()));
}

}  // namespace dtrain::cuda

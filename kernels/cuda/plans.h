#pragma once
// Per-shape plans the CUDA engine caches: library descriptors and the algorithm chosen for a
// shape, built on first use (warm-up) and reused by every later step. Private to kernels/cuda/.
#include <cublasLt.h>
#include <cudnn.h>

#include <cstddef>

namespace dtrain::cuda {

// One cuBLASLt matmul shape: descriptors and the heuristic's best algorithm.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// One convolution shape and data type: descriptors and the algorithms cudnnFind* measured fastest.
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t fwd{};
  cudnnConvolutionBwdDataAlgo_t bwd_data{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
  size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;
  bool searched = false;
  ConvPlan() = default;
  ConvPlan(const ConvPlan&) = delete;
  ConvPlan& operator=(const ConvPlan&) = delete;
  ~ConvPlan() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (bias) cudnnDestroyTensorDescriptor(bias);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
  }
};

struct PoolPlan {
  cudnnPoolingDescriptor_t pool = nullptr;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  PoolPlan() = default;
  PoolPlan(const PoolPlan&) = delete;
  PoolPlan& operator=(const PoolPlan&) = delete;
  ~PoolPlan() {
    if (pool) cudnnDestroyPoolingDescriptor(pool);
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
  }
};

// BatchNorm over x viewed as [N, C, HW, 1]; `param` is [1, C, 1, 1].
struct BnPlan {
  cudnnTensorDescriptor_t x = nullptr, param = nullptr;
  BnPlan() = default;
  BnPlan(const BnPlan&) = delete;
  BnPlan& operator=(const BnPlan&) = delete;
  ~BnPlan() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (param) cudnnDestroyTensorDescriptor(param);
  }
};

}  // namespace dtrain::cuda

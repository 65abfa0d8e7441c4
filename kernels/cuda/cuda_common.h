#pragma once
// Error checks for the CUDA engine's host code: one macro per library (CUDA runtime, cuBLASLt,
// cuDNN). Each throws dtrain::Error with file:line, the rank context and the library's own string.
#include <cuda_runtime.h>

#include "dtrain/core/error.h"

#define DT_CUDA_CHECK(expr)                                                                                            \
  do {                                                                                                                 \
    cudaError_t dt_err_ = (expr);                                                                                      \
    if (dt_err_ != cudaSuccess)                                                                                        \
      ::dtrain::detail::throw_error("cuda", DT_STR(#expr << ": " << cudaGetErrorString(dt_err_)), __FILE__, __LINE__); \
  } while (0)

#define DT_CUBLAS_CHECK(expr)                                                                                     \
  do {                                                                                                            \
    cublasStatus_t dt_st_ = (expr);                                                                               \
    if (dt_st_ != CUBLAS_STATUS_SUCCESS)                                                                          \
      ::dtrain::detail::throw_error("cublas", DT_STR(#expr << ": status " << static_cast<int>(dt_st_)), __FILE__, \
                                    __LINE__);                                                                    \
  } while (0)

#define DT_CUDNN_CHECK(expr)                                                                                 \
  do {                                                                                                       \
    cudnnStatus_t dt_st_ = (expr);                                                                           \
    if (dt_st_ != CUDNN_STATUS_SUCCESS)                                                                      \
      ::dtrain::detail::throw_error("cudnn", DT_STR(#expr << ": " << cudnnGetErrorString(dt_st_)), __FILE__, \
                                    __LINE__);                                                               \
  } while (0)

// After a kernel launch (<<<...>>>): a launch that failed (no kernel image for this GPU, a bad
// configuration) throws here, where it happened, instead of leaving garbage results and an error
// that a later, unrelated call would report.
#define DT_CUDA_LAUNCHED() DT_CUDA_CHECK(cudaGetLastError())

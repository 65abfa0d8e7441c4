// cuBLASLt, loaded on first use. Only mapping libcublasLt costs about 150 MiB of resident memory
// (measured: a program that merely links it starts at 150 MiB; cudart, cuDNN and NCCL cost under
// 3 MiB each), which a CPU-only run of a CUDA build should not pay. So the engine's 13 cuBLASLt
// entry points are defined here and forward to the library, opened by dlopen the first time a
// CUDA engine creates its handle. The declarations come from cublasLt.h, so the signatures and C
// linkage are checked by the compiler.
#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

#include "dtrain/core/error.h"

namespace {

#define DT_LT_STR2(x) #x
#define DT_LT_STR(x) DT_LT_STR2(x)

void* library() {
  static void* handle = [] {
    void* h = dlopen("libcublasLt.so." DT_LT_STR(CUBLAS_VER_MAJOR), RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
    return h;
  }();
  return handle;
}

template <typename Fn>
Fn resolve(const char* name) {
  void* h = library();
  DT_CHECK(h, "cuBLASLt (libcublasLt.so) could not be loaded: " << dlerror());
  void* s = dlsym(h, name);
  DT_CHECK(s, "cuBLASLt has no symbol " << name);
  return reinterpret_cast<Fn>(s);
}

}  // namespace

#define DT_LT_CALL(name, ...)                                       \
  static const auto fn = resolve<decltype(&::name)>(#name);          \
  return fn(__VA_ARGS__)

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { DT_LT_CALL(cublasLtCreate, h); }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { DT_LT_CALL(cublasLtDestroy, h); }
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* ws, size_t ws_bytes, cudaStream_t stream) {
  DT_LT_CALL(cublasLtMatmul, h, desc, alpha, A, a, B, b, beta, C, c, D, d, algo, ws, ws_bytes, stream);
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  DT_LT_CALL(cublasLtMatmulAlgoGetHeuristic, h, desc, a, b, c, d, pref, requested, results, returned);
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  DT_LT_CALL(cublasLtMatmulDescCreate, desc, compute, scale);
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) { DT_LT_CALL(cublasLtMatmulDescDestroy, desc); }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  DT_LT_CALL(cublasLtMatmulDescSetAttribute, desc, attr, buf, bytes);
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  DT_LT_CALL(cublasLtMatmulPreferenceCreate, pref);
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  DT_LT_CALL(cublasLtMatmulPreferenceDestroy, pref);
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  DT_LT_CALL(cublasLtMatmulPreferenceSetAttribute, pref, attr, buf, bytes);
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  DT_LT_CALL(cublasLtMatrixLayoutCreate, layout, type, rows, cols, ld);
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  DT_LT_CALL(cublasLtMatrixLayoutDestroy, layout);
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t bytes) {
  DT_LT_CALL(cublasLtMatrixLayoutSetAttribute, layout, attr, buf, bytes);
}

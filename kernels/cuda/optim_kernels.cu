// Optimizer updates over flat f32 tensors [n]: the SgdStep / AdamStep functors of
// dtrain/kernels/functors.h, one element per thread (grid-stride).
#include "cuda_common.h"
#include "dtrain/kernels/functors.h"
#include "kernels.h"

namespace dtrain::cuda::k {

namespace {

inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535)); }

// buf may be null (momentum == 0): the functor then never touches it.
__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n, fn::SgdStep f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    float dummy = 0.f;
    f(p[i], g[i], buf ? buf[i] : dummy);
  }
}

__global__ void adam_kernel(float* p, const float* g, float* m, float* v, int64_t n, fn::AdamStep f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    f(p[i], g[i], m[i], v[i]);
}

}  // namespace

void sgd_update(float* p, const float* g, float* buf, int64_t n, float lr, float momentum, float dampening,
                float weight_decay, bool nesterov, cudaStream_t s) {
  if (n > 0)
    sgd_kernel<<<blocks_for(n), 256, 0, s>>>(p, g, buf, n,
                                             fn::SgdStep{lr, momentum, dampening, weight_decay, nesterov});
  DT_CUDA_LAUNCHED();
}

void adam_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2, float eps,
                 float weight_decay, bool decoupled, float bias1, float bias2, cudaStream_t s) {
  if (n > 0)
    adam_kernel<<<blocks_for(n), 256, 0, s>>>(
        p, g, m, v, n, fn::AdamStep{lr, beta1, beta2, eps, weight_decay, bias1, bias2, decoupled});
  DT_CUDA_LAUNCHED();
}

}  // namespace dtrain::cuda::k

// CudaEngine: top-k sparsification (the Engine's compression pieces), checked calls into compress.cu.
// Work areas come from the caching allocator and are released at once: every use is queued on the
// one compute stream, so a block handed out again is only touched after this work.
#include <algorithm>
#include <cstdint>

#include "cuda_engine.h"
#include "kernels.h"

namespace dtrain::cuda {

namespace {

void check_on(const Tensor& t, DType dtype, int index, const char* what) {
  DT_CHECK(t.defined() && t.dtype() == dtype && t.device() == Device::cuda(index),
           what << " must be a " << dtype_name(dtype) << " tensor on cuda:" << index << ", got "
                << (t.defined() ? t.str() : "undefined"));
}

}  // namespace

void CudaEngine::topk_abs(const Tensor& x, int64_t k, Tensor& idx) {
  check_on(x, DType::F32, index_, "topk_abs input");
  check_on(idx, DType::I32, index_, "topk_abs indices");
  const int64_t n = x.numel();
  DT_CHECK(k > 0 && k <= n && n <= INT32_MAX && idx.numel() == k, "topk_abs: k = " << k << " of " << x.str()
                                                                                  << " into " << idx.str());
  bind();
  const Device dev = Device::cuda(index_);
  Tensor keys = Tensor::empty({2 * n}, DType::I32, dev);  // u32 magnitudes, sorted copy after them
  Tensor order = Tensor::empty({2 * n}, DType::I32, dev);
  size_t bytes = k::topk_scratch_bytes(n, k);
  Tensor scratch = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::U8, dev);
  k::topk_abs(x.f32(), n, k, idx.data<int32_t>(), static_cast<uint32_t*>(keys.raw()), order.data<int32_t>(),
              scratch.raw(), bytes, compute_);
}

void CudaEngine::gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) {
  check_on(x, DType::F32, index_, "gather_and_clear input");
  check_on(idx, DType::I32, index_, "gather_and_clear indices");
  if (vals.defined()) {
    check_on(vals, DType::F32, index_, "gather_and_clear values");
    DT_CHECK(vals.numel() == idx.numel(), "gather_and_clear: " << vals.str() << " for " << idx.str());
  }
  bind();
  k::gather_and_clear(x.f32(), idx.data<int32_t>(), vals.defined() ? vals.f32() : nullptr, idx.numel(), compute_);
}

void CudaEngine::scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) {
  check_on(idx, DType::I32, index_, "scatter_add indices");
  check_on(vals, DType::F32, index_, "scatter_add values");
  check_on(y, DType::F32, index_, "scatter_add output");
  DT_CHECK(vals.numel() == idx.numel(), "scatter_add: " << vals.str() << " for " << idx.str());
  bind();
  k::scatter_add(idx.data<int32_t>(), vals.f32(), y.f32(), idx.numel(), compute_);
}

}  // namespace dtrain::cuda

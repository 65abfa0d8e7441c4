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
  DT_CHECK(k > 0 && k <= n && n <= INT32_MAX && idx.numel() == k,
           "topk_abs: k = " << k << " of " << x.str() << " into " << idx.str());
  bind();
  const Device dev = Device::cuda(index_);
  Tensor keys = Tensor::empty({2 * n}, DType::I32, dev);  // u32 magnitudes, sorted copy after them
  Tensor order = Tensor::empty({2 * n}, DType::I32, dev);
  size_t bytes = k::topk_scratch_bytes(n, k);
  Tensor scratch = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::U8, dev);
  k::topk_abs(x.device_f32(), n, k, idx.device_data<int32_t>(), static_cast<uint32_t*>(keys.device_raw()),
              order.device_data<int32_t>(), scratch.device_raw(), bytes, compute_);
}

void CudaEngine::gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) {
  check_on(x, DType::F32, index_, "gather_and_clear input");
  check_on(idx, DType::I32, index_, "gather_and_clear indices");
  if (vals.defined()) {
    check_on(vals, DType::F32, index_, "gather_and_clear values");
    DT_CHECK(vals.numel() == idx.numel(), "gather_and_clear: " << vals.str() << " for " << idx.str());
  }
  bind();
  k::gather_and_clear(x.device_f32(), idx.device_data<int32_t>(), vals.defined() ? vals.device_f32() : nullptr,
                      idx.numel(), compute_);
}

void CudaEngine::scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) {
  check_on(idx, DType::I32, index_, "scatter_add indices");
  check_on(vals, DType::F32, index_, "scatter_add values");
  check_on(y, DType::F32, index_, "scatter_add output");
  DT_CHECK(vals.numel() == idx.numel(), "scatter_add: " << vals.str() << " for " << idx.str());
  bind();
  k::scatter_add(idx.device_data<int32_t>(), vals.device_f32(), y.device_f32(), idx.numel(), compute_);
}

void CudaEngine::sign_encode(Tensor& x, Tensor& payload) {
  check_on(x, DType::F32, index_, "sign_encode input");
  check_on(payload, DType::U8, index_, "sign_encode payload");
  DT_CHECK(payload.numel() == 4 + (x.numel() + 7) / 8, "sign_encode: payload " << payload.str() << " for " << x.str());
  bind();
  k::sign_encode(x.device_f32(), x.numel(), payload.device_data<uint8_t>(), compute_);
}

void CudaEngine::sign_decode_add(const Tensor& payload, Tensor& y) {
  check_on(payload, DType::U8, index_, "sign_decode_add payload");
  check_on(y, DType::F32, index_, "sign_decode_add output");
  DT_CHECK(payload.numel() == 4 + (y.numel() + 7) / 8,
           "sign_decode_add: payload " << payload.str() << " for " << y.str());
  bind();
  k::sign_decode_add(payload.device_data<uint8_t>(), y.numel(), y.device_f32(), compute_);
}

void CudaEngine::qsgd_encode(const Tensor& x, int levels, uint64_t seed, Tensor& payload) {
  check_on(x, DType::F32, index_, "qsgd_encode input");
  check_on(payload, DType::U8, index_, "qsgd_encode payload");
  DT_CHECK(levels >= 1 && levels <= 127 && payload.numel() == 4 + x.numel(),
           "qsgd_encode: " << levels << " levels, payload " << payload.str() << " for " << x.str());
  bind();
  k::qsgd_encode(x.device_f32(), x.numel(), levels, seed, payload.device_data<uint8_t>(), compute_);
}

void CudaEngine::qsgd_decode_add(const Tensor& payload, int levels, Tensor& y) {
  check_on(payload, DType::U8, index_, "qsgd_decode_add payload");
  check_on(y, DType::F32, index_, "qsgd_decode_add output");
  DT_CHECK(payload.numel() == 4 + y.numel(), "qsgd_decode_add: payload " << payload.str() << " for " << y.str());
  bind();
  k::qsgd_decode_add(payload.device_data<uint8_t>(), y.numel(), levels, y.device_f32(), compute_);
}

void CudaEngine::orthonormalize_columns(Tensor& m) {
  check_on(m, DType::F32, index_, "orthonormalize_columns");
  DT_CHECK(m.dim() == 2, "orthonormalize_columns takes a [rows, cols] matrix, got " << m.str());
  bind();
  k::orthonormalize_columns(m.device_f32(), m.size(0), m.size(1), compute_);
}

}  // namespace dtrain::cuda

// CpuEngine: the compressors' encodings (1-bit, QSGD, PowerSGD's orthonormalisation), the oracle of
// the CUDA engine's compress.cu. Top-k is in cpu_engine.cpp beside the rest of the engine.
#include <cmath>
#include <cstring>

#include "cpu_engine.h"
#include "dtrain/kernels/functors.h"

namespace dtrain::cpu {

namespace {
void check_payload(const Tensor& payload, int64_t bytes, const char* what) {
  DT_CHECK(payload.defined() && payload.dtype() == DType::U8 && payload.numel() == bytes && cpu_addressable(payload),
           what << ": the payload must be u8[" << bytes << "], got " << (payload.defined() ? payload.str() : "none"));
}
void check_vector(const Tensor& x, const char* what) {
  DT_CHECK(x.defined() && x.dtype() == DType::F32 && cpu_addressable(x),
           what << " must be an f32 tensor on the CPU engine, got " << (x.defined() ? x.str() : "none"));
}
}  // namespace

void CpuEngine::sign_encode(Tensor& x, Tensor& payload) {
  check_vector(x, "sign_encode input");
  const int64_t n = x.numel(), nb = (n + 7) / 8;
  check_payload(payload, 4 + nb, "sign_encode");
  float* v = x.device_f32();
  double l1 = 0;
  for (int64_t i = 0; i < n; ++i) l1 += std::fabs(v[i]);
  const float scale = n > 0 ? static_cast<float>(l1 / static_cast<double>(n)) : 0.f;
  uint8_t* out = payload.device_data<uint8_t>();
  std::memcpy(out, &scale, 4);
  uint8_t* bits = out + 4;
  for (int64_t j = 0; j < nb; ++j) bits[j] = fn::sign_byte(v, n, j);
  for (int64_t i = 0; i < n; ++i) v[i] -= scale * fn::sign_unit(bits, i);
}

void CpuEngine::sign_decode_add(const Tensor& payload, Tensor& y) {
  check_vector(y, "sign_decode_add output");
  const int64_t n = y.numel();
  check_payload(payload, 4 + (n + 7) / 8, "sign_decode_add");
  const uint8_t* in = payload.device_data<uint8_t>();
  const float scale = fn::payload_head(in);
  float* out = y.device_f32();
  for (int64_t i = 0; i < n; ++i) out[i] += scale * fn::sign_unit(in + 4, i);
}

void CpuEngine::qsgd_encode(const Tensor& x, int levels, uint64_t seed, Tensor& payload) {
  check_vector(x, "qsgd_encode input");
  DT_CHECK(levels >= 1 && levels <= 127, "qsgd_encode: " << levels << " levels, not in [1, 127]");
  const int64_t n = x.numel();
  check_payload(payload, 4 + n, "qsgd_encode");
  const float* v = x.device_f32();
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(v[i]) * v[i];
  const float norm = static_cast<float>(std::sqrt(sq));
  uint8_t* out = payload.device_data<uint8_t>();
  std::memcpy(out, &norm, 4);
  auto* q = reinterpret_cast<int8_t*>(out + 4);
  for (int64_t i = 0; i < n; ++i)
    q[i] = norm > 0 ? fn::qsgd_level(v[i], norm, levels, fn::hash_uniform(seed, static_cast<uint64_t>(i))) : 0;
}

void CpuEngine::qsgd_decode_add(const Tensor& payload, int levels, Tensor& y) {
  check_vector(y, "qsgd_decode_add output");
  const int64_t n = y.numel();
  check_payload(payload, 4 + n, "qsgd_decode_add");
  const uint8_t* in = payload.device_data<uint8_t>();
  const float norm = fn::payload_head(in);
  const auto* q = reinterpret_cast<const int8_t*>(in + 4);
  const float s = static_cast<float>(levels);
  float* out = y.device_f32();
  for (int64_t i = 0; i < n; ++i) out[i] += norm * static_cast<float>(q[i]) / s;
}

void CpuEngine::orthonormalize_columns(Tensor& m) {
  check_vector(m, "orthonormalize_columns");
  DT_CHECK(m.dim() == 2, "orthonormalize_columns takes a [rows, cols] matrix, got " << m.str());
  const int64_t rows = m.size(0), cols = m.size(1);
  float* a = m.device_f32();
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t p = 0; p < c; ++p) {
      double dot = 0;
      for (int64_t i = 0; i < rows; ++i) dot += static_cast<double>(a[i * cols + c]) * a[i * cols + p];
      for (int64_t i = 0; i < rows; ++i) a[i * cols + c] -= static_cast<float>(dot) * a[i * cols + p];
    }
    double sq = 0;
    for (int64_t i = 0; i < rows; ++i) sq += static_cast<double>(a[i * cols + c]) * a[i * cols + c];
    const double norm = std::sqrt(sq);
    const float inv = norm > 1e-20 ? static_cast<float>(1.0 / norm) : 0.f;  // a null column stays null
    for (int64_t i = 0; i < rows; ++i) a[i * cols + c] *= inv;
  }
}

}  // namespace dtrain::cpu

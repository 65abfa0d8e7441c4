#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, U8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);  // throws InputError naming the value

// bfloat16 and IEEE half conversions (round to nearest even), usable from host and device code.
#if defined(__CUDACC__)
#define DT_HD __host__ __device__
#else
#define DT_HD
#endif

DT_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
DT_HD inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_f16(float f);
float f16_to_float(uint16_t h);

}  // namespace dtrain

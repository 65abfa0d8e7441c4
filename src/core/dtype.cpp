#include "dtrain/core/dtype.h"

#include "dtrain/core/error.h"

namespace dtrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8})
    if (n == dtype_name(t)) return t;
  throw InputError("unknown dtype '" + n + "' (expected f32, bf16, f16, i32, i64 or u8)");
}

}  // namespace dtrain

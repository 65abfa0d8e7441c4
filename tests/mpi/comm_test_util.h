#pragma once
// Helpers for the comm tests: tensors of any dtype filled from, and read back as, floats. Inputs
// are small integers so that every dtype holds them and every reduction of them exactly.
#include <cstdint>
#include <functional>
#include <vector>

#include "dtrain/core/dtype.h"
#include "dtrain/core/tensor.h"

namespace dtrain::comm::testing {

inline void set_value(Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::F32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case DType::BF16:
      t.data<uint16_t>()[i] = float_to_bf16(static_cast<float>(v));
      break;
    case DType::F16:
      t.data<uint16_t>()[i] = float_to_f16(static_cast<float>(v));
      break;
    case DType::I32:
      t.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::I64:
      t.data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
    case DType::U8:
      t.data<uint8_t>()[i] = static_cast<uint8_t>(v);
      break;
  }
}

inline double get_value(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::F32:
      return t.data<float>()[i];
    case DType::BF16:
      return bf16_to_float(t.data<uint16_t>()[i]);
    case DType::F16:
      return f16_to_float(t.data<uint16_t>()[i]);
    case DType::I32:
      return t.data<int32_t>()[i];
    case DType::I64:
      return static_cast<double>(t.data<int64_t>()[i]);
    case DType::U8:
      return t.data<uint8_t>()[i];
  }
  return 0;
}

inline Tensor make_filled(int64_t n, DType dt, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dt);
  for (int64_t i = 0; i < n; ++i) set_value(t, i, f(i));
  return t;
}

// Number of elements i where t[i] != expected(i); the first few are described in `first`.
inline int64_t count_wrong(const Tensor& t, const std::function<double(int64_t)>& expected, std::string* first) {
  int64_t wrong = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    double got = get_value(t, i), want = expected(i);
    if (got != want) {
      if (wrong < 3 && first)
        *first += "[" + std::to_string(i) + "] got " + std::to_string(got) + " want " + std::to_string(want) + "; ";
      ++wrong;
    }
  }
  return wrong;
}

inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> d = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8};
  return d;
}

}  // namespace dtrain::comm::testing

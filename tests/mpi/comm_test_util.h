#pragma once
// Helpers for the comm tests: tensors of any dtype filled from, and read back as, floats. Inputs
// are small integers so that every dtype holds them and every reduction of them exactly.
#include <cstdint>
#include <functional>
#include <vector>

#include "dtrain/core/dtype.h"
#include "dtrain/core/tensor.h"

namespace dtrain::comm::testing {

inline void set_value(Tensor& t, int64_t i, double v) { t.set_item(i, v); }
inline double get_value(const Tensor& t, int64_t i) { return t.item(i); }

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

#pragma once
// What the CPU benchmarks share: the timing of one call, and uniform random operands.
#include <algorithm>
#include <functional>

#include "dtrain/core/rng.h"
#include "dtrain/core/tensor.h"
#include "dtrain/core/timer.h"

namespace dtrain::cli {

// Best-of-`reps` seconds per call after a warm-up, repeating calls until each timing spans >= 20 ms.
inline double time_call(const std::function<void()>& f, int reps) {
  f();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    int calls = 0;
    double t0 = now_s(), t;
    do {
      f();
      ++calls;
      t = now_s();
    } while (t - t0 < 0.02);
    best = std::min(best, (t - t0) / calls);
  }
  return best;
}

inline void fill_uniform(Tensor& t, Rng& rng) {
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = rng.uniform(-1, 1);
}

}  // namespace dtrain::cli

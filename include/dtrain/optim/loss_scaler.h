#pragma once
// Dynamic loss scaling for fp16 training (bf16 needs none: it has fp32's exponent range).
// The loss gradient is multiplied by scale() before backward so small fp16 gradients do not flush
// to zero; before the optimizer step the gradients are divided by it again and checked for inf/NaN.
// A step whose gradients overflowed is skipped and the scale backs off; after `growth_interval`
// good steps in a row the scale grows. Same rule as PyTorch's GradScaler, so runs compare.
#include <cstdint>
#include <vector>

#include "dtrain/optim/optimizer.h"

namespace dtrain::optim {

struct LossScalerOptions {
  float init_scale = 65536.f;  // 2^16
  float growth_factor = 2.f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;  // good steps in a row before the scale grows
  float min_scale = 1.f;           // the scale never backs off below this
  float max_scale = 16777216.f;    // 2^24: bounds the growth (fp32 gradients stay finite)
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions o = {});

  // Multiply the loss gradient (e.g. softmax_xent_backward's `scale`) by this.
  float scale() const { return scale_; }

  // Divides every gradient by scale() and checks them for inf/NaN: one fused pass per tensor and
  // one host read per call (per device). Returns true when all are finite, i.e. the step may be
  // taken. Call it after the gradients are complete (after the data-parallel allreduce, so every
  // rank decides alike) and before clipping, which must see unscaled gradients.
  bool unscale(const std::vector<nn::Parameter*>& params);

  // Records the outcome of a step attempt: backs off (and counts a skipped step) when the
  // gradients were not finite, grows the scale after growth_interval finite steps in a row.
  void update(bool grads_finite);

  // unscale, then opt.step(lr) when finite, then update. Returns whether the step was taken.
  bool step(Optimizer& opt, float lr);

  int64_t skipped_steps() const { return skipped_; }
  int64_t good_steps() const { return good_; }  // finite steps since the last change of scale
  const LossScalerOptions& options() const { return o_; }

  // Checkpointing: (scale, good steps, skipped steps) restore the scaler exactly.
  void set_state(float scale, int64_t good_steps, int64_t skipped_steps);

 private:
  LossScalerOptions o_;
  float scale_;
  int64_t good_ = 0, skipped_ = 0;
};

}  // namespace dtrain::optim

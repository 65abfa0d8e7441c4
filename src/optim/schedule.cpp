#include "dtrain/optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.h"

namespace dtrain::optim {

LrSchedule::LrSchedule(ScheduleOptions o) : o_(std::move(o)) {
  DT_INPUT_CHECK(o_.kind == "constant" || o_.kind == "step" || o_.kind == "cosine",
                 "unknown --lr-schedule '" << o_.kind << "' (constant, step, cosine)");
  DT_INPUT_CHECK(o_.base_lr > 0.f, "--lr must be > 0, got " << o_.base_lr);
  DT_INPUT_CHECK(o_.warmup_steps >= 0, "--warmup-steps must be >= 0");
  DT_INPUT_CHECK(o_.kind != "step" || o_.step_size > 0, "--lr-step-size must be > 0");
  o_.total_steps = std::max<int64_t>(o_.total_steps, 1);
}

float LrSchedule::lr(int64_t step) const {
  if (step < o_.warmup_steps) {
    float f = static_cast<float>(step + 1) / static_cast<float>(o_.warmup_steps);
    return o_.base_lr * (o_.warmup_start + (1.f - o_.warmup_start) * f);
  }
  if (o_.kind == "step") return o_.base_lr * std::pow(o_.gamma, static_cast<float>(step / o_.step_size));
  if (o_.kind == "cosine") {
    // Cosine over the steps after warm-up, as torch's CosineAnnealingLR with T_max = those steps.
    int64_t span = std::max<int64_t>(o_.total_steps - o_.warmup_steps, 1);
    double t = std::min<double>(static_cast<double>(step - o_.warmup_steps) / static_cast<double>(span), 1.0);
    return o_.min_lr + (o_.base_lr - o_.min_lr) * static_cast<float>(0.5 * (1.0 + std::cos(M_PI * t)));
  }
  return o_.base_lr;
}

}  // namespace dtrain::optim

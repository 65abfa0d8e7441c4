#pragma once
// Learning-rate schedules: lr(step) for step = 0, 1, ... total_steps-1.
#include <cstdint>
#include <memory>
#include <string>

namespace dtrain::optim {

struct ScheduleOptions {
  std::string kind = "constant";  // constant | step | cosine
  float base_lr = 0.1f;
  int64_t total_steps = 1;        // cosine decays over these steps
  int64_t step_size = 1000;       // step: multiply by gamma every step_size steps
  float gamma = 0.1f;
  float min_lr = 0.f;             // cosine floor
  int64_t warmup_steps = 0;       // linear warm-up from warmup_start * base_lr
  float warmup_start = 0.f;
};

class LrSchedule {
 public:
  explicit LrSchedule(ScheduleOptions o);
  float lr(int64_t step) const;
  const ScheduleOptions& options() const { return o_; }

 private:
  ScheduleOptions o_;
};

}  // namespace dtrain::optim

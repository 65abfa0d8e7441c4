#pragma once
// What one rank holds of the model's training state under each ZeRO stage, before anything is
// allocated: the check that refuses a run that cannot fit, and the figures its message gives.
//   stage 0  parameters, gradients and optimizer state whole       4 + 4 + 4k bytes a parameter
//   stage 1  optimizer state, a master and a gradient slice: 1/N   4 + 4 + (8 + 4k)/N
//   stage 2  gradients too (reduce-scattered unit by unit)         4 + (4 + 4k)/N
//   stage 3  parameters too, plus the units gathered at once       (8 + 4k)/N + gathered
// (per trained parameter; a frozen one holds its value alone: 4, at stage 3 4/N)
// (k: the optimizer's f32 values per parameter: SGD with momentum 1, Adam/AdamW 2.) Activations
// depend on the batch and are measured after the first step instead (the run's memory report).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::parallel {

struct ModelStateBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0, shards = 0, gathered = 0;
  int64_t total() const { return parameters + gradients + optimizer + shards + gathered; }
};

// `trained`: the parameters that are not frozen (--freeze, LoRA), the only ones with gradients and
// optimizer state. `unit_params`: the parameter count of each unit (Module::shard_units), for
// ZeRO-3's gathered units: the largest three with prefetch (a unit used across the pass, the
// current one, the next), two without.
ModelStateBytes plan_model_state(int64_t params, int64_t trained, const std::vector<int64_t>& unit_params, int zero,
                                 int dp_ranks, int optimizer_floats, bool prefetch = true);

// "8.00 GiB (parameters 2.00, gradients 2.00, optimizer state 4.00, ...)" (MiB below a GiB).
std::string describe(const ModelStateBytes& b);
std::string bytes_text(int64_t bytes);  // "1.50 GiB", "3.25 MiB"

}  // namespace dtrain::parallel

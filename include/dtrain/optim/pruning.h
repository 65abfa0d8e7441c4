#pragma once
// Magnitude pruning: masks as the parameters' companions. After an optimizer step the pruner
// updates the masks on its schedule (gradual, Zhu & Gupta's cubic ramp from `start` to `end`,
// every `every` steps) and applies them, so a pruned weight is exactly zero after every step.
// Unstructured pruning zeroes the smallest |w| (one threshold over all weights, or one per layer);
// structured pruning zeroes whole output channels of a convolution / rows of a Linear (the smallest
// L2 norms of each layer) with their biases, so the exported layer can shrink.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"

namespace dtrain::optim {

struct PruneOptions {
  float sparsity = 0.f;         // the final fraction of weights (or channels) at zero, in [0, 1)
  int64_t start = 0, end = 0;   // steps of the ramp; end <= start prunes to `sparsity` at `start` at once
  int64_t every = 100;          // steps between mask updates inside the ramp
  bool structured = false;      // whole output channels / rows instead of single weights
  bool global = true;           // unstructured: one threshold over every pruned weight
};

class MagnitudePruner {
 public:
  // `weights`: the parameters to prune (conv and Linear weights, dim >= 2), in the same order on
  // every rank; `biases`: for structured pruning, each weight's bias (null when it has none).
  MagnitudePruner(std::vector<nn::Parameter*> weights, std::vector<nn::Parameter*> biases, PruneOptions o);

  // The target sparsity after `step` optimizer steps (0 before `start`, `sparsity` from `end`).
  float target(int64_t step) const;
  // After optimizer step number `step` (1-based): the masks are recomputed when the schedule says
  // so, then applied. Returns whether they were recomputed.
  bool after_step(int64_t step);
  // Multiplies the weights (and pruned channels' biases) by their masks.
  void apply();

  // The achieved fraction of zero mask entries over every pruned weight.
  double sparsity() const;
  // Masks by parameter name (f32 0/1, host), for checkpoints, and back (shapes checked).
  std::map<std::string, Tensor> masks() const;
  void load_masks(const std::map<std::string, Tensor>& masks);

 private:
  void recompute(float sparsity);
  void unstructured(float sparsity);
  void structured(float sparsity);

  std::vector<nn::Parameter*> weights_, biases_;
  PruneOptions o_;
  std::vector<Tensor> masks_, bias_masks_;  // on each parameter's device
  bool active_ = false;                     // masks hold something other than ones
};

}  // namespace dtrain::optim

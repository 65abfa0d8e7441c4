#pragma once
// Structured pruning made physical (`dtrain prune-export`): the output channels that structured
// pruning zeroed are cut out of their layer, and the matching input channels out of the next
// Conv2d/Linear, so the model gets smaller and computes the same outputs.
//
// A channel is dropped when its weights (a row of the (K, ...) weight) and its bias are all zero:
// it is then 0 everywhere, and the layers between it and the next Conv2d/Linear keep a 0 a 0 (ReLU,
// GELU, pooling, Flatten, Dropout in evaluation), so its input weights there multiply zeros. A
// Linear after a Flatten reads channel c as its columns [c*HW, (c+1)*HW). The output layer keeps
// every row (its rows are the classes). Any other layer between (BatchNorm2d maps 0 to its shift,
// a Residual mixes channels across blocks) is refused naming it.
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/models.h"

namespace dtrain::nn {

struct ShrunkModel {
  ModelSpec spec;                     // the same model with the narrower widths
  std::unique_ptr<Sequential> model;  // its parameters: the kept rows and columns, in evaluation mode
  std::vector<std::string> layers;    // per Conv2d/Linear: "0 Conv2d: 16 -> 8 output channels"
};

// The shrunk form of `model` (built from `spec`, weights already masked). Throws InputError naming an
// unsupported layer, or saying that no channel is pruned whole.
ShrunkModel shrink_pruned_channels(Sequential& model, const ModelSpec& spec);

}  // namespace dtrain::nn

#pragma once
#include <string>
#include <vector>

#include "dtrain/nn/layers.h"
#include "dtrain/nn/model_file.h"

namespace dtrain::nn {

struct ModelSpec {
  std::string name;            // mlp, simple_cnn, resnet20
  Shape input;                 // per-sample input shape, e.g. {1, 28, 28}
  int64_t classes = 10;
  std::vector<int64_t> hidden{256, 128};  // MLP widths
  float dropout = 0.f;         // MLP dropout between hidden layers
  uint64_t seed = 1;
  std::vector<int64_t> channels{16, 32};  // simple_cnn's convolution widths (fewer after dtrain prune-export)
  // A model file's definition (model_file.h, canonical JSON; `name` is its name): when set, the model
  // is built from it instead of a built-in one, and hidden/dropout/channels do not apply.
  std::string definition{};
  std::string definition_source{};  // where the definition came from, for messages (a file, a checkpoint)
};

// Builds a model; throws InputError naming the model when the name or input shape does not fit.
ModulePtr make_model(const ModelSpec& spec);
// The same model as what every image model is, a Sequential of layers: a pipeline cuts it into
// stages (Sequential::stage_of) between these layers.
std::unique_ptr<Sequential> make_sequential_model(const ModelSpec& spec);
std::vector<std::string> model_names();
// `spec` with the widths of its hidden layers replaced: one per Conv2d/Linear but the output layer,
// in order (the mlp's hidden widths, simple_cnn's channels). Throws InputError naming a model whose
// widths are not free (resnet20) or a count that does not fit.
ModelSpec with_widths(const ModelSpec& spec, const std::vector<int64_t>& widths);

}  // namespace dtrain::nn

#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "dtrain/nn/layers.h"
#include "dtrain/nn/model_file.h"

namespace dtrain::nn {

// What building a model may ask for. A model file or a checkpoint's attributes give the sizes, so
// every layer's share is checked before the layer allocates anything (ModelBudget).
struct ModelLimits {
  int64_t parameters = int64_t{1} << 34;       // all layers together: 64 GiB of f32
  int64_t sample_elements = int64_t{1} << 32;  // the input's and any layer's output, per sample
  int64_t layers = int64_t{1} << 16;           // layers after a model file's blocks are expanded
  // Where `parameters` comes from when it is not the stated maximum above, for messages: "the 5130
  // parameters checkpoint 'c.h5' holds (attributes model, input_shape, hidden, classes)".
  std::string parameters_from{};
};

struct ModelSpec {
  std::string name;  // mlp, simple_cnn, resnet20
  Shape input;       // per-sample input shape, e.g. {1, 28, 28}
  int64_t classes = 10;
  std::vector<int64_t> hidden{256, 128};  // MLP widths
  float dropout = 0.f;                    // MLP dropout between hidden layers
  uint64_t seed = 1;
  std::vector<int64_t> channels{16, 32};  // simple_cnn's convolution widths (fewer after dtrain prune-export)
  // A model file's definition (model_file.h, canonical JSON; `name` is its name): when set, the model
  // is built from it instead of a built-in one, and hidden/dropout/channels do not apply.
  std::string definition{};
  std::string definition_source{};  // where the definition came from, for messages (a file, a checkpoint)
  ModelLimits limits{};
  // ZeRO-3: the top-level layers are built shard by shard into this sink (Sequential::set_unit_sink);
  // it lives as long as the build only.
  UnitSink* sink = nullptr;
};

// The parameters, layers and per-sample sizes of a model being built, counted against its spec's
// limits: a layer takes its share before it allocates. Throws InputError naming the model, where
// its definition came from, the layer (its path and type) and the limit it passes.
class ModelBudget {
 public:
  explicit ModelBudget(const ModelSpec& spec);
  // One more layer (containers too): a model file's blocks may not expand past limits.layers.
  void add_layer(const std::string& path, const std::string& type);
  // A layer at `path` of `type` whose parameters have `shapes` (any product that passes int64 is refused too).
  void take(const std::string& path, const std::string& type, std::initializer_list<Shape> shapes);
  // A layer's output of `shape` per sample (or the model's input, `type` "input").
  void output(const std::string& path, const std::string& type, const Shape& shape) const;
  int64_t parameters() const { return parameters_; }

 private:
  [[noreturn]] void refuse(const std::string& path, const std::string& type, const std::string& what) const;
  const ModelSpec& spec_;
  int64_t parameters_ = 0, layers_ = 0;
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

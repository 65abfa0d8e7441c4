// Fuzz target: model files (`dtrain train --model-file`): nn::read_model_file, then the model built
// from the definition for samples of [3, 8, 8] (inputs of odd length: [2, 5, 6]) and 4 classes,
// under small limits (ModelLimits) so that no input builds more than a small model, then one forward
// and backward on a batch of 2. The input is the file: JSON when it starts with '{' (after
// whitespace), otherwise INI. A model that builds must stay within the limits and give [2, 4] logits.
#include <string_view>

#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/nn/models.h"
#include "fuzz_util.h"

using namespace dtrain;

namespace {

nn::ModelSpec spec_of(const std::string& definition, const std::string& file, size_t size) {
  nn::ModelSpec s;
  s.definition = definition;
  s.name = nn::model_definition_name(definition);
  s.definition_source = file;
  s.input = size % 2 ? Shape{2, 5, 6} : Shape{3, 8, 8};
  s.classes = 4;
  s.limits.parameters = int64_t{1} << 18;
  s.limits.sample_elements = int64_t{1} << 14;
  s.limits.layers = 256;
  return s;
}

void run_once(nn::Module& m, const Shape& input) {
  Shape batch = {2};
  batch.insert(batch.end(), input.begin(), input.end());
  Tensor x = Tensor::empty(batch);
  Rng rng(7);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
  const Tensor y = m.forward(x);
  if (y.shape() != Shape{2, 4}) fuzz::fail("the model gives " + shape_str(y.shape()) + ", not [2, 4]");
  m.backward(Tensor::full({2, 4}, 0.25f));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json = first != std::string_view::npos && text[first] == '{';
  const fuzz::fs::path file = fuzz::fresh_scratch() / (json ? "model.json" : "model.ini");
  fuzz::write_file(file, {data, size});
  try {
    const std::string definition = nn::read_model_file(file.string());
    nn::ModelSpec spec = spec_of(definition, file.string(), size);
    auto model = nn::make_sequential_model(spec);
    if (model->parameter_count() > spec.limits.parameters)
      fuzz::fail("a model of " + std::to_string(model->parameter_count()) + " parameters passed the limit");
    run_once(*model, spec.input);
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  return 0;
}

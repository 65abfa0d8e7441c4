#pragma once
// Networks described in files (`dtrain train --model-file`): layers and blocks in JSON, or the same
// tree in INI, built with their shapes inferred from the data's sample shape. The format is in
// docs/models.md; examples/models/ holds the built-in models and the standard ones written this way.
#include <memory>
#include <optional>
#include <string>

#include "dtrain/core/rng.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/layers.h"

namespace dtrain::nn {

struct ModelSpec;
class ModelBudget;

// Reads a model file (.json; .ini or .cfg: INI sections whose names are paths in the same tree) into
// its definition: canonical JSON text, which ModelSpec::definition holds and checkpoints store, with
// a "name" (the file's stem when it gives none). Throws InputError naming the file, and the line
// where the parser gives one; a file past 16 MiB or nesting deeper than 64 levels is refused unparsed.
std::string read_model_file(const std::string& path);

// The "name" of a definition read by read_model_file.
std::string model_definition_name(const std::string& definition);

// A language model's shape from a definition read by read_model_file whose "language_model" section
// gives it (docs/models.md): layers, width, heads, kv_heads, mlp_width, context, norm (layer|rms),
// positions (learned|rotary), rope_base, mlp (gelu|swiglu), bias, tied, norm_eps; absent: an image
// model's definition (nullopt). Throws InputError naming the file (`source`) and the field.
std::optional<GptConfig> language_model_shape(const std::string& definition, const std::string& source);

// Builds `spec.definition` for samples of shape `spec.input` and `spec.classes` classes, drawing
// initial weights from `rng` in the order of the layers; every layer counted against `budget`
// (spec.limits) before it allocates. Throws InputError naming the model, its
// `spec.definition_source` and the layer (its path in parameter names, and its type) whose fields or input shape do not
// fit.
std::unique_ptr<Sequential> build_model_definition(const ModelSpec& spec, Rng& rng, ModelBudget& budget);

}  // namespace dtrain::nn

#include "dtrain/nn/models.h"

#include <algorithm>
#include <limits>

namespace dtrain::nn {

std::vector<std::string> model_names() { return {"mlp", "simple_cnn", "resnet20"}; }

ModelBudget::ModelBudget(const ModelSpec& spec) : spec_(spec) {}

void ModelBudget::refuse(const std::string& path, const std::string& type, const std::string& what) const {
  const std::string& from = spec_.definition_source;
  throw InputError("model " + spec_.name + (from.empty() ? "" : " (" + from + ")") + ": layer " +
                   (path.empty() ? "<top>" : path) + " (" + type + "): " + what);
}

void ModelBudget::add_layer(const std::string& path, const std::string& type) {
  if (++layers_ > spec_.limits.layers)
    refuse(path, type,
           "the model has more than " + std::to_string(spec_.limits.layers) +
               " layers (blocks that expand without bound?)");
}

void ModelBudget::take(const std::string& path, const std::string& type, std::initializer_list<Shape> shapes) {
  const ModelLimits& lim = spec_.limits;
  int64_t total = parameters_;
  std::string shown;
  for (const Shape& s : shapes) {
    shown += (shown.empty() ? "" : ", ") + shape_str(s);
    int64_t n = 0;
    try {
      n = shape_numel(s, "a parameter");
    } catch (const InputError& e) {
      refuse(path, type, e.what());
    }
    if (__builtin_add_overflow(total, n, &total)) total = std::numeric_limits<int64_t>::max();
  }
  if (total > lim.parameters)
    refuse(path, type,
           "its parameters (" + shown + ") bring the model past " +
               (lim.parameters_from.empty() ? "the limit of " + std::to_string(lim.parameters) + " parameters"
                                            : lim.parameters_from));
  parameters_ = total;
}

void ModelBudget::output(const std::string& path, const std::string& type, const Shape& shape) const {
  int64_t n = 0;
  try {
    n = shape_numel(shape, type == "input" ? "its samples" : "its output");
  } catch (const InputError& e) {
    refuse(path, type, e.what());
  }
  if (n > spec_.limits.sample_elements)
    refuse(path, type,
           (type == "input" ? "samples of " : "it gives ") + shape_str(shape) + " (" + std::to_string(n) +
               " elements) per sample, more than the " + std::to_string(spec_.limits.sample_elements) + " accepted");
}

static std::unique_ptr<Sequential> make_mlp(const ModelSpec& s, Rng& rng, ModelBudget& budget) {
  auto m = std::make_unique<Sequential>();
  m->set_unit_sink(s.sink);
  m->add(std::make_unique<Flatten>());
  int64_t in = shape_numel(s.input);
  uint64_t drop_seed = derive_seed(s.seed, 99);
  for (int64_t h : s.hidden) {
    DT_INPUT_CHECK(h > 0, "model mlp: hidden width must be positive, got " << h);
    budget.take(std::to_string(m->size()), "linear", {{h, in}, {h}});
    m->add(std::make_unique<Linear>(in, h, true, rng));
    m->add(ReLU());
    if (s.dropout > 0.f) m->add(std::make_unique<Dropout>(s.dropout, drop_seed++));
    in = h;
  }
  budget.take(std::to_string(m->size()), "linear", {{s.classes, in}, {s.classes}});
  m->add(std::make_unique<Linear>(in, s.classes, true, rng));
  return m;
}

// conv 3x3 16 -> ReLU -> maxpool 2 -> conv 3x3 32 -> ReLU -> maxpool 2 -> linear to classes.
// Convolutions pad by 1, so a 28x28 image becomes 32 x 7 x 7 before the classifier. `channels`
// replaces 16 and 32 (a model shrunk by prune-export).
static std::unique_ptr<Sequential> make_simple_cnn(const ModelSpec& s, Rng& rng, ModelBudget& budget) {
  DT_INPUT_CHECK(s.input.size() == 3 && s.input[1] >= 4 && s.input[2] >= 4,
                 "model simple_cnn needs image inputs (C, H, W) with H, W >= 4, got " << shape_str(s.input));
  DT_INPUT_CHECK(s.channels.size() == 2 && s.channels[0] > 0 && s.channels[1] > 0,
                 "model simple_cnn needs two positive convolution widths, got " << shape_str(s.channels));
  const int64_t c1 = s.channels[0], c2 = s.channels[1];
  budget.take("0", "conv", {{c1, s.input[0], 3, 3}, {c1}});
  budget.output("0", "conv", {c1, s.input[1], s.input[2]});
  budget.take("3", "conv", {{c2, c1, 3, 3}, {c2}});
  budget.take("7", "linear", {{s.classes, c2, s.input[1] / 4, s.input[2] / 4}, {s.classes}});
  auto m = std::make_unique<Sequential>();
  m->set_unit_sink(s.sink);
  m->add(std::make_unique<Conv2d>(s.input[0], c1, 3, 1, 1, true, rng));
  m->add(ReLU());
  m->add(MaxPool2d(2, 2));
  m->add(std::make_unique<Conv2d>(c1, c2, 3, 1, 1, true, rng));
  m->add(ReLU());
  m->add(MaxPool2d(2, 2));
  m->add(std::make_unique<Flatten>());
  m->add(std::make_unique<Linear>(c2 * (s.input[1] / 4) * (s.input[2] / 4), s.classes, true, rng));
  return m;
}

// ResNet-20 (He et al. 2016, CIFAR variant): conv 16, then 3 stages of 3 basic blocks with 16, 32
// and 64 channels (stride 2 at the start of stages 2 and 3, 1x1 conv + BN shortcut there),
// global average pool, linear.
static ModulePtr basic_block(int64_t in, int64_t out, int64_t stride, Rng& rng) {
  auto body = std::make_unique<Sequential>();
  body->add(std::make_unique<Conv2d>(in, out, 3, stride, 1, false, rng));
  body->add(std::make_unique<BatchNorm2d>(out));
  body->add(ReLU());
  body->add(std::make_unique<Conv2d>(out, out, 3, 1, 1, false, rng));
  body->add(std::make_unique<BatchNorm2d>(out));
  ModulePtr shortcut;
  if (stride != 1 || in != out) {
    auto sc = std::make_unique<Sequential>();
    sc->add(std::make_unique<Conv2d>(in, out, 1, stride, 0, false, rng));
    sc->add(std::make_unique<BatchNorm2d>(out));
    shortcut = std::move(sc);
  }
  auto block = std::make_unique<Sequential>();
  block->add(std::make_unique<Residual>(std::move(body), std::move(shortcut)));
  block->add(ReLU());
  return block;
}

static std::unique_ptr<Sequential> make_resnet20(const ModelSpec& s, Rng& rng, ModelBudget& budget) {
  DT_INPUT_CHECK(s.input.size() == 3 && s.input[1] >= 8 && s.input[2] >= 8,
                 "model resnet20 needs image inputs (C, H, W) with H, W >= 8, got " << shape_str(s.input));
  // The widths are fixed: only the stem's input channels, the image's size and the classes vary.
  budget.take("0", "conv", {{16, s.input[0], 3, 3}});
  budget.output("0", "conv", {16, s.input[1], s.input[2]});
  budget.take("13", "linear", {{s.classes, 64}, {s.classes}});
  auto m = std::make_unique<Sequential>();
  m->set_unit_sink(s.sink);
  m->add(std::make_unique<Conv2d>(s.input[0], 16, 3, 1, 1, false, rng));
  m->add(std::make_unique<BatchNorm2d>(16));
  m->add(ReLU());
  int64_t in = 16;
  for (int64_t stage = 0; stage < 3; ++stage) {
    int64_t out = 16 << stage;
    for (int b = 0; b < 3; ++b) {
      m->add(basic_block(in, out, (stage > 0 && b == 0) ? 2 : 1, rng));
      in = out;
    }
  }
  m->add(std::make_unique<GlobalAvgPool>());
  m->add(std::make_unique<Linear>(64, s.classes, true, rng));
  return m;
}

ModelSpec with_widths(const ModelSpec& spec, const std::vector<int64_t>& widths) {
  ModelSpec s = spec;
  DT_INPUT_CHECK(s.definition.empty(),
                 "model " << s.name << ": a model file's layer widths are its own (change the file)");
  const bool cnn = s.name == "simple_cnn" || s.name == "simplecnn";
  DT_INPUT_CHECK(cnn || s.name == "mlp", "model " << s.name << ": its layer widths are fixed (only mlp and "
                                                  << "simple_cnn take other widths)");
  std::vector<int64_t>& dst = cnn ? s.channels : s.hidden;
  DT_INPUT_CHECK(widths.size() == dst.size(),
                 "model " << s.name << " has " << dst.size() << " hidden widths, not " << widths.size());
  dst = widths;
  return s;
}

ModulePtr make_model(const ModelSpec& s) { return make_sequential_model(s); }

std::unique_ptr<Sequential> make_sequential_model(const ModelSpec& s) {
  DT_INPUT_CHECK(s.classes >= 2, "model " << s.name << ": need at least 2 classes, got " << s.classes);
  ModelBudget budget(s);
  if (!s.input.empty()) budget.output("", "input", s.input);
  DT_INPUT_CHECK(!s.input.empty() && shape_numel(s.input) > 0,
                 "model " << s.name << ": empty input shape " << shape_str(s.input));
  Rng rng(derive_seed(s.seed, 1));
  std::unique_ptr<Sequential> m;
  if (!s.definition.empty()) {
    m = build_model_definition(s, rng, budget);
  } else if (s.name == "mlp") {
    m = make_mlp(s, rng, budget);
  } else if (s.name == "simple_cnn" || s.name == "simplecnn") {
    m = make_simple_cnn(s, rng, budget);
  } else if (s.name == "resnet20") {
    m = make_resnet20(s, rng, budget);
  } else {
    std::string names;
    for (auto& n : model_names()) names += (names.empty() ? "" : ", ") + n;
    throw InputError("unknown model '" + s.name + "' (models: " + names + ")");
  }
  m->set_unit_sink(nullptr);  // the sink lives as long as the build only
  return m;
}

}  // namespace dtrain::nn

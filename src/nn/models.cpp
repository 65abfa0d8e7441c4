#include "dtrain/nn/models.h"

#include <algorithm>

namespace dtrain::nn {

std::vector<std::string> model_names() { return {"mlp", "simple_cnn", "resnet20"}; }

static std::unique_ptr<Sequential> make_mlp(const ModelSpec& s, Rng& rng) {
  auto m = std::make_unique<Sequential>();
  m->add(std::make_unique<Flatten>());
  int64_t in = shape_numel(s.input);
  uint64_t drop_seed = derive_seed(s.seed, 99);
  for (int64_t h : s.hidden) {
    DT_INPUT_CHECK(h > 0, "model mlp: hidden width must be positive, got " << h);
    m->add(std::make_unique<Linear>(in, h, true, rng));
    m->add(ReLU());
    if (s.dropout > 0.f) m->add(std::make_unique<Dropout>(s.dropout, drop_seed++));
    in = h;
  }
  m->add(std::make_unique<Linear>(in, s.classes, true, rng));
  return m;
}

// conv 3x3 16 -> ReLU -> maxpool 2 -> conv 3x3 32 -> ReLU -> maxpool 2 -> linear to classes.
// Convolutions pad by 1, so a 28x28 image becomes 32 x 7 x 7 before the classifier. `channels`
// replaces 16 and 32 (a model shrunk by prune-export).
static std::unique_ptr<Sequential> make_simple_cnn(const ModelSpec& s, Rng& rng) {
  DT_INPUT_CHECK(s.input.size() == 3 && s.input[1] >= 4 && s.input[2] >= 4,
                 "model simple_cnn needs image inputs (C, H, W) with H, W >= 4, got " << shape_str(s.input));
  DT_INPUT_CHECK(s.channels.size() == 2 && s.channels[0] > 0 && s.channels[1] > 0,
                 "model simple_cnn needs two positive convolution widths, got " << shape_str(s.channels));
  const int64_t c1 = s.channels[0], c2 = s.channels[1];
  auto m = std::make_unique<Sequential>();
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

static std::unique_ptr<Sequential> make_resnet20(const ModelSpec& s, Rng& rng) {
  DT_INPUT_CHECK(s.input.size() == 3 && s.input[1] >= 8 && s.input[2] >= 8,
                 "model resnet20 needs image inputs (C, H, W) with H, W >= 8, got " << shape_str(s.input));
  auto m = std::make_unique<Sequential>();
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
  DT_INPUT_CHECK(s.definition.empty(), "model " << s.name << ": a model file's layer widths are its own (change the file)");
  const bool cnn = s.name == "simple_cnn" || s.name == "simplecnn";
  DT_INPUT_CHECK(cnn || s.name == "mlp", "model " << s.name << ": its layer widths are fixed (only mlp and "
                                                  << "simple_cnn take other widths)");
  std::vector<int64_t>& dst = cnn ? s.channels : s.hidden;
  DT_INPUT_CHECK(widths.size() == dst.size(), "model " << s.name << " has " << dst.size() << " hidden widths, not "
                                                       << widths.size());
  dst = widths;
  return s;
}

ModulePtr make_model(const ModelSpec& s) { return make_sequential_model(s); }

std::unique_ptr<Sequential> make_sequential_model(const ModelSpec& s) {
  DT_INPUT_CHECK(s.classes >= 2, "model " << s.name << ": need at least 2 classes, got " << s.classes);
  DT_INPUT_CHECK(!s.input.empty() && shape_numel(s.input) > 0,
                 "model " << s.name << ": empty input shape " << shape_str(s.input));
  Rng rng(derive_seed(s.seed, 1));
  if (!s.definition.empty()) return build_model_definition(s, rng);
  if (s.name == "mlp") return make_mlp(s, rng);
  if (s.name == "simple_cnn" || s.name == "simplecnn") return make_simple_cnn(s, rng);
  if (s.name == "resnet20") return make_resnet20(s, rng);
  std::string names;
  for (auto& n : model_names()) names += (names.empty() ? "" : ", ") + n;
  throw InputError("unknown model '" + s.name + "' (models: " + names + ")");
}

}  // namespace dtrain::nn

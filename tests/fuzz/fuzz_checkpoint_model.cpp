// Fuzz target: models rebuilt from a checkpoint's attributes, as `dtrain eval`, `generate`,
// `quantize`, `prune-export` and `--teacher` rebuild them: train::image_model_from_checkpoint and
// train::gpt_from_checkpoint on a checkpoint saved by save_checkpoint (so its checksum holds) and read
// back by load_checkpoint. The input is a recipe: a small model (mlp, simple_cnn, resnet20, one of
// a few model files, or a GPT) and its checkpoint, then edits of its attributes (input_shape,
// hidden, channels, classes, the stored definition, gpt's five sizes: any value, huge ones
// included) and of its tensors (dropped, another shape). The attributes may ask for any model; what
// is built must fit the parameters the file holds, and a small model that builds must run forward.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/models.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/lm_trainer.h"
#include "dtrain/train/trainer.h"
#include "fuzz_util.h"

using namespace dtrain;

namespace {

const char* const kDefinitions[] = {
    R"({"name": "f", "layers": [{"type": "conv", "out": 2, "kernel": 3, "padding": 1}, {"type": "batchnorm"},
        {"type": "relu"}, {"type": "global_avgpool"}, {"type": "linear", "out": "classes"}]})",
    R"({"name": "v", "layers": [{"type": "conv", "out": 4, "kernel": 2, "stride": 2}, {"type": "tokens"},
        {"type": "position_embedding"}, {"type": "transformer_block", "heads": 2, "mlp": 4}, {"type": "layernorm"},
        {"type": "first_token"}, {"type": "linear", "out": "classes"}]})",
    R"({"name": "r", "blocks": {"b": {"args": {"w": null}, "layer": {"type": "residual", "shortcut": "projection",
        "body": [{"type": "conv", "out": "$w", "kernel": 1, "stride": 2}]}}}, "layers": [{"type": "b", "w": 3},
        {"type": "flatten"}, {"type": "linear", "out": "classes"}]})"};

int64_t any_size(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.PickValueInArray<int64_t>(
          {0, -1, int64_t{1} << 31, int64_t{1} << 40, int64_t{1} << 62, INT64_MAX, INT64_MIN, 3037000500});
    case 1:
      return in.ConsumeIntegral<int64_t>();
    default:
      return in.ConsumeIntegralInRange<int64_t>(0, 40);
  }
}

std::vector<int64_t> any_sizes(FuzzedDataProvider& in, std::vector<int64_t> v) {
  if (v.empty() || in.ConsumeIntegralInRange(0, 5) == 0) v.resize(in.ConsumeIntegralInRange(0, 6));
  for (int n = in.ConsumeIntegralInRange(1, 3); n > 0 && !v.empty(); --n)
    v[in.ConsumeIntegralInRange<size_t>(0, v.size() - 1)] = any_size(in);
  return v;
}

// A small image model and its checkpoint (image_model_checkpoint: what prune-export writes).
train::CheckpointState image_recipe(FuzzedDataProvider& in) {
  train::ImageCheckpoint c;
  // resnet20 (272k parameters, slow to draw under ASan) one time in thirteen; the others alike.
  const int draw = in.ConsumeIntegralInRange(0, 12), kind = draw == 12 ? 2 : draw % 4 == 2 ? 3 : draw % 4;
  c.spec.name = kind == 0 ? "mlp" : kind == 1 ? "simple_cnn" : kind == 2 ? "resnet20" : "file";
  c.spec.classes = in.ConsumeIntegralInRange(2, 5);
  const int64_t side = in.ConsumeIntegralInRange(kind == 2 ? 8 : 4, 9);
  c.spec.input = {in.ConsumeIntegralInRange(1, 3), side, side};
  c.spec.hidden = {in.ConsumeIntegralInRange(1, 6)};
  c.spec.channels = {in.ConsumeIntegralInRange(1, 3), in.ConsumeIntegralInRange(1, 3)};
  if (kind == 3) c.spec.definition = in.PickValueInArray(kDefinitions);
  c.model = nn::make_sequential_model(c.spec);
  return train::image_model_checkpoint(c);
}

train::CheckpointState gpt_recipe(FuzzedDataProvider& in) {
  nn::GptConfig cfg;
  cfg.vocab = in.ConsumeIntegralInRange(2, 12);
  cfg.context = in.ConsumeIntegralInRange(1, 6);
  cfg.layers = in.ConsumeIntegralInRange(1, 2);
  cfg.heads = in.ConsumeIntegralInRange(1, 2);
  cfg.width = cfg.heads * in.ConsumeIntegralInRange(1, 3);
  nn::Gpt gpt(cfg);
  train::CheckpointState s;
  for (nn::Parameter* p : gpt.parameters()) s.tensors["param/" + p->name] = p->value.clone();
  s.strings["model"] = "gpt";
  s.int_lists["gpt"] = {cfg.vocab, cfg.context, cfg.layers, cfg.heads, cfg.width};
  return s;
}

// Up to four edits of the attributes and tensors.
void edit(FuzzedDataProvider& in, train::CheckpointState& s) {
  static const char* const lists[] = {"input_shape", "hidden", "channels", "gpt"};
  for (int n = in.ConsumeIntegralInRange(0, 4); n > 0 && in.remaining_bytes() > 0; --n) {
    switch (in.ConsumeIntegralInRange(0, 5)) {
      case 0:
      case 1: {
        std::vector<int64_t>& v = s.int_lists[in.PickValueInArray(lists)];
        v = any_sizes(in, v);
        break;
      }
      case 2:
        s.ints["classes"] = any_size(in);
        break;
      case 3:
        s.strings[in.ConsumeBool() ? "model" : "model_definition"] =
            in.ConsumeBool() ? in.PickValueInArray<std::string>({"mlp", "simple_cnn", "resnet20", "gpt", ""})
                             : in.ConsumeRandomLengthString(512);
        break;
      default: {  // a tensor dropped or given another shape
        if (s.tensors.empty()) break;
        auto it = std::next(s.tensors.begin(), in.ConsumeIntegralInRange<size_t>(0, s.tensors.size() - 1));
        if (in.ConsumeBool())
          s.tensors.erase(it);
        else
          it->second = Tensor::zeros({in.ConsumeIntegralInRange(0, 64)},
                                     in.ConsumeBool() ? DType::F32 : in.PickValueInArray({DType::BF16, DType::I32}));
      }
    }
  }
}

// A forward of one sample (or a few tokens) where the model is small enough to run at once.
void run_image(train::ImageCheckpoint& c) {
  if (shape_numel(c.spec.input) > 4096 || c.spec.input.size() != 3 || !c.spec.definition.empty()) return;
  Shape batch = {1};
  batch.insert(batch.end(), c.spec.input.begin(), c.spec.input.end());
  const Tensor y = c.model->forward(Tensor::full(batch, 0.5f));
  if (y.shape() != Shape{1, c.spec.classes}) fuzz::fail("the model gives " + shape_str(y.shape()));
}

void run_gpt(nn::Gpt& g) {
  const int64_t t = std::min<int64_t>(g.config().context, 4);
  if (g.config().vocab > 4096 || g.config().width > 256) return;
  Tensor ids = Tensor::zeros({1, t}, DType::I32);
  const Tensor y = g.forward(ids);
  if (y.numel() != t * g.config().vocab) fuzz::fail("the gpt gives " + y.str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const bool gpt = in.ConsumeIntegralInRange(0, 3) == 0;
  train::CheckpointState s = gpt ? gpt_recipe(in) : image_recipe(in);
  edit(in, s);
  const std::string path = (fuzz::fresh_scratch() / "model.h5").string();
  train::save_checkpoint(path, s);
  try {
    train::CheckpointState loaded = train::load_checkpoint(path);
    const int64_t held = train::held_parameters(loaded);
    if (gpt) {
      auto g = train::gpt_from_checkpoint(loaded);
      if (g->parameter_count() > held) fuzz::fail("a gpt of more parameters than the file holds was built");
      run_gpt(*g);
    } else {
      train::ImageCheckpoint c = train::image_model_from_checkpoint(path, loaded);
      if (c.model->parameter_count() > held) fuzz::fail("a model of more parameters than the file holds was built");
      run_image(c);
    }
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  fuzz::expect_no_open_hdf5_objects("load_checkpoint");
  return 0;
}

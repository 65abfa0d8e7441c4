// Models rebuilt from a checkpoint's attributes (image_model_from_checkpoint, gpt_from_checkpoint):
// attributes that ask for a model larger than the parameters the file holds are refused before the
// model is allocated, naming the file (the image models) and the attribute.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "dtrain/nn/gpt.h"
#include "dtrain/nn/models.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/lm_trainer.h"
#include "dtrain/train/trainer.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

std::string scratch_file(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / "dtrain-from-checkpoint-test";
  fs::create_directories(dir);
  return (dir / name).string();
}

// A checkpoint of a small mlp (784 -> 8 -> 10), saved and loaded back as a run would read it.
train::CheckpointState mlp_checkpoint() {
  train::ImageCheckpoint c;
  c.spec.name = "mlp";
  c.spec.input = {1, 28, 28};
  c.spec.hidden = {8};
  c.model = nn::make_sequential_model(c.spec);
  return train::image_model_checkpoint(c);
}

// The InputError of rebuilding the model of `s` once saved as `name`, "" if none; within seconds.
std::string image_error(const std::string& name, const train::CheckpointState& s) {
  const std::string path = scratch_file(name);
  train::save_checkpoint(path, s);
  train::CheckpointState loaded = train::load_checkpoint(path);
  const auto t0 = std::chrono::steady_clock::now();
  std::string e;
  try {
    train::image_model_from_checkpoint(path, loaded);
  } catch (const InputError& err) {
    e = err.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << name;
  return e;
}

}  // namespace

TEST(FromCheckpoint, ImageModelRebuildsWhenTheAttributesFitItsTensors) {
  EXPECT_EQ(image_error("fits.h5", mlp_checkpoint()), "");
}

TEST(FromCheckpoint, ImageAttributesAskingForAHugeModelAreRefusedWithoutAllocating) {
  train::CheckpointState s = mlp_checkpoint();
  s.int_lists["hidden"] = {int64_t{1} << 40};  // 2^50 parameters
  std::string e = image_error("hidden.h5", s);
  EXPECT_NE(e.find("model mlp: layer 1 (linear): its parameters ([1099511627776, 784], [1099511627776]) bring the "
                   "model past the 6370 parameters checkpoint '"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("hidden.h5' holds (attributes model, input_shape, hidden, channels, classes)"), std::string::npos)
      << e;

  s = mlp_checkpoint();
  s.int_lists["input_shape"] = {int64_t{1} << 32, int64_t{1} << 32, 4};  // past 2^63 elements
  e = image_error("input.h5", s);
  EXPECT_NE(e.find("layer <top> (input): its samples: shape [4294967296, 4294967296, 4] has more than 2^63"),
            std::string::npos)
      << e;

  s = mlp_checkpoint();
  s.ints["classes"] = int64_t{1} << 45;
  EXPECT_NE(image_error("classes.h5", s).find("past the 6370 parameters checkpoint"), std::string::npos);

  s = mlp_checkpoint();
  s.strings["model"] = "resnet20";
  s.int_lists["input_shape"] = {1 << 20, 8, 8};  // the stem's 16 x 2^20 x 3 x 3 weights
  EXPECT_NE(image_error("resnet.h5", s).find("layer 0 (conv): its parameters ([16, 1048576, 3, 3])"),
            std::string::npos);
}

TEST(FromCheckpoint, AStoredDefinitionIsBoundByTheFileToo) {
  train::CheckpointState s = mlp_checkpoint();
  s.strings["model_definition"] = R"({"name": "big", "layers": [{"type": "flatten"}, {"name": "fc", "type": "linear",
      "out": 1073741824}, {"type": "linear", "out": "classes"}]})";
  const std::string e = image_error("definition.h5", s);
  EXPECT_NE(e.find("definition.h5): layer fc (linear): its parameters ([1073741824, 784], [1073741824]) bring the "
                   "model past the 6370 parameters checkpoint '"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("classes, model_definition)"), std::string::npos) << e;
}

TEST(FromCheckpoint, GptAttributesAskingForMoreThanItsTensorsAreRefused) {
  nn::GptConfig cfg;
  cfg.vocab = 11, cfg.context = 6, cfg.layers = 2, cfg.heads = 2, cfg.width = 8;
  nn::Gpt gpt(cfg);
  train::CheckpointState s;
  for (nn::Parameter* p : gpt.parameters()) s.tensors["param/" + p->name] = p->value.clone();
  s.strings["model"] = "gpt";
  s.int_lists["gpt"] = {11, 6, 2, 2, 8};
  EXPECT_EQ(train::gpt_from_checkpoint(s)->parameter_count(), gpt.parameter_count());
  for (const std::vector<int64_t>& asked : std::vector<std::vector<int64_t>>{{11, int64_t{1} << 40, 2, 2, 8},
                                                                             {11, 6, int64_t{1} << 50, 2, 8},
                                                                             {11, 6, 2, 2, int64_t{1} << 62},
                                                                             {11, 6, 2, 2, 0}}) {
    s.int_lists["gpt"] = asked;
    try {
      train::gpt_from_checkpoint(s);
      FAIL() << "built a gpt of " << shape_str(asked);
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("the checkpoint's attribute gpt " + shape_str(asked) +
                                           " (vocab, context, layers, heads, width) asks for "),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("its tensors hold " + std::to_string(gpt.parameter_count())),
                std::string::npos)
          << e.what();
    }
  }
}

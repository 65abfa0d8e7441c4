// What a model file or a spec's sizes may ask for (nn::ModelLimits): nested blocks that expand
// exponentially, widths that ask for terabytes and files nested past the parser's stack are refused
// quickly, before anything of their size is allocated, naming the layer or the file.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "dtrain/nn/gpt.h"
#include "dtrain/nn/models.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

std::string write_file(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / "dtrain-model-bounds-test";
  fs::create_directories(dir);
  std::ofstream(dir / name) << text;
  return (dir / name).string();
}

// The InputError of building the model of file `name` holding `text` for 3x8x8 images, "" if none.
std::string build_error(const std::string& name, const std::string& text, nn::ModelLimits limits = {}) {
  try {
    nn::ModelSpec s;
    s.definition = nn::read_model_file(write_file(name, text));
    s.name = nn::model_definition_name(s.definition);
    s.definition_source = name;
    s.input = {3, 8, 8};
    s.limits = limits;
    nn::make_model(s);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(ModelBounds, NestedBlocksThatExpandExponentiallyAreRefusedFast) {
  // b0 holds four b1, each four b2, ...: 4^15 ReLUs once expanded, within the 32 levels of nesting.
  std::string blocks;
  for (int i = 0; i < 15; ++i) {
    const std::string next = "{\"type\": \"b" + std::to_string(i + 1) + "\"}";
    blocks += "\"b" + std::to_string(i) + "\": {\"layer\": {\"type\": \"sequential\", \"layers\": [" + next + ", " +
              next + ", " + next + ", " + next + "]}}, ";
  }
  blocks += R"("b15": {"layer": {"type": "relu"}})";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = build_error("exp.json", "{\"blocks\": {" + blocks + R"(}, "layers": [{"type": "b0"},
      {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(e.find("model exp (exp.json): layer "), std::string::npos) << e;
  EXPECT_NE(e.find("more than 65536 layers"), std::string::npos) << e;
}

TEST(ModelBounds, ParametersPastTheLimitAreRefusedBeforeTheLayerAllocates) {
  // 3 * 8 * 8 inputs to 2^30 outputs: 2^31.6 parameters, 12 GiB, past a limit of 2^30.
  const std::string e = build_error("wide.json", R"({"layers": [{"type": "flatten"}, {"name": "fc1", "type": "linear",
      "out": 1073741824}, {"type": "linear", "out": "classes"}]})",
                                    nn::ModelLimits{.parameters = int64_t{1} << 30});
  EXPECT_NE(e.find("layer fc1 (linear): its parameters ([1073741824, 192], [1073741824]) bring the model past the "
                   "limit of 1073741824 parameters"),
            std::string::npos)
      << e;
  // The stated maximum by default: 2^34.
  const std::string big = build_error("big.json", R"({"layers": [{"type": "conv", "out": 1073741824, "kernel": 8},
      {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(big.find("layer 0 (conv): its parameters ([1073741824, 3, 8, 8]"), std::string::npos) << big;
  EXPECT_NE(big.find("the limit of 17179869184 parameters"), std::string::npos) << big;
}

TEST(ModelBounds, FieldsAndSampleSizesAreBounded) {
  std::string e = build_error("field.json", R"({"layers": [{"type": "conv", "out": 99999999999999, "kernel": 1}]})");
  EXPECT_NE(e.find("layer 0 (conv): field \"out\" must be an integer in [1, 1073741824]"), std::string::npos) << e;
  // A 1x1 convolution padded by 2^20 on each side: 2^42 elements per sample, no parameters.
  e = build_error("pad.json", R"({"layers": [{"type": "conv", "out": 1, "kernel": 1, "padding": 1048576},
      {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(e.find("layer 0 (conv): it gives [1, 2097160, 2097160] (4398080065600 elements) per sample, more than "
                   "the 4294967296 accepted"),
            std::string::npos)
      << e;
}

TEST(ModelBounds, FilesNestedPastTheParsersStackAreRefusedUnparsed) {
  std::string e = build_error("deep.json", "{\"layers\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  EXPECT_NE(e.find("model file '"), std::string::npos) << e;
  EXPECT_NE(e.find("deep.json' nests objects and lists deeper than 64 levels"), std::string::npos) << e;
  // Brackets inside strings do not count.
  e = build_error("strings.json", R"({"name": ")" + std::string(1000, '[') + R"(", "layers": [{"type": "flatten"},
      {"type": "linear", "out": "classes"}]})");
  EXPECT_EQ(e, "");
  std::string section = "[layers";
  for (int i = 0; i < 100000; ++i) section += "/0";
  e = build_error("deep.ini", section + "]\ntype = relu\n");
  EXPECT_NE(e.find("deep.ini': section [layers/0/0"), std::string::npos) << e;
  EXPECT_NE(e.find("nests deeper than 64 levels"), std::string::npos) << e;
}

// A definition a checkpoint stores must read back: an INI file's bytes that are not UTF-8 pass
// through write_json but not read_json (found by fuzz_model_file: the name read threw a Boost error).
TEST(ModelBounds, AFileWhoseDefinitionDoesNotReadBackIsRefused) {
  const std::string e = build_error("latin1.ini", "[model]\nname = caf\xe9\n\n[layers/0]\ntype = flatten\n");
  EXPECT_NE(e.find("model file '"), std::string::npos) << e;
  EXPECT_NE(e.find("latin1.ini' does not give a definition that reads back"), std::string::npos) << e;
  EXPECT_THROW(nn::model_definition_name("{\"name\": \"caf\xe9\"}"), InputError);
  // A key holding NUL bytes (Boost's put_child asserts on the empty path between two; found by
  // fuzz_model_file): refused naming the file, whether the reader keeps the bytes after the first
  // NUL (the key check) or not (the layer's unknown field).
  const std::string k = build_error("nul.ini", std::string("[layers/0]\ntype = relu\nou\0\0t = 3\n", 33));
  EXPECT_TRUE(k.find("nul.ini': section [layers/0] has a key without a name or with a NUL byte") != std::string::npos ||
              k.find("model nul (nul.ini): layer 0 (relu): has no field") != std::string::npos)
      << k;
}

TEST(ModelBounds, BuiltInModelsCountTheirParametersAgainstTheLimit) {
  nn::ModelSpec s;
  s.name = "mlp";
  s.input = {1, 28, 28};
  s.hidden = {int64_t{1} << 40};
  s.limits.parameters_from = "the 12 parameters checkpoint 'c.h5' holds";
  try {
    nn::make_model(s);
    FAIL() << "an mlp of 2^50 parameters was built";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model mlp: layer 1 (linear): its parameters ([1099511627776, 784], "
                                         "[1099511627776]) bring the model past the 12 parameters checkpoint "
                                         "'c.h5' holds"),
              std::string::npos)
        << e.what();
  }
  s.hidden = {16};
  s.input = {int64_t{1} << 32, int64_t{1} << 32};
  EXPECT_THROW(nn::make_model(s), InputError);
  s.name = "resnet20";
  s.input = {3, int64_t{1} << 20, int64_t{1} << 20};  // 2^40 pixels: the stem's output is 2^44 per sample
  EXPECT_THROW(nn::make_model(s), InputError);
}

TEST(GptParameterCount, MatchesTheBuiltModel) {
  for (const nn::GptConfig& c : {nn::GptConfig{.vocab = 50, .context = 16, .layers = 2, .heads = 2, .width = 8},
                                 nn::GptConfig{.vocab = 256, .context = 32, .layers = 3, .heads = 4, .width = 32}}) {
    nn::Gpt g(c);
    EXPECT_EQ(nn::gpt_parameter_count(c), g.parameter_count());
    nn::GptConfig llama = c;  // untied, no position table, SwiGLU, half the key/value heads
    llama.kv_heads = c.heads / 2;
    nn::llama_shape(llama);
    EXPECT_EQ(nn::gpt_parameter_count(llama), nn::Gpt(llama).parameter_count());
  }
  EXPECT_EQ(nn::gpt_parameter_count(
                {.vocab = 256, .context = 128, .layers = int64_t{1} << 40, .heads = 8, .width = int64_t{1} << 20}),
            -1);
  EXPECT_EQ(nn::gpt_parameter_count({.vocab = 0}), -1);
  // A width whose MLP (4 x width) would pass int64: refused before any arithmetic on it.
  EXPECT_EQ(nn::gpt_parameter_count({.vocab = 256, .context = 128, .layers = 1, .heads = 1, .width = int64_t{1} << 62}),
            -1);
}

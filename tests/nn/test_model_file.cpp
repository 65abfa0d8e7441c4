// Model files (nn/model_file.h): the built-in models written as files in examples/models/ build the
// same parameters, the standard ResNets carry torchvision's names and sizes, the inferred shapes are
// the ones a forward produces, and a file that does not fit names the layer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "dtrain/nn/models.h"
#include "dtrain/nn/vision.h"
#include "gradcheck.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

const std::string kModels = std::string(DTRAIN_SOURCE_DIR) + "/examples/models/";

nn::ModelSpec file_spec(const std::string& path, Shape input, int64_t classes = 10) {
  nn::ModelSpec s;
  s.definition = nn::read_model_file(path);
  s.name = nn::model_definition_name(s.definition);
  s.definition_source = path;
  s.input = std::move(input);
  s.classes = classes;
  return s;
}

// A model file written by the test; returns its path.
std::string write_file(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / "dtrain-model-file-test";
  fs::create_directories(dir);
  std::ofstream(dir / name) << text;
  return (dir / name).string();
}

std::string build_error(const std::string& text, Shape input = {1, 8, 8}) {
  try {
    nn::make_model(file_spec(write_file("bad.json", text), std::move(input)));
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

// Same names, shapes and initial values (the layers draw from the seed in the same order), so the
// same outputs and training: the CLI test trains both for 10 steps.
TEST(ModelFile, BuiltInModelsWrittenAsFilesBuildTheSameParameters) {
  struct Case {
    std::string file, model;
    Shape input;
  };
  for (const Case& c :
       {Case{"mlp.json", "mlp", {1, 28, 28}}, Case{"simple_cnn.json", "simple_cnn", {1, 28, 28}},
        Case{"simple_cnn.ini", "simple_cnn", {3, 12, 12}}, Case{"resnet20.json", "resnet20", {3, 16, 16}}}) {
    nn::ModelSpec builtin;
    builtin.name = c.model;
    builtin.input = c.input;
    auto ref = nn::make_model(builtin);
    auto m = nn::make_model(file_spec(kModels + c.file, c.input));
    auto pr = ref->parameters(), pm = m->parameters();
    ASSERT_EQ(pm.size(), pr.size()) << c.file;
    EXPECT_EQ(m->parameter_count(), ref->parameter_count()) << c.file;
    for (size_t i = 0; i < pr.size(); ++i) {
      ASSERT_EQ(pm[i]->name, pr[i]->name) << c.file;
      ASSERT_EQ(pm[i]->value.shape(), pr[i]->value.shape()) << c.file << " " << pr[i]->name;
      for (int64_t k = 0; k < pr[i]->value.numel(); ++k)
        ASSERT_EQ(pm[i]->value.f32()[k], pr[i]->value.f32()[k]) << c.file << " " << pr[i]->name;
    }
    auto br = ref->buffers(), bm = m->buffers();
    ASSERT_EQ(bm.size(), br.size()) << c.file;
    for (size_t i = 0; i < br.size(); ++i) EXPECT_EQ(bm[i]->name, br[i]->name) << c.file;
  }
}

// torchvision's resnet18/resnet50 (num_classes=1000): 11,689,512 and 25,557,032 parameters, under
// its state_dict names; the shapes the builder inferred are those a forward gives.
TEST(ModelFile, StandardResNetsHaveTorchvisionsNamesAndSizes) {
  struct Case {
    std::string file;
    int64_t params;
    std::vector<std::string> names;
  };
  for (const Case& c :
       {Case{"resnet18.json",
             11689512,
             {"conv1.weight", "layer1.0.bn2.running_var", "layer2.0.downsample.0.weight", "layer4.1.conv2.weight",
              "fc.bias"}},
        Case{"resnet50.json",
             25557032,
             {"layer1.0.downsample.1.weight", "layer3.5.conv3.weight", "layer4.2.bn3.running_mean", "fc.weight"}}}) {
    auto m = nn::make_sequential_model(file_spec(kModels + c.file, {3, 32, 32}, 1000));
    EXPECT_EQ(m->parameter_count(), c.params) << c.file;
    std::set<std::string> names;
    for (nn::Parameter* p : m->parameters()) names.insert(p->name);
    for (nn::Buffer* b : m->buffers()) names.insert(b->name);
    for (const std::string& n : c.names) EXPECT_TRUE(names.count(n)) << c.file << " has no " << n;
    const std::vector<Shape> shapes = nn::layer_boundary_shapes(*m, {2, 3, 32, 32});
    EXPECT_EQ(shapes.back(), (Shape{2, 1000})) << c.file;
    EXPECT_EQ(shapes[4], (Shape{2, 64, 8, 8})) << c.file << " after the stem";
  }
}

TEST(ModelFile, IniAndJsonDescribeTheSameModel) {
  nn::ModelSpec a = file_spec(kModels + "simple_cnn.json", {1, 28, 28}),
                b = file_spec(kModels + "simple_cnn.ini", {1, 28, 28});
  EXPECT_EQ(nn::model_definition_name(b.definition), "simple_cnn");
  auto ma = nn::make_model(a), mb = nn::make_model(b);
  Tensor x = Tensor::full({2, 1, 28, 28}, 0.5f);
  Tensor ya = ma->forward(x).clone(), yb = mb->forward(x);
  for (int64_t i = 0; i < ya.numel(); ++i) ASSERT_EQ(ya.f32()[i], yb.f32()[i]);
}

TEST(ModelFile, AShapeThatDoesNotFitNamesTheLayer) {
  const std::string head = R"({"name": "t", "layers": [)";
  // a 5x5 kernel on the 4x4 image the pool leaves
  std::string e = build_error(head + R"({"type": "maxpool", "kernel": 2}, {"name": "wide", "type": "conv", "out": 4,
      "kernel": 5}, {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(e.find("bad.json"), std::string::npos) << e;
  EXPECT_NE(e.find("layer wide (conv)"), std::string::npos) << e;
  EXPECT_NE(e.find("[1, 4, 4]"), std::string::npos) << e;
  // a pooling window past its input: (1 - 2) / 2 + 1 truncates to 1 output (read past the image)
  e = build_error(head + R"({"type": "maxpool", "kernel": 8}, {"name": "late", "type": "maxpool", "kernel": 2},
      {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(e.find("layer late (maxpool): input [1, 1, 1] is smaller than the window 2"), std::string::npos) << e;
  // a residual whose body changes the channels, with an identity shortcut
  e = build_error(head + R"({"type": "residual", "body": [{"type": "conv", "out": 3, "kernel": 3, "padding": 1}]},
      {"type": "flatten"}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(e.find("layer 0 (residual)"), std::string::npos) << e;
  EXPECT_NE(e.find("projection"), std::string::npos) << e;
  // a convolution after flatten, inside a block
  e = build_error(head + R"({"type": "flatten"}, {"type": "sequential", "layers": [{"type": "relu"},
      {"type": "conv", "out": 2, "kernel": 1}]}, {"type": "linear", "out": "classes"}]})");
  EXPECT_NE(e.find("layer 1.1 (conv): needs image inputs"), std::string::npos) << e;
  // a misspelt field, an unknown type, a missing argument, a model that does not end in the classes
  e = build_error(head + R"({"type": "conv", "out": 2, "kernal": 3}]})");
  EXPECT_NE(e.find("layer 0 (conv): has no field \"kernal\""), std::string::npos) << e;
  e = build_error(head + R"({"type": "convolution", "out": 2}]})");
  EXPECT_NE(e.find("layer 0 (convolution): unknown type"), std::string::npos) << e;
  e = build_error(R"({"blocks": {"b": {"args": {"width": null}, "layer": {"type": "conv", "out": "$width",
      "kernel": 1}}}, "layers": [{"type": "b"}]})");
  EXPECT_NE(e.find("needs argument \"width\""), std::string::npos) << e;
  e = build_error(head + R"({"type": "flatten"}, {"type": "linear", "out": 7}]})");
  EXPECT_NE(e.find("not the 10 classes"), std::string::npos) << e;
}

TEST(ModelFile, UnreadableFilesAreNamed) {
  try {
    nn::read_model_file(write_file("broken.json", "{\"layers\": [\n{\"type\": \"relu\"\n"));
    FAIL() << "a truncated file was read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("broken.json' line"), std::string::npos) << e.what();
  }
  EXPECT_THROW(nn::read_model_file("/nonexistent/model.json"), InputError);
}

// The vision-transformer pieces against finite differences: patch tokens with the class token, the
// position embedding, a bidirectional encoder block (exact GELU), the class token read out.
TEST(ModelFile, VisionTransformerPiecesMatchFiniteDifferences) {
  const std::string file = write_file("vit.json", R"({"layers": [
      {"name": "conv_proj", "type": "conv", "out": 8, "kernel": 2, "stride": 2},
      {"name": "", "type": "tokens"}, {"name": "encoder", "type": "position_embedding"},
      {"name": "block", "type": "transformer_block", "heads": 2, "mlp": 12},
      {"type": "layernorm"}, {"type": "first_token"}, {"type": "linear", "out": "classes"}]})");
  auto m = nn::make_model(file_spec(file, {1, 4, 6}, 3));
  Rng rng(5);
  // At a generic point: the class token starts at zero and the position embedding near it, where the
  // first LayerNorm sees a row of variance ~4e-4 and a step of 1e-2 is no small difference.
  for (nn::Parameter* p : m->parameters())
    if (p->name == "class_token" || p->name == "encoder.pos_embedding")
      p->value.copy_from(test::random_tensor(p->value.shape(), rng));
  test::gradcheck(*m, test::random_tensor({2, 1, 4, 6}, rng), 7, 1e-2f, 3e-2);
  std::set<std::string> names;
  for (nn::Parameter* p : m->parameters()) names.insert(p->name);
  for (const char* n : {"class_token", "encoder.pos_embedding", "block.self_attention.in_proj_weight",
                        "block.self_attention.out_proj.bias", "block.mlp.3.weight", "block.ln_2.bias"})
    EXPECT_TRUE(names.count(n)) << "no parameter " << n;
}

// A bidirectional block sees later tokens: changing the last token changes the first's output,
// which the GPT's causal attention would not allow.
TEST(ModelFile, TransformerBlockAttendsInBothDirections) {
  Rng rng(3);
  auto block = nn::make_vit_block(8, 2, 16, 1e-6f, rng);
  Tensor x = test::random_tensor({1, 5, 8}, rng);
  Tensor y0 = block->forward(x).clone();
  x.f32()[4 * 8] += 1.f;
  Tensor y1 = block->forward(x);
  double moved = 0;
  for (int64_t i = 0; i < 8; ++i) moved += std::abs(y1.f32()[i] - y0.f32()[i]);
  EXPECT_GT(moved, 1e-4);
}

// A torchvision-style block (flat names, a projection shortcut, an activation after the sum)
// against finite differences.
TEST(ModelFile, ResidualWithProjectionAndAfterMatchesFiniteDifferences) {
  const std::string file = write_file("block.json", R"({"layers": [
      {"name": "b", "type": "residual", "names": "flat", "shortcut": "projection", "shortcut_name": "downsample",
       "after": "gelu", "body": [{"name": "conv1", "type": "conv", "out": 4, "kernel": 3, "stride": 2, "padding": 1},
                                  {"name": "bn1", "type": "batchnorm"}]},
      {"type": "global_avgpool"}, {"type": "linear", "out": "classes"}]})");
  auto m = nn::make_model(file_spec(file, {2, 5, 5}, 3));
  std::set<std::string> names;
  for (nn::Parameter* p : m->parameters()) names.insert(p->name);
  EXPECT_TRUE(names.count("b.conv1.weight") && names.count("b.downsample.0.weight") &&
              names.count("b.downsample.1.bias"));
  Rng rng(9);
  test::gradcheck(*m, test::random_tensor({3, 2, 5, 5}, rng), 7, 1e-2f, 3e-2);
}

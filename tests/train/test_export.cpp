// dtrain export's names and layouts (include/dtrain/train/export.h) and the safetensors layout,
// read back byte by byte. That PyTorch loads the files and predicts the same is checked by
// benchmarks/peers/check_export.py (tests/cli runs it where torch is installed).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "dtrain/nn/gpt.h"
#include "dtrain/train/export.h"
#include "dtrain/train/lm_trainer.h"
#include "train_test_util.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

train::CheckpointState tiny_gpt_checkpoint(nn::Gpt& gpt) {
  train::CheckpointState s;
  for (nn::Parameter* p : gpt.parameters()) s.tensors["param/" + p->name] = p->value.clone();
  s.tensors["optim/wte.exp_avg"] = Tensor::zeros({1});
  train::write_lm_shape(gpt.config(), s);  // "model" = "gpt" and its shape
  return s;
}

const Tensor& find(const train::NamedTensorList& l, const std::string& name) {
  for (const auto& [n, t] : l)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

}  // namespace

TEST(Export, GptTakesGpt2NamesAndConv1dLayouts) {
  nn::GptConfig cfg;
  cfg.vocab = 11, cfg.context = 6, cfg.layers = 2, cfg.heads = 2, cfg.width = 8;
  nn::Gpt gpt(cfg);
  const train::CheckpointState s = tiny_gpt_checkpoint(gpt);
  const train::NamedTensorList out = train::export_tensors(s, train::ExportNames::PyTorch);
  EXPECT_EQ(out.size(), gpt.parameters().size());  // no optimizer state, nothing twice
  std::set<std::string> names;
  for (const auto& [n, t] : out) names.insert(n);
  for (const char* n :
       {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.h.1.ln_1.bias",
        "transformer.h.1.attn.c_attn.weight", "transformer.h.0.attn.c_proj.bias", "transformer.h.0.ln_2.weight",
        "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  const Tensor& qkv = s.tensors.at("param/blocks.1.0.body.1.qkv.weight");  // (3C, C)
  const Tensor& c_attn = find(out, "transformer.h.1.attn.c_attn.weight");  // (C, 3C)
  ASSERT_EQ(c_attn.shape(), (Shape{8, 24}));
  for (int64_t o = 0; o < 24; ++o)
    for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(c_attn.f32()[i * 24 + o], qkv.f32()[o * 8 + i]) << o << "," << i;
  const Tensor& fc2 = find(out, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(fc2.shape(), (Shape{32, 8}));
  const Tensor& ln = find(out, "transformer.h.0.ln_1.weight");
  EXPECT_EQ(std::memcmp(ln.raw(), s.tensors.at("param/blocks.0.0.body.0.weight").raw(), ln.nbytes()), 0);
  // dtrain's own names: the parameters as they are.
  const train::NamedTensorList plain = train::export_tensors(s, train::ExportNames::Dtrain);
  EXPECT_EQ(find(plain, "blocks.1.0.body.1.qkv.weight").shape(), (Shape{24, 8}));
  train::CheckpointState odd = s;
  odd.tensors["param/blocks.0.2.extra"] = Tensor::zeros({1});
  EXPECT_THROW(
      {
        try {
          train::export_tensors(odd, train::ExportNames::PyTorch);
        } catch (const InputError& e) {
          EXPECT_NE(std::string(e.what()).find("blocks.0.2.extra"), std::string::npos) << e.what();
          throw;
        }
      },
      InputError);
}

TEST(Export, ImageModelsGainNumBatchesTrackedAndLoseDropoutState) {
  train::CheckpointState s;
  s.strings["model"] = "resnet20";
  s.tensors["param/0.weight"] = Tensor::full({4, 1, 3, 3}, 0.5f);
  s.tensors["param/1.weight"] = Tensor::full({4}, 1.f);
  s.tensors["buffer/1.running_mean"] = Tensor::zeros({4});
  s.tensors["buffer/1.running_var"] = Tensor::full({4}, 1.f);
  s.tensors["buffer/3.rng_state"] = Tensor::zeros({2}, DType::I64);
  const train::NamedTensorList out = train::export_tensors(s, train::ExportNames::PyTorch);
  std::set<std::string> names;
  for (const auto& [n, t] : out) names.insert(n);
  EXPECT_EQ(names, (std::set<std::string>{"0.weight", "1.weight", "1.running_mean", "1.running_var",
                                          "1.num_batches_tracked"}));
  EXPECT_EQ(find(out, "1.num_batches_tracked").dtype(), DType::I64);
  EXPECT_EQ(find(out, "1.num_batches_tracked").dim(), 0);
  EXPECT_EQ(train::export_tensors(s, train::ExportNames::Dtrain).size(), 5u);  // the RNG state kept
}

// The file: 8-byte little-endian header size; the header a multiple of 8 bytes; each tensor's entry
// names its dtype, shape and offsets, and the bytes there are the tensor's.
TEST(Export, SafetensorsLayoutReadBack) {
  const std::string dir = test::temp_dir("export");
  Tensor a = Tensor::from({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor b = Tensor::empty({}, DType::I64);
  b.data<int64_t>()[0] = 7;
  const std::string path = dir + "/w.safetensors";
  train::write_safetensors(path, {{"a.weight", a}, {"b.count", b}}, {{"model", "mlp"}});
  std::ifstream f(path, std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[static_cast<size_t>(i)]);
  ASSERT_EQ(n % 8, 0u);
  ASSERT_EQ(raw.size(), 8 + n + 24 + 8);
  const std::string header = raw.substr(8, n);
  EXPECT_NE(header.find("\"__metadata__\":{\"model\":\"mlp\"}"), std::string::npos) << header;
  EXPECT_NE(header.find("\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}"), std::string::npos)
      << header;
  EXPECT_NE(header.find("\"b.count\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]}"), std::string::npos)
      << header;
  EXPECT_EQ(std::memcmp(raw.data() + 8 + n, a.raw(), 24), 0);
  EXPECT_EQ(std::memcmp(raw.data() + 8 + n + 24, b.raw(), 8), 0);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_THROW(train::write_safetensors(dir + "/bad.safetensors", {{"quote\"d", a}}, {}), InputError);
  fs::remove_all(dir);
}

// --init-from: safetensors under Hugging Face's Llama and GPT-2 names or dtrain's, one file or
// shards with an index, f32/bf16/f16; strict errors naming every tensor; broken files refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dtrain/core/error.h"
#include "dtrain/train/import.h"
#include "dtrain/train/lm_names.h"
#include "lm_test_util.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

nn::GptConfig tiny(bool llama) {
  nn::GptConfig c;
  c.vocab = 30;
  c.context = 8;
  c.layers = 2;
  c.heads = 4;
  c.width = 16;
  if (llama) {
    c.kv_heads = 2;
    c.mlp_width = 24;
    nn::llama_shape(c);
  }
  return c;
}

fs::path scratch(const std::string& name) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / ("import-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

int64_t import_into(nn::Gpt& model, const std::string& where) {
  const auto files = train::list_safetensors(where);
  return train::import_pretrained(model, where, train::lm_pretrained_names(model.config(), files));
}

void expect_same_parameters(nn::Gpt& a, nn::Gpt& b) {  // bitwise
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t k = 0; k < a.parameters().size(); ++k) {
    const Tensor &x = a.parameters()[k]->value, &y = b.parameters()[k]->value;
    ASSERT_EQ(x.shape(), y.shape()) << a.parameters()[k]->name;
    for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.f32()[i], y.f32()[i]) << a.parameters()[k]->name << " at " << i;
  }
}

std::string error_of(nn::Gpt& model, const std::string& where) {
  try {
    import_into(model, where);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// export -> import is bitwise under each naming, for the Llama and the GPT.
TEST(Import, ExportThenImportIsBitwise) {
  const fs::path dir = scratch("roundtrip");
  for (bool llama : {true, false})
    for (bool hf : {true, false}) {
      nn::GptConfig c = tiny(llama);
      c.seed = 3;
      nn::Gpt source(c);
      const std::string file = (dir / "w.safetensors").string();
      test::write_pretrained(file, source, hf);
      c.seed = 4;
      nn::Gpt target(c);
      EXPECT_EQ(import_into(target, file), static_cast<int64_t>(target.parameters().size()));
      expect_same_parameters(target, source);
    }
}

// A folder of two shards listed by model.safetensors.index.json, in bf16 and f16: each value is the
// original rounded to that type.
TEST(Import, ShardsWithAnIndexInHalfPrecision) {
  const fs::path dir = scratch("shards");
  nn::GptConfig c = tiny(true);
  nn::Gpt source(c);
  const train::NamedTensorList all = train::export_tensors(test::lm_state(source), train::ExportNames::PyTorch);
  train::NamedTensorList first, second;
  std::string map;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, t] = all[i];
    Tensor low = Tensor::empty(t.shape(), i % 2 ? DType::BF16 : DType::F16);
    cpu_engine().cast(t, low);
    (i < all.size() / 2 ? first : second).push_back({name, low});
    map += std::string(map.empty() ? "" : ",") + "\"" + name + "\": \"" +
           (i < all.size() / 2 ? "a.safetensors" : "b.safetensors") + "\"";
  }
  train::write_safetensors((dir / "a.safetensors").string(), first, {});
  train::write_safetensors((dir / "b.safetensors").string(), second, {});
  std::ofstream(dir / "model.safetensors.index.json") << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  nn::Gpt target(c);
  import_into(target, dir.string());
  const train::NamedTensorList back = train::export_tensors(test::lm_state(target), train::ExportNames::PyTorch);
  ASSERT_EQ(back.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const Tensor& want = all[i].second;
    for (int64_t k = 0; k < want.numel(); ++k) {
      const float v = want.f32()[k];
      const float rounded = i % 2 ? bf16_to_float(float_to_bf16(v)) : f16_to_float(float_to_f16(v));
      ASSERT_EQ(back[i].second.f32()[k], rounded) << all[i].first;
    }
  }
}

// Strict: a missing, an unexpected and a misshapen tensor are all named in one error; GPT-2's
// attention masks and tied lm_head are left alone.
TEST(Import, StrictErrorsNameEveryTensor) {
  const fs::path dir = scratch("strict");
  nn::GptConfig c = tiny(true);
  nn::Gpt source(c);
  train::NamedTensorList t = train::export_tensors(test::lm_state(source), train::ExportNames::PyTorch);
  t.erase(std::remove_if(t.begin(), t.end(), [](auto& e) { return e.first == "model.layers.1.mlp.up_proj.weight"; }),
          t.end());
  t.push_back({"model.layers.9.extra.weight", Tensor::zeros({2, 2})});
  for (auto& [name, v] : t)
    if (name == "model.layers.0.self_attn.k_proj.weight") v = Tensor::zeros({5, 16});
  train::write_safetensors((dir / "w.safetensors").string(), t, {});
  nn::Gpt target(c);
  const std::string e = error_of(target, (dir / "w.safetensors").string());
  EXPECT_NE(e.find("3 tensor(s)"), std::string::npos) << e;
  for (const char* name : {"missing model.layers.1.mlp.up_proj.weight", "unexpected model.layers.9.extra.weight",
                           "model.layers.0.self_attn.k_proj.weight is [5, 16]"})
    EXPECT_NE(e.find(name), std::string::npos) << name << " in: " << e;

  nn::GptConfig g = tiny(false);  // GPT-2 as Hugging Face stores it: no prefix, masks, lm_head
  nn::Gpt gpt(g);
  train::NamedTensorList hf = train::export_tensors(test::lm_state(gpt), train::ExportNames::PyTorch);
  for (auto& [name, v] : hf) name = name.substr(std::string("transformer.").size());
  hf.push_back({"h.0.attn.bias", Tensor::full({1, 1, 8, 8}, 1.f)});
  hf.push_back({"lm_head.weight", gpt.parameters()[0]->value});
  train::write_safetensors((dir / "gpt2.safetensors").string(), hf, {});
  nn::Gpt gpt_target(g);
  EXPECT_EQ(error_of(gpt_target, (dir / "gpt2.safetensors").string()), "");
  expect_same_parameters(gpt_target, gpt);
}

// Files that are not safetensors are refused naming the file.
TEST(Import, BrokenFilesAreNamed) {
  const fs::path dir = scratch("broken");
  nn::Gpt model(tiny(true));
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir / name, std::ios::binary) << bytes;
    return (dir / name).string();
  };
  auto header = [](const std::string& json, size_t data) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
    return s + json + std::string(data, '\0');
  };
  for (const std::string& path :
       {write("short", "abc"), write("huge", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}"),
        write("json", header("{\"a\": [", 0)),
        write("deep", header("{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}", 0)),
        write("outside", header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)),
        write("size", header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
        write("dtype", header(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8)),
        write("shape", header(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8))}) {
    const std::string e = error_of(model, path);
    EXPECT_NE(e.find(path), std::string::npos) << "'" << e << "' names " << path;
  }
  EXPECT_NE(error_of(model, (dir / "none").string()).find("does not exist"), std::string::npos);
  // A shard index 100,000 arrays deep: refused before it is parsed, naming the index.
  const fs::path deep = scratch("deep-index");
  std::ofstream(deep / "model.safetensors.index.json") << std::string(100000, '[') << std::string(100000, ']');
  const std::string e = error_of(model, deep.string());
  EXPECT_NE(e.find("model.safetensors.index.json' nests objects and arrays deeper than"), std::string::npos) << e;
}

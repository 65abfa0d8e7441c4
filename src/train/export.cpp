#include "dtrain/train/export.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/train/config.h"
#include "dtrain/train/lm_trainer.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

// (rows, cols) -> (cols, rows), a new tensor: the engine's axis swap on [1, rows, cols, 1].
Tensor transposed(const Tensor& t, const std::string& name) {
  DT_INPUT_CHECK(t.dim() == 2 && t.dtype() == DType::F32,
                 "export: " << name << " is " << t.str() << ", not an f32 matrix");
  const int64_t r = t.size(0), c = t.size(1);
  Tensor out = Tensor::empty({c, r});
  cpu_engine().permute_0213(t, 1, r, c, 1, out);
  return out;
}

// A GPT parameter's GPT-2 name, and whether its matrix is transposed to GPT-2's (in, out).
// dtrain's block i is blocks.i.0 (Residual: LayerNorm, attention) and blocks.i.1 (Residual:
// LayerNorm, Linear, GELU, Linear).
std::pair<std::string, bool> gpt2_name(const std::string& name) {
  if (name == "wte" || name == "wpe") return {"transformer." + name + ".weight", false};
  if (name == "ln_f.weight" || name == "ln_f.bias") return {"transformer." + name, false};
  static const std::regex block(R"(blocks\.(\d+)\.([01])\.body\.(0|1\.qkv|1\.proj|1|3)\.(weight|bias))");
  std::smatch m;
  DT_INPUT_CHECK(std::regex_match(name, m, block), "export: GPT parameter '" << name << "' has no GPT-2 name");
  const bool attn = m[2] == "0";
  const std::string part = m[3], what = m[4];
  std::string gpt2;
  if (part == "0")
    gpt2 = attn ? "ln_1" : "ln_2";
  else if (part == "1.qkv" && attn)
    gpt2 = "attn.c_attn";
  else if (part == "1.proj" && attn)
    gpt2 = "attn.c_proj";
  else if (part == "1" && !attn)
    gpt2 = "mlp.c_fc";
  else if (part == "3" && !attn)
    gpt2 = "mlp.c_proj";
  DT_INPUT_CHECK(!gpt2.empty(), "export: GPT parameter '" << name << "' has no GPT-2 name");
  return {"transformer.h." + std::string(m[1]) + "." + gpt2 + "." + what, part != "0" && what == "weight"};
}

// Rows [first, first + rows) of t, a new tensor.
Tensor rows_of(const Tensor& t, int64_t first, int64_t rows) { return t.slice0(first, first + rows).clone(); }

// ASCII names only, without the characters JSON would need escaped.
void check_name(const std::string& name) {
  DT_INPUT_CHECK(!name.empty() && std::all_of(name.begin(), name.end(),
                                              [](char c) { return c > 0x20 && c < 0x7f && c != '"' && c != '\\'; }),
                 "export: tensor name '" << name << "' cannot be written");
}

// `text` as the inside of a JSON string.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(c));
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
  }
  return "?";
}

}  // namespace

std::map<std::string, std::vector<HfRows>> llama_hf_layout(const nn::GptConfig& g) {
  std::map<std::string, std::vector<HfRows>> out;
  out["wte"] = {{"model.embed_tokens.weight", -1}};
  if (!g.tied) out["lm_head"] = {{"lm_head.weight", -1}};
  out["ln_f.weight"] = {{"model.norm.weight", -1}};
  const int64_t hd = g.width / g.heads, f = g.hidden();
  for (int64_t i = 0; i < g.layers; ++i) {
    const std::string ours = "blocks." + std::to_string(i) + ".", hf = "model.layers." + std::to_string(i) + ".";
    out[ours + "0.body.0.weight"] = {{hf + "input_layernorm.weight", -1}};
    out[ours + "1.body.0.weight"] = {{hf + "post_attention_layernorm.weight", -1}};
    for (const std::string what : {"weight", "bias"}) {
      if (what == "bias" && !g.bias) continue;
      out[ours + "0.body.1.qkv." + what] = {{hf + "self_attn.q_proj." + what, g.heads * hd},
                                            {hf + "self_attn.k_proj." + what, g.kv() * hd},
                                            {hf + "self_attn.v_proj." + what, g.kv() * hd}};
      out[ours + "0.body.1.proj." + what] = {{hf + "self_attn.o_proj." + what, -1}};
      out[ours + "1.body.1." + what] = {{hf + "mlp.gate_proj." + what, f}, {hf + "mlp.up_proj." + what, f}};
      out[ours + "1.body.3." + what] = {{hf + "mlp.down_proj." + what, -1}};
    }
  }
  return out;
}

NamedTensorList export_tensors(const CheckpointState& s, ExportNames names) {
  const auto model = s.strings.find("model");
  const bool llama = model != s.strings.end() && model->second == "llama";
  const bool gpt = model != s.strings.end() && model->second == "gpt";
  const auto hf = llama ? llama_hf_layout(read_lm_shape(s)) : std::map<std::string, std::vector<HfRows>>();
  std::map<std::string, Tensor> out;
  for (const auto& [key, t] : s.tensors) {
    const bool param = key.rfind("param/", 0) == 0, buffer = key.rfind("buffer/", 0) == 0;
    if (!param && !buffer) continue;
    const std::string name = key.substr(param ? 6 : 7);
    if (names == ExportNames::Dtrain) {
      out[name] = t;
    } else if (llama) {
      const auto parts = hf.find(name);
      DT_INPUT_CHECK(parts != hf.end(), "export: Llama parameter '" << name << "' has no Hugging Face name");
      int64_t first = 0;
      for (const HfRows& p : parts->second) {
        const int64_t rows = p.rows < 0 ? t.size(0) : p.rows;
        DT_INPUT_CHECK(t.dim() >= 1 && first + rows <= t.size(0),
                       "export: Llama parameter '" << name << "' " << t.str() << " does not hold " << p.name);
        out[p.name] = p.rows < 0 ? t : rows_of(t, first, rows);
        first += rows;
      }
    } else if (gpt) {
      const auto [gpt2, transpose] = gpt2_name(name);
      out[gpt2] = transpose ? transposed(t, name) : t;
    } else if (name.ends_with(".rng_state")) {
      continue;  // Dropout's RNG state: PyTorch's Dropout has none
    } else {
      out[name] = t;
      if (name.ends_with(".running_mean")) {
        Tensor count = Tensor::empty({}, DType::I64);
        count.data<int64_t>()[0] = 0;
        out[name.substr(0, name.size() - 12) + "num_batches_tracked"] = count;
      }
    }
  }
  DT_INPUT_CHECK(!out.empty(), "export: the checkpoint holds no parameters");
  return {out.begin(), out.end()};
}

void write_safetensors(const std::string& path, const NamedTensorList& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::ostringstream header;
  header << "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    check_name(k);
    header << (first ? "" : ",") << '"' << k << "\":\"" << json_escaped(v) << '"';
    first = false;
  }
  header << '}';
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    check_name(name);
    DT_CHECK(t.device().is_cpu(), "export: " << name << " is not on the host");
    header << ",\"" << name << "\":{\"dtype\":\"" << safetensors_dtype(t.dtype()) << "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) header << (d ? "," : "") << t.size(d);
    header << "],\"data_offsets\":[" << offset << ',' << offset + t.nbytes() << "]}";
    offset += t.nbytes();
  }
  header << '}';
  std::string h = header.str();
  h.append((8 - h.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DT_INPUT_CHECK(f, "export: cannot create '" << tmp << "'");
    unsigned char size[8];
    for (int i = 0; i < 8; ++i)
      size[i] = static_cast<unsigned char>((static_cast<uint64_t>(h.size()) >> (8 * i)) & 0xff);
    f.write(reinterpret_cast<const char*>(size), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& [name, t] : tensors)
      f.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
    f.flush();
    DT_INPUT_CHECK(f, "export: writing '" << tmp << "' failed (disk full?)");
  }
  fs::rename(tmp, path);
}

void write_hdf5_tensors(const std::string& path, const NamedTensorList& tensors,
                        const std::map<std::string, std::string>& metadata) {
  CheckpointState s;
  for (const auto& [name, t] : tensors) {
    DT_INPUT_CHECK(name.find('/') == std::string::npos, "export: tensor name '" << name << "' has a '/'");
    s.tensors[name] = t;
  }
  s.strings = metadata;
  save_checkpoint(path, s);
}

}  // namespace dtrain::train

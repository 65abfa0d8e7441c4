#include "dtrain/train/export.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/train/config.h"
#include "dtrain/train/lm_names.h"
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

namespace {

// The parameters of `s` with LoRA's adapters merged into their weights, W + (alpha / rank) B A, and
// left out; the tensors as they are where there are none.
std::map<std::string, Tensor> merged_lora(const CheckpointState& s) {
  std::map<std::string, Tensor> out = s.tensors;
  const auto rank = s.ints.find("lora_rank");
  if (rank == s.ints.end()) return out;
  const float scale = std::strtof(s.strings.at("lora_alpha").c_str(), nullptr) / static_cast<float>(rank->second);
  for (const auto& [key, a] : s.tensors) {
    if (!key.ends_with(".lora_A")) continue;
    const std::string base = key.substr(0, key.size() - 7);
    const auto b = s.tensors.find(base + ".lora_B"), w = s.tensors.find(base + ".weight");
    DT_INPUT_CHECK(b != s.tensors.end() && w != s.tensors.end() && a.dim() == 2 && b->second.dim() == 2 &&
                       w->second.shape() == (Shape{b->second.size(0), a.size(1)}) && b->second.size(1) == a.size(0),
                   "export: LoRA adapter " << key << " does not fit its layer");
    Tensor merged = w->second.clone();
    cpu_engine().gemm(false, false, merged.size(0), merged.size(1), a.size(0), scale, b->second, a, 1.f, merged);
    out[base + ".weight"] = merged;
    out.erase(key);
    out.erase(base + ".lora_B");
  }
  return out;
}

}  // namespace

NamedTensorList export_tensors(const CheckpointState& s, ExportNames names) {
  const auto model = s.strings.find("model");
  const bool lm = model != s.strings.end() && is_language_model(model->second);
  const auto layout = lm ? lm_hf_layout(read_lm_shape(s)) : std::map<std::string, std::vector<SourceTensor>>();
  std::map<std::string, Tensor> out;
  // Other frameworks' names: LoRA's adapters merged into the weights they adapt.
  const std::map<std::string, Tensor> tensors = names == ExportNames::Dtrain ? s.tensors : merged_lora(s);
  for (const auto& [key, t] : tensors) {
    const bool param = key.rfind("param/", 0) == 0, buffer = key.rfind("buffer/", 0) == 0;
    if (!param && !buffer) continue;
    const std::string name = key.substr(param ? 6 : 7);
    if (names == ExportNames::Dtrain) {
      out[name] = t;
    } else if (lm) {  // its rows under each of its names, GPT-2's matrices as (in, out)
      const auto parts = layout.find(name);
      DT_INPUT_CHECK(parts != layout.end(),
                     "export: " << model->second << " parameter '" << name << "' has no Hugging Face name");
      int64_t first = 0;
      for (const SourceTensor& p : parts->second) {
        const int64_t rows = p.rows < 0 ? t.size(0) : p.rows;
        DT_INPUT_CHECK(t.dim() >= 1 && first + rows <= t.size(0),
                       "export: parameter '" << name << "' " << t.str() << " does not hold " << p.name);
        const Tensor part = p.rows < 0 ? t : rows_of(t, first, rows);
        out[p.name] = p.transposed ? transposed(part, name) : part;
        first += rows;
      }
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

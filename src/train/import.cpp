// Pretrained weights from safetensors (include/dtrain/train/import.h).
#include "dtrain/train/import.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/json.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/parallel/tensor_parallel.h"

namespace dtrain::train {

namespace fs = std::filesystem;
namespace pt = boost::property_tree;

namespace {

constexpr uint64_t kMaxHeader = uint64_t{100} << 20;  // safetensors' own limit on the JSON header

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

// A JSON array of non-negative integers (property_tree: children with empty keys).
std::vector<uint64_t> unsigned_list(const pt::ptree& node, const std::string& what, const std::string& file) {
  std::vector<uint64_t> out;
  for (const auto& [key, child] : node) {
    const std::string v = child.get_value<std::string>();
    DT_INPUT_CHECK(key.empty() && child.empty() && !v.empty() && v.size() <= 19 &&
                       v.find_first_not_of("0123456789") == std::string::npos,
                   "'" << file << "': " << what << " holds '" << v << "', not a list of non-negative integers");
    out.push_back(std::stoull(v));
  }
  return out;
}

// The entries of one safetensors file, their offsets from the file's start.
void list_file(const std::string& file, std::map<std::string, SafetensorsEntry>& out,
               const std::set<std::string>* only = nullptr) {
  std::ifstream in(file, std::ios::binary);
  DT_INPUT_CHECK(in, "'" << file << "' cannot be opened");
  const uint64_t size = fs::file_size(file);
  unsigned char head[8];
  DT_INPUT_CHECK(size >= 8 && in.read(reinterpret_cast<char*>(head), 8),
                 "'" << file << "' is not safetensors: " << size << " bytes");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | head[i];  // little-endian
  DT_INPUT_CHECK(n >= 2 && n <= kMaxHeader && n <= size - 8,
                 "'" << file << "' is not safetensors: a header of " << n << " bytes in a file of " << size);
  std::string header(n, '\0');
  DT_INPUT_CHECK(in.read(header.data(), static_cast<std::streamsize>(n)), "'" << file << "': its header is cut short");
  const uint64_t data = 8 + n, data_bytes = size - data;
  for (const auto& [name, e] : parse_json(header, "'" + file + "' (its header)")) {
    if (name == "__metadata__") continue;
    if (only && !only->count(name)) continue;
    DT_INPUT_CHECK(!name.empty() && !out.count(name), "'" << file << "': tensor '" << name << "' is listed twice");
    SafetensorsEntry entry;
    entry.file = file;
    entry.dtype = e.get<std::string>("dtype", "");
    const int64_t es = dtype_bytes(entry.dtype);
    DT_INPUT_CHECK(es > 0, "'" << file << "': tensor '" << name << "' has dtype '" << entry.dtype << "'");
    const auto shape = e.get_child_optional("shape");
    const auto offsets = e.get_child_optional("data_offsets");
    DT_INPUT_CHECK(shape && offsets, "'" << file << "': tensor '" << name << "' lacks its shape or data_offsets");
    for (uint64_t d : unsigned_list(*shape, "the shape of '" + name + "'", file)) {
      DT_INPUT_CHECK(d < (uint64_t{1} << 40), "'" << file << "': tensor '" << name << "' has a dimension of " << d);
      entry.shape.push_back(static_cast<int64_t>(d));
    }
    const std::vector<uint64_t> at = unsigned_list(*offsets, "the data_offsets of '" + name + "'", file);
    DT_INPUT_CHECK(at.size() == 2 && at[0] <= at[1] && at[1] <= data_bytes,
                   "'" << file << "': tensor '" << name << "' lies outside the file's " << data_bytes << " data bytes");
    const int64_t numel = shape_numel(entry.shape, "tensor '" + name + "' of '" + file + "'");
    DT_INPUT_CHECK(static_cast<uint64_t>(numel) <= data_bytes / static_cast<uint64_t>(es) &&
                       static_cast<uint64_t>(numel * es) == at[1] - at[0],
                   "'" << file << "': tensor '" << name << "' of " << shape_str(entry.shape) << " " << entry.dtype
                       << " has " << at[1] - at[0] << " bytes");
    entry.begin = data + at[0];
    entry.end = data + at[1];
    out[name] = entry;
  }
}

}  // namespace

std::map<std::string, SafetensorsEntry> list_safetensors(const std::string& where) {
  std::map<std::string, SafetensorsEntry> out;
  DT_INPUT_CHECK(fs::exists(where), "'" << where << "' does not exist");
  if (!fs::is_directory(where)) {
    list_file(where, out);
    return out;
  }
  const fs::path index = fs::path(where) / "model.safetensors.index.json";
  if (fs::exists(index)) {  // shards: each tensor from the file the weight map names
    std::ifstream in(index);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    DT_INPUT_CHECK(text.size() <= kMaxHeader, "'" << index.string() << "' holds " << text.size() << " bytes");
    const pt::ptree tree = parse_json(text, "'" + index.string() + "'");
    const auto map = tree.get_child_optional("weight_map");
    DT_INPUT_CHECK(map, "'" << index.string() << "' has no weight_map");
    std::map<std::string, std::set<std::string>> by_file;
    for (const auto& [name, file] : *map) {
      const std::string f = file.get_value<std::string>();
      DT_INPUT_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                     "'" << index.string() << "': tensor '" << name << "' is in '" << f << "', not a file beside it");
      by_file[f].insert(name);
    }
    for (const auto& [file, names] : by_file) {
      list_file((fs::path(where) / file).string(), out, &names);
      for (const std::string& name : names)
        DT_INPUT_CHECK(out.count(name),
                       "'" << index.string() << "' puts '" << name << "' in " << file << ", which does not hold it");
    }
    return out;
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(where))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  DT_INPUT_CHECK(files.size() == 1, "'" << where << "' holds " << files.size()
                                        << " .safetensors files and no model.safetensors.index.json to list them");
  list_file(files[0], out);
  return out;
}

Tensor read_safetensor(const std::string& name, const SafetensorsEntry& e) {
  const int64_t es = dtype_bytes(e.dtype);
  DT_INPUT_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16",
                 "'" << e.file << "': tensor '" << name << "' is " << e.dtype << ", not F32, BF16 or F16");
  const int64_t n = shape_numel(e.shape, "tensor '" + name + "'");
  std::vector<char> bytes(static_cast<size_t>(n * es));
  std::ifstream in(e.file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(e.begin));
  DT_INPUT_CHECK(in && in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())),
                 "'" << e.file << "': tensor '" << name << "' cannot be read");
  Tensor t = Tensor::empty(e.shape);
  float* out = t.f32();
  for (int64_t i = 0; i < n; ++i) {  // little-endian on disk, as on every host dtrain runs on
    if (e.dtype == "F32") {
      std::memcpy(out + i, bytes.data() + i * 4, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + i * 2, 2);
      out[i] = e.dtype == "BF16" ? bf16_to_float(h) : f16_to_float(h);
    }
  }
  return t;
}

namespace {

// (rows, cols) -> (cols, rows).
Tensor transposed(const Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  Tensor out = Tensor::empty({c, r});
  cpu_engine().permute_0213(t, 1, r, c, 1, out);
  return out;
}

// A parameter's one-rank tensor from its sources; `wrong` collects what does not fit.
Tensor assemble(const std::string& param, const Shape& want, const std::vector<SourceTensor>& sources,
                const std::map<std::string, SafetensorsEntry>& files, std::vector<std::string>& wrong) {
  std::vector<Tensor> parts;
  int64_t rows = 0;
  for (const SourceTensor& s : sources) {
    const auto e = files.find(s.name);
    if (e == files.end()) {
      wrong.push_back("missing " + s.name + (s.name == param ? "" : " (for " + param + ")"));
      continue;
    }
    Shape shape = e->second.shape;
    if (s.transposed && shape.size() == 2) std::swap(shape[0], shape[1]);
    const bool fits = !shape.empty() && shape.size() == want.size() && (s.rows < 0 || shape[0] == s.rows) &&
                      std::equal(shape.begin() + 1, shape.end(), want.begin() + 1);
    if (!fits) {
      wrong.push_back(s.name + " is " + shape_str(e->second.shape) + (s.transposed ? " (transposed)" : "") +
                      ", not the " + (s.rows < 0 ? shape_str(want) : std::to_string(s.rows) + " rows") + " of " +
                      param + " " + shape_str(want));
      continue;
    }
    Tensor t = read_safetensor(s.name, e->second);
    parts.push_back(s.transposed ? transposed(t) : t);
    rows += shape[0];
  }
  if (parts.size() != sources.size()) return Tensor();
  if (rows != want[0]) {
    wrong.push_back(param + " " + shape_str(want) + " gets " + std::to_string(rows) + " rows from the file");
    return Tensor();
  }
  if (parts.size() == 1) return parts[0];
  Tensor whole = Tensor::empty(want);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    Tensor dst = whole.slice0(at, at + p.size(0));
    dst.copy_from(p);
    at += p.size(0);
  }
  return whole;
}

}  // namespace

int64_t import_pretrained(nn::Module& model, const std::string& where,
                          const PretrainedNames& names) {
  const std::map<std::string, SafetensorsEntry> files = list_safetensors(where);
  const std::map<std::string, Shape> shapes = parallel::full_parameter_shapes(model);
  std::vector<std::string> wrong;
  std::set<std::string> used;
  std::map<std::string, Tensor> full;
  int64_t loaded = 0;
  std::map<std::string, nn::Parameter*> by_name;
  for (nn::Parameter* p : model.parameters()) by_name[p->name] = p;
  for (const auto& [param, shape] : shapes) {
    const std::vector<SourceTensor> sources = names.sources(param);
    if (sources.empty()) {  // not in pretrained weights (LoRA's adapters): keeps what it drew
      full[param] = host_copy(by_name.at(param)->value);
      continue;
    }
    for (const SourceTensor& s : sources) used.insert(s.name);
    Tensor t = assemble(param, shape, sources, files, wrong);
    if (t.defined()) full[param] = t;
    ++loaded;
  }
  for (const auto& [name, e] : files)
    if (!used.count(name) && !names.known(name)) wrong.push_back("unexpected " + name + " " + shape_str(e.shape));
  if (!wrong.empty()) {
    std::string list;
    for (size_t i = 0; i < wrong.size() && i < 20; ++i) list += "\n  " + wrong[i];
    if (wrong.size() > 20) list += "\n  ... and " + std::to_string(wrong.size() - 20) + " more";
    DT_INPUT_CHECK(false, "option --init-from " << where << " (" << names.scheme << " names): " << wrong.size()
                                                << " tensor(s) do not fit the model:" << list);
  }
  parallel::load_full_parameters(model, full);
  return loaded;
}

}  // namespace dtrain::train

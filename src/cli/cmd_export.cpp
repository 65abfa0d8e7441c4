// dtrain export --checkpoint X --out Y [--format safetensors|hdf5] [--names pytorch|dtrain]: the
// weights of a checkpoint (include/dtrain/train/export.h) for PyTorch and other tools. The metadata
// carries what rebuilding the model needs: the model, its shape lists (the GPT's vocab, context,
// layers, heads, width; an image model's input shape and widths), its classes and the input
// normalisation; benchmarks/peers/check_export.py loads the file into the PyTorch model.
#include <boost/program_options.hpp>
#include <cstdio>
#include <sstream>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/nn/layers.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/export.h"
#include "dtrain/train/options.h"
#include "dtrain/train/quantize.h"

namespace po = boost::program_options;

namespace dtrain::cli {

namespace {

template <typename T>
std::string joined(const T* v, int64_t n) {
  std::ostringstream os;
  os.precision(9);
  for (int64_t i = 0; i < n; ++i) os << (i ? "," : "") << v[i];
  return os.str();
}

std::map<std::string, std::string> export_metadata(const train::CheckpointState& s, const std::string& names) {
  std::map<std::string, std::string> m{{"format", "dtrain-export-1"}, {"names", names}};
  for (const char* k :
       {"model", "model_definition", "rope_base"})  // a model file's layers (JSON); a Llama's rotary base
    if (auto it = s.strings.find(k); it != s.strings.end()) m[k] = it->second;
  for (const auto& [k, v] : s.int_lists) m[k] = joined(v.data(), static_cast<int64_t>(v.size()));
  for (const char* k : {"classes", "step"})
    if (auto it = s.ints.find(k); it != s.ints.end()) m[k] = std::to_string(it->second);
  for (const auto& [key, t] : s.tensors)
    if (key.rfind("meta/norm_", 0) == 0 && t.dtype() == DType::F32) m[key.substr(5)] = joined(t.f32(), t.numel());
  return m;
}

}  // namespace

int cmd_export(int argc, char** argv) {
  std::string ckpt, out, format = "safetensors", names = "pytorch";
  bool adapters = false;
  po::options_description opts("Options");
  opts.add_options()("checkpoint", po::value<std::string>(&ckpt), "checkpoint file, or a directory (its newest)")(
      "out", po::value<std::string>(&out), "file to write")(
      "format", po::value<std::string>(&format)->default_value(format), "safetensors or hdf5")(
      "names", po::value<std::string>(&names)->default_value(names),
      "pytorch (image models: the nn.Sequential's names; the GPT: GPT-2's names and layouts; a Llama: Hugging Face's; "
      "LoRA's adapters merged into their weights) or dtrain (adapters apart)")(
      "adapters-only", po::bool_switch(&adapters),
      "with --names dtrain: only LoRA's adapters (lora_A, lora_B of each adapted projection)");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain export --checkpoint X --out Y [options]", vm)) return 0;
  DT_INPUT_CHECK(!ckpt.empty(), "option --checkpoint is required");
  DT_INPUT_CHECK(!out.empty(), "option --out is required");
  DT_INPUT_CHECK(format == "safetensors" || format == "hdf5",
                 "option --format must be safetensors or hdf5, got '" << format << "'");
  DT_INPUT_CHECK(names == "pytorch" || names == "dtrain",
                 "option --names must be pytorch or dtrain, got '" << names << "'");
  if (comm::Runtime::get().topology().rank != 0) return 0;  // one file: rank 0 writes it
  const std::string path = train::resolve_checkpoint(ckpt, "checkpoint");
  const train::CheckpointState s = train::load_checkpoint_set(path);
  DT_INPUT_CHECK(!train::is_int8_checkpoint(s),
                 "checkpoint '" << path << "' is an int8 checkpoint: export its fp32 checkpoint");
  train::NamedTensorList tensors =
      train::export_tensors(s, names == "pytorch" ? train::ExportNames::PyTorch : train::ExportNames::Dtrain);
  if (adapters) {  // LoRA's adapters alone, under dtrain's names
    DT_INPUT_CHECK(names == "dtrain", "option --adapters-only writes dtrain's names: give --names dtrain");
    std::erase_if(tensors, [](const auto& e) { return !nn::is_lora_adapter(e.first); });
    DT_INPUT_CHECK(!tensors.empty(), "option --adapters-only: checkpoint '" << path << "' holds no LoRA adapters");
  }
  const std::map<std::string, std::string> meta = export_metadata(s, names);
  if (format == "safetensors")
    train::write_safetensors(out, tensors, meta);
  else
    train::write_hdf5_tensors(out, tensors, meta);
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors) bytes += t.nbytes();
  std::printf("exported %zu tensors (%.2f MiB, %s names) of %s to %s (%s)\n", tensors.size(), bytes / 1048576.0,
              names.c_str(), path.c_str(), out.c_str(), format.c_str());
  return 0;
}

}  // namespace dtrain::cli

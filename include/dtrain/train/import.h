#pragma once
// `--init-from`: pretrained weights from safetensors, one file or a folder of shards with their
// model.safetensors.index.json, in f32, bf16 or f16, under dtrain's names or another framework's
// (Hugging Face's GPT-2 and Llama names: the LM task's PretrainedNames). Strict: every parameter
// must be there in its shape, and every tensor of the files must be used (or known to be
// ignorable, such as GPT-2's attention masks); all that is wrong is named in one error.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/tensor.h"
#include "dtrain/nn/module.h"

namespace dtrain::train {

// One tensor of a safetensors file: its file, dtype ("F32", "BF16", "F16", ...), shape and bytes
// [begin, end) from the file's start.
struct SafetensorsEntry {
  std::string file, dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// The tensors of a safetensors file, or of a folder: the files its model.safetensors.index.json's
// weight_map names, else its one *.safetensors file. InputError naming the file for a header that
// is not safetensors (its size, JSON, a dtype, shape or offsets outside the data, a tensor twice).
std::map<std::string, SafetensorsEntry> list_safetensors(const std::string& where);
// One tensor's bytes as f32 (F32, BF16 and F16 are read; InputError names another dtype).
Tensor read_safetensor(const std::string& name, const SafetensorsEntry& e);

// Where a parameter's rows come from: the file's tensors, stacked by rows in this order (rows -1:
// all of the tensor's), each transposed first when `transposed` (a GPT-2 Conv1D (in, out) weight).
struct SourceTensor {
  std::string name;
  int64_t rows = -1;
  bool transposed = false;
};
struct PretrainedNames {
  // No sources: a parameter pretrained weights do not hold (LoRA's adapters) keeps its value.
  std::function<std::vector<SourceTensor>(const std::string& parameter)> sources;
  // A file's tensor that some part of the whole model takes (maybe another pipeline stage's), or
  // one to leave (GPT-2's attention masks): every other one is unexpected.
  std::function<bool(const std::string& tensor)> known;
  std::string scheme;  // "dtrain", "gpt2", "llama": for messages
};

// Loads every parameter of `model` (this rank's part of a dp x tp x pp layout: the tensors of its
// stage only are read, whole, and tp-split parameters keep their slice) from `where`. Returns the
// number of parameters loaded.
int64_t import_pretrained(nn::Module& model, const std::string& where,
                          const PretrainedNames& names);

}  // namespace dtrain::train

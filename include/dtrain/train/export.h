#pragma once
// `dtrain export`: a checkpoint's weights (parameters and buffers; no optimizer state) under dtrain's
// names or PyTorch's, as safetensors or HDF5, for evaluation and serving outside dtrain.
//
// PyTorch names: an image model's module paths already are those of the PyTorch nn.Sequential of
// the same layers ("0.weight", "4.0.body.1.running_mean"); BatchNorm gains its num_batches_tracked
// (i64, 0: dtrain does not count) and dtrain-only buffers (Dropout's RNG state) are left out. The
// GPT takes GPT-2's names and layouts: transformer.wte.weight, transformer.wpe.weight,
// transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias} with
// the four projections' weights transposed to (in, out) (GPT-2's Conv1D), transformer.ln_f.*; the
// unembedding is tied (lm_head.weight = transformer.wte.weight) and not written twice. A Llama
// takes Hugging Face's Llama names. Both layouts are lm_names.h's lm_hf_layout.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain::train {

enum class ExportNames { Dtrain, PyTorch };
using NamedTensorList = std::vector<std::pair<std::string, Tensor>>;

// The tensors of checkpoint `s` (a load_checkpoint_set result) in file order (sorted by name).
// LoRA's adapters stay apart under dtrain's names and are merged into their weights under PyTorch's.
// Throws InputError naming the tensor a GPT checkpoint lacks or does not lay out as expected.
NamedTensorList export_tensors(const CheckpointState& s, ExportNames names);

// safetensors: an 8-byte little-endian header size, a JSON header (each tensor's dtype, shape and
// [begin, end) byte offsets into the data, and "__metadata__" strings), padded with spaces to a
// multiple of 8 bytes, then the tensors' bytes in header order. Written to `path`.tmp and renamed.
void write_safetensors(const std::string& path, const NamedTensorList& tensors,
                       const std::map<std::string, std::string>& metadata);

// The same tensors as datasets at the root of an HDF5 file (dtrain's checkpoint writer: dtype
// attributes, a checksum), with `metadata` as string attributes.
void write_hdf5_tensors(const std::string& path, const NamedTensorList& tensors,
                        const std::map<std::string, std::string>& metadata);

}  // namespace dtrain::train

#pragma once
// Checkpoints: one HDF5 file, data only. Written to "<name>.tmp" and renamed, so a crash never
// leaves a broken file under the final name; a CRC-32 over every tensor is checked on load.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/nn/module.h"

namespace dtrain::train {

struct CheckpointState {
  // "param/<name>", "buffer/<name>" (BatchNorm statistics, dropout RNG states), "optim/<name>"
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> strings;             // model name, optimizer kind, ...
  std::map<std::string, int64_t> ints;                    // step, epoch, batch_in_epoch, world size, ...
  std::map<std::string, std::vector<int64_t>> int_lists;  // input shape, hidden widths
};

void save_checkpoint(const std::string& path, const CheckpointState& s);
// Throws InputError naming the file when it is missing, not HDF5, truncated or fails its checksum.
CheckpointState load_checkpoint(const std::string& path);
// A file is returned as is; for a directory, its newest "ckpt-*.h5". Throws InputError when none.
std::string resolve_checkpoint(const std::string& file_or_dir);
// Before a checkpoint: throws InputError naming the first parameter with a NaN or an infinity, the
// step and the rank, so diverged weights never replace a good checkpoint.
void check_finite_weights(const std::vector<nn::Parameter*>& params, int64_t step, int rank);

}  // namespace dtrain::train

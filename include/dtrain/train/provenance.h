#pragma once
// Where a run's numbers came from: dtrain's version and git commit, the libraries it runs on
// (oneDNN, MPI, HDF5; CUDA, cuDNN, NCCL where built), host, processor, the world layout and the
// whole effective configuration (config_ini). The first line of every metrics file and an
// attribute of every checkpoint, so a figure or a checkpoint can be traced to what made it.
#include <string>

#include "dtrain/train/metrics.h"

namespace dtrain::train {

// `layout`: the world, e.g. "2 ranks: dp 2 x tp 1 x pp 1"; `config_ini`: the run's configuration.
JsonFields run_provenance(const std::string& layout, const std::string& config_ini);

// What the checkpoint's provenance says changed against this run, in one line ("" when nothing
// did): every option of the effective configuration whose value differs, or which only one side
// has, but --resume itself.
std::string resume_changes(const std::string& checkpoint_provenance, const std::string& config_ini);

}  // namespace dtrain::train

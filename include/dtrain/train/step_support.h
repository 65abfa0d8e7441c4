#pragma once
// What both training loops do around a step, written once: the device's side of the gradient
// exchange (NCCL wiring, the compute stream), the GPU allocator's counts and report, and fp16's
// loss scaler with its skip agreed over the ranks. The one place in src/train that knows CUDA from
// the CPU.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/device.h"
#include "dtrain/nn/module.h"
#include "dtrain/optim/loss_scaler.h"

namespace dtrain::train {

// The engine's compute stream of `dev` as a cudaStream_t (null on the CPU): DataParallel orders
// the gradient exchange after it by events.
void* compute_stream_of(Device dev);

// On a GPU with NCCL: an NCCL communicator over `group` whose collectives wait (by an event, not
// the host) for the work queued on the compute stream, so a bucket goes out once its gradients
// exist. Null on the CPU or without NCCL (a CUDA-aware MPI then takes the device buffers through
// `group` itself). Collective over `group`.
std::unique_ptr<comm::Communicator> gpu_gradient_communicator(comm::Communicator& group, Device dev,
                                                              const std::string& name);

// cudaMalloc calls of the caching allocator of `dev` so far (0 on the CPU): the steps after the first
// two, which sized every buffer, must not raise it.
int64_t gpu_malloc_count(Device dev);
// "allocated 12.0 MiB (peak 40.0 MiB), reserved ...; 0 cudaMalloc calls inside the steps after the
// first two" for a GPU ("" on the CPU); the mallocs part only after more than two steps.
std::string gpu_memory_report(Device dev, int64_t steps_run, int64_t step_mallocs);

// The memory one rank may fill, in bytes, and where the figure comes from: `configured_mb` when
// positive; else a GPU's whole memory, or the node's (MemTotal) divided among its `local_ranks`.
// 0 when it cannot be found.
struct MemoryBudget {
  int64_t bytes = 0;   // 0: unknown (no check)
  std::string source;  // "--memory-per-rank-mb", "this node's memory over its 2 rank(s)", ...
};
MemoryBudget memory_per_rank(double configured_mb, Device dev, int local_ranks);

// fp16's dynamic loss scaler (null for other precisions: bf16 has fp32's exponent range).
std::unique_ptr<optim::LossScaler> make_loss_scaler(const std::string& precision, int64_t growth_interval,
                                                    float init_scale);
// Unscales and checks `params`' gradients for inf/NaN and updates the scale; returns whether the
// optimizer steps. Ranks that hold different parameters (ZeRO-1 slices, tp shards, pipeline
// stages) agree over `agree_over` (one 1-float Max allreduce), so a step is taken everywhere or
// nowhere. Null scaler: true.
bool unscale_and_agree(optim::LossScaler* scaler, const std::vector<nn::Parameter*>& params,
                       comm::Communicator* agree_over);

}  // namespace dtrain::train

#include "dtrain/train/step_support.h"

#include <algorithm>
#include <fstream>

#include "dtrain/comm/nccl.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif

namespace dtrain::train {

void* compute_stream_of(Device dev) {
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (dev.type == DeviceType::CUDA) return cuda::compute_stream(dev.index);
#endif
  (void)dev;
  return nullptr;
}

std::unique_ptr<comm::Communicator> gpu_gradient_communicator(comm::Communicator& group, Device dev,
                                                              const std::string& name) {
  if (dev.type != DeviceType::CUDA || !comm::nccl_compiled()) return nullptr;
  std::unique_ptr<comm::Communicator> nccl = comm::make_nccl_communicator(group, dev.index, name);
  comm::nccl_set_input_stream(*nccl, compute_stream_of(dev));
  return nccl;
}

int64_t gpu_malloc_count(Device dev) {
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (dev.type == DeviceType::CUDA) return cuda::allocator_stats(dev.index).device_mallocs;
#endif
  (void)dev;
  return 0;
}

std::string gpu_memory_report(Device dev, int64_t steps_run, int64_t step_mallocs) {
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (dev.type != DeviceType::CUDA) return "";
  std::string report = cuda::format_stats(cuda::allocator_stats(dev.index));
  if (steps_run > 2)
    report +=
        "; " + std::to_string(step_mallocs) + " cudaMalloc calls inside the steps after each batch size's first two";
  return report;
#else
  (void)dev, (void)steps_run, (void)step_mallocs;
  return "";
#endif
}

std::unique_ptr<optim::LossScaler> make_loss_scaler(const std::string& precision, int64_t growth_interval,
                                                    float init_scale) {
  if (precision != "fp16") return nullptr;
  optim::LossScalerOptions o;
  o.growth_interval = growth_interval;
  o.init_scale = init_scale;
  return std::make_unique<optim::LossScaler>(o);
}

bool unscale_and_agree(optim::LossScaler* scaler, const std::vector<nn::Parameter*>& params,
                       comm::Communicator* agree_over) {
  if (!scaler) return true;
  bool finite = scaler->unscale(params);
  if (agree_over && agree_over->size() > 1) {
    Tensor bad = Tensor::from({1}, {finite ? 0.f : 1.f});
    agree_over->allreduce(bad, comm::ReduceOp::Max)->wait();
    finite = bad.f32()[0] == 0.f;
  }
  scaler->update(finite);
  return finite;
}

}  // namespace dtrain::train

namespace dtrain::train {

MemoryBudget memory_per_rank(double configured_mb, Device dev, int local_ranks) {
  if (configured_mb > 0) return {static_cast<int64_t>(configured_mb * 1048576.0), "--memory-per-rank-mb"};
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (dev.type == DeviceType::CUDA) {
    const double gib = cuda::device_info(dev.index).memory_gib;
    return {static_cast<int64_t>(gib * 1073741824.0), "the memory of cuda:" + std::to_string(dev.index)};
  }
#endif
  (void)dev;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") {
      const int ranks = std::max(local_ranks, 1);
      return {kib * 1024 / ranks, "this node's memory over its " + std::to_string(ranks) + " rank(s)"};
    }
    meminfo.ignore(256, '\n');
  }
  return {0, ""};
}

}  // namespace dtrain::train

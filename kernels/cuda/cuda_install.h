#pragma once
// The two entry points of dtrain_kernels_cuda that the engine registry (kernels/cpu/cpu_engine.cpp)
// calls from enable_cuda(). Plain C++: no CUDA header, so the CPU side compiles without nvcc.
#include <memory>

#include "dtrain/kernels/engine.h"

namespace dtrain::cuda::detail {

// Registers the caching allocator for DeviceType::CUDA; returns the number of visible GPUs
// (0 when the driver finds none, in which case nothing is registered).
int install();
std::unique_ptr<Engine> make_engine(int device_index);

}  // namespace dtrain::cuda::detail

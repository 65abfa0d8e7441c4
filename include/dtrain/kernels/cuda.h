#pragma once
// The CUDA engine's own API, beyond the Engine contract: its caching allocator's statistics, its
// streams and the events that order them, and the device's peak rates. Defined in
// dtrain_kernels_cuda, which exists when dtrain was built with CUDA (DTRAIN_WITH_CUDA_ENGINE is
// then defined for everything linking dtrain_kernels). Call dtrain::enable_cuda() first.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/core/tensor.h"

namespace dtrain::cuda {

// Device memory of one GPU as the caching allocator sees it. `allocated` is what live tensors
// hold, `reserved` what the allocator got from cudaMalloc (allocated + cached), `device_mallocs`
// how many cudaMalloc calls it made: after warm-up a training step must not raise it.
struct AllocatorStats {
  size_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
  int64_t device_mallocs = 0, cache_hits = 0;
};
AllocatorStats allocator_stats(int device);
void reset_peak_stats(int device);
// Returns every cached (free) block to the driver.
void empty_cache(int device);
std::string format_stats(const AllocatorStats& s);  // "allocated 12.0 MiB (peak 40.0 MiB), reserved ..."

// The engine's streams, as cudaStream_t in a void* so this header needs no CUDA include. Kernels,
// cuBLASLt and cuDNN run on the compute stream; collectives (NCCL) belong on the comm stream.
void* compute_stream(int device);
void* comm_stream(int device);
// Stream ordering by events, never by a host sync: the comm stream waits for everything queued on
// the compute stream so far (gradients of a bucket are final), or the reverse (reduced gradients
// are back before the optimizer reads them).
void comm_waits_for_compute(int device);
void compute_waits_for_comm(int device);

// Batch prefetch on the engine's copy stream. upload_async queues the copy of a page-locked host
// tensor into `dst` after the compute work queued so far (which may still read dst's previous
// contents) and returns at once, with the event that marks the copy's end (released with the
// pointer). compute_waits_for orders the compute stream after that event (on the device);
// host_waits_for blocks until it fired, before the host rewrites the page-locked source.
std::shared_ptr<void> upload_async(const Tensor& pinned_src, Tensor& dst);
void compute_waits_for(const std::shared_ptr<void>& uploaded, int device);
void host_waits_for(const std::shared_ptr<void>& uploaded);

struct DeviceInfo {
  std::string name;
  int compute_capability = 0;  // 80, 90, ...
  int sms = 0;
  double clock_ghz = 0, memory_gib = 0;
  // Dense peak TFLOP/s from SM count x clock x per-SM rate of the architecture (0 when unknown).
  double peak_fp32 = 0, peak_tf32 = 0, peak_bf16 = 0;
};
DeviceInfo device_info(int device);
// "CUDA runtime 13.0, driver 13.0, cuDNN 91300" (what this build runs on), for the provenance.
std::string library_versions();

// A host tensor in page-locked memory (cudaHostAlloc): the engine's copies from and to it are
// asynchronous on the compute stream, so a batch's upload overlaps the work queued before it.
Tensor pinned_empty(const Shape& shape, DType dtype);

}  // namespace dtrain::cuda

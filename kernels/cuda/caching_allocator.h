#pragma once
// A caching allocator for one GPU: freed blocks go to a size-ordered free list and are handed out
// again, so after the first step (warm-up) no cudaMalloc/cudaFree happens in a step. Blocks are
// reused in stream order: every kernel runs on the engine's compute stream, so a block freed after
// its last use was queued cannot be overwritten before that use ran. A buffer used on the comm
// stream must be kept alive until compute_waits_for_comm() (the holder keeps its Tensor).
#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

#include "dtrain/kernels/cuda.h"

namespace dtrain::cuda {

class CachingAllocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  void* allocate(size_t bytes);
  void release(void* ptr);
  AllocatorStats stats();
  void reset_peak();
  void empty_cache();

  // 512-byte granules up to 1 MiB, 2 MiB granules above: few distinct sizes, little waste.
  static size_t round_size(size_t bytes);

 private:
  void free_cached_locked();
  int device_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;       // size -> block
  std::unordered_map<void*, size_t> live_;  // block -> size
  AllocatorStats st_;
};

// The allocator of device `index` (created on first use, never destroyed: tensors may outlive
// static destructors).
CachingAllocator& allocator_for(int index);

}  // namespace dtrain::cuda

#include "caching_allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "cuda_common.h"

namespace dtrain::cuda {

size_t CachingAllocator::round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20;
  if (bytes < (size_t{1} << 20)) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

void* CachingAllocator::allocate(size_t bytes) {
  size_t size = round_size(bytes ? bytes : 1);
  std::lock_guard<std::mutex> lock(mu_);
  // The smallest cached block that fits, unless it is more than twice the request (a large block
  // kept for a small tensor would stop the large one from being reused).
  auto it = free_.lower_bound(size);
  void* p = nullptr;
  if (it != free_.end() && it->first <= 2 * size) {
    size = it->first;
    p = it->second;
    free_.erase(it);
    ++st_.cache_hits;
  } else {
    int prev = 0;
    DT_CUDA_CHECK(cudaGetDevice(&prev));
    DT_CUDA_CHECK(cudaSetDevice(device_));
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {  // give the cache back to the driver and try once more
      (void)cudaGetLastError();
      free_cached_locked();
      e = cudaMalloc(&p, size);
    }
    cudaSetDevice(prev);
    DT_CHECK(e == cudaSuccess, "cudaMalloc of " << size << " bytes on cuda:" << device_ << " failed ("
                                                << cudaGetErrorString(e) << "); " << format_stats(st_));
    ++st_.device_mallocs;
    static const bool trace = std::getenv("DTRAIN_CUDA_MALLOC_TRACE") != nullptr;
    if (trace) std::fprintf(stderr, "dtrain: cudaMalloc %zu bytes on cuda:%d (call %lld)\n", size, device_,
                            static_cast<long long>(st_.device_mallocs));
    st_.reserved += size;
    st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
  }
  live_[p] = size;
  st_.allocated += size;
  st_.peak_allocated = std::max(st_.peak_allocated, st_.allocated);
  return p;
}

void CachingAllocator::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return;
  st_.allocated -= it->second;
  free_.emplace(it->second, ptr);
  live_.erase(it);
}

void CachingAllocator::free_cached_locked() {
  cudaDeviceSynchronize();  // cached blocks may still be read by queued work
  for (auto& [size, p] : free_) {
    cudaFree(p);
    st_.reserved -= size;
  }
  free_.clear();
}

AllocatorStats CachingAllocator::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return st_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  st_.peak_allocated = st_.allocated;
  st_.peak_reserved = st_.reserved;
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  int prev = 0;
  DT_CUDA_CHECK(cudaGetDevice(&prev));
  DT_CUDA_CHECK(cudaSetDevice(device_));
  free_cached_locked();
  cudaSetDevice(prev);
}

CachingAllocator& allocator_for(int index) {
  static std::mutex mu;
  static auto* all = new std::vector<std::unique_ptr<CachingAllocator>>();  // leaked on purpose
  std::lock_guard<std::mutex> lock(mu);
  DT_CHECK(index >= 0 && index < 1024, "bad CUDA device index " << index);
  if (static_cast<size_t>(index) >= all->size()) all->resize(static_cast<size_t>(index) + 1);
  auto& slot = (*all)[static_cast<size_t>(index)];
  if (!slot) slot = std::make_unique<CachingAllocator>(index);
  return *slot;
}

AllocatorStats allocator_stats(int device) { return allocator_for(device).stats(); }
void reset_peak_stats(int device) { allocator_for(device).reset_peak(); }
void empty_cache(int device) { allocator_for(device).empty_cache(); }

Tensor pinned_empty(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  void* p = nullptr;
  DT_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
  auto storage = std::make_shared<Storage>(p, bytes, Device::cpu(), [](void* q) { cudaFreeHost(q); });
  return Tensor::from_storage(std::move(storage), shape, dtype);
}

std::string format_stats(const AllocatorStats& s) {
  auto mib = [](size_t b) { return static_cast<double>(b) / (1 << 20); };
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "allocated %.1f MiB (peak %.1f MiB), reserved %.1f MiB (peak %.1f MiB, cached %.1f MiB), "
                "%lld cudaMalloc calls, %lld cache hits",
                mib(s.allocated), mib(s.peak_allocated), mib(s.reserved), mib(s.peak_reserved),
                mib(s.reserved - s.allocated), static_cast<long long>(s.device_mallocs),
                static_cast<long long>(s.cache_hits));
  return buf;
}

}  // namespace dtrain::cuda

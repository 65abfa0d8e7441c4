#pragma once
// Tensor: shape, dtype, device and a refcounted buffer. Copying a Tensor shares the buffer (a view);
// copying the data is explicit (clone, copy_from). Always contiguous, row-major (NCHW for images).
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/device.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"

namespace dtrain {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
// The number of elements of `s`. Throws InputError naming the shape when a dimension is negative or
// the product of its non-zero dimensions passes int64 (a shape of no rows still has a row's size):
// shapes come from files and attributes, and a product that wraps would size an allocation.
int64_t shape_numel(const Shape& s);
// The same, the message naming what the shape is ("'x.index': attribute sample_shape").
int64_t shape_numel(const Shape& s, const std::string& what);

// Memory from one device's allocator. Not copyable: a buffer is owned by exactly one Storage.
class Storage {
 public:
  using Deleter = std::function<void(void*)>;
  Storage(void* data, size_t bytes, Device device, Deleter deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_;
  size_t bytes_;
  Device device_;
  Deleter deleter_;
};

// Allocates `bytes` on `device`. CPU memory is 64-byte aligned; CUDA memory comes from the CUDA
// engine's caching allocator once it registers itself.
std::shared_ptr<Storage> allocate(size_t bytes, Device device);
using DeviceAllocator = std::function<std::shared_ptr<Storage>(size_t, Device)>;
void register_allocator(DeviceType type, DeviceAllocator alloc);

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, float value);  // f32, CPU
  // A tensor over memory someone else allocated (pinned host buffers, say); `storage` must hold
  // at least the shape's bytes.
  static Tensor from_storage(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype);
  static Tensor from(const Shape& shape, const std::vector<float>& values);  // f32, CPU

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }

  // Host access to the elements. A device's tensor (a GPU's, or the simulated device's) throws an
  // Error naming the caller's file and line (the compilers' __builtin_FILE/LINE as default
  // arguments: clang 14, the sanitizer builds' compiler, has no std::source_location): host code
  // reaches device memory only through the engine (copy_any, to_host), so a CPU test on the
  // simulated device catches what would read a GPU pointer on the host.
  void* raw(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    if (!host_readable()) host_access_error(file, line);
    return device_raw();
  }
  template <typename T>
  T* data(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return static_cast<T*>(raw(file, line));
  }
  float* f32(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const;  // checks dtype F32
  // The address in the tensor's own memory (a device pointer for a GPU's tensor), unchecked: for
  // the engines and communication backends, which know where the memory lives.
  void* device_raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* device_data() const {
    return static_cast<T*>(device_raw());
  }
  float* device_f32() const;  // checks dtype F32
  bool host_readable() const { return !storage_ || storage_->device().is_cpu(); }
  // The storage this tensor views (shared by its views) and its whole size in bytes.
  const void* storage_id() const { return storage_.get(); }
  size_t storage_bytes() const { return storage_ ? storage_->bytes() : 0; }

  // A view with another shape over the same elements (numel must match; one -1 is inferred).
  Tensor reshape(const Shape& shape) const;
  // Rows [begin, end) of the first dimension, as a view.
  Tensor slice0(int64_t begin, int64_t end) const;
  Tensor clone() const;
  void copy_from(const Tensor& src);  // same numel and dtype; host copies only here
  void zero_();
  void fill_(float v);  // f32
  // Element i of a host tensor of any dtype, as a double (half types converted); for tests and
  // benchmarks that fill or check tensors of every dtype, not for hot loops.
  double item(int64_t i) const;
  void set_item(int64_t i, double v);

  std::string str() const;  // "f32[64, 1, 28, 28] on cpu"

 private:
  [[noreturn]] void host_access_error(const char* file, int line) const;
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

}  // namespace dtrain

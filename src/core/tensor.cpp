#include "dtrain/core/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace dtrain {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& s) { return shape_numel(s, ""); }

int64_t shape_numel(const Shape& s, const std::string& what) {
  int64_t nonzero = 1;
  bool empty = false;
  for (int64_t d : s) {
    DT_INPUT_CHECK(d >= 0,
                   what << (what.empty() ? "" : ": ") << "shape " << shape_str(s) << " has a negative dimension");
    DT_INPUT_CHECK(!__builtin_mul_overflow(nonzero, std::max<int64_t>(d, 1), &nonzero),
                   what << (what.empty() ? "" : ": ") << "shape " << shape_str(s) << " has more than 2^63 elements");
    empty = empty || d == 0;
  }
  return empty ? 0 : nonzero;
}

Storage::Storage(void* data, size_t bytes, Device device, Deleter deleter)
    : data_(data), bytes_(bytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (deleter_ && data_) deleter_(data_);
}

namespace {
std::mutex g_alloc_mu;
std::unordered_map<int, DeviceAllocator>& allocators() {
  static std::unordered_map<int, DeviceAllocator> m;
  return m;
}
}  // namespace

void register_allocator(DeviceType type, DeviceAllocator alloc) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  allocators()[static_cast<int>(type)] = std::move(alloc);
}

std::shared_ptr<Storage> allocate(size_t bytes, Device device) {
  if (device.is_cpu() || device.type == DeviceType::SIM) {  // the simulated device's memory is the host's
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
    DT_CHECK(p || !rounded, "out of host memory allocating " << bytes << " bytes");
    return std::make_shared<Storage>(p, bytes, device, [](void* q) { std::free(q); });
  }
  DeviceAllocator alloc;
  {
    std::lock_guard<std::mutex> lock(g_alloc_mu);
    auto it = allocators().find(static_cast<int>(device.type));
    DT_CHECK(it != allocators().end(), "no allocator for device " << device.str() << " (built without CUDA?)");
    alloc = it->second;
  }
  return alloc(bytes, device);
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  DT_CHECK(storage && storage->bytes() >= static_cast<size_t>(t.numel_) * dtype_size(dtype),
           "from_storage: " << (storage ? storage->bytes() : 0) << " bytes for " << shape_str(shape));
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) DT_CHECK(d >= 0, "negative dimension in shape " << shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  DT_CHECK(t.numel_ <= std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dtype_size(dtype)),
           "Tensor::empty: " << shape_str(shape) << " of " << dtype_name(dtype) << " passes 2^63 bytes");
  t.storage_ = allocate(static_cast<size_t>(t.numel_) * dtype_size(dtype), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  DT_CHECK(device.is_cpu(), "Tensor::zeros on " << device.str() << ": use the device engine's fill");
  if (t.nbytes()) std::memset(t.raw(), 0, t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, float value) {
  Tensor t = empty(shape);
  t.fill_(value);
  return t;
}

Tensor Tensor::from(const Shape& shape, const std::vector<float>& values) {
  DT_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()),
           "Tensor::from: shape " << shape_str(shape) << " needs " << shape_numel(shape) << " values, got "
                                  << values.size());
  Tensor t = empty(shape);
  if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * sizeof(float));
  return t;
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  DT_CHECK(d >= 0 && d < dim(), "dimension " << d << " out of range for " << str());
  return shape_[static_cast<size_t>(d)];
}

float* Tensor::f32(const char* file, int line) const {
  DT_CHECK(dtype_ == DType::F32, "expected an f32 tensor, got " << str());
  return data<float>(file, line);
}

float* Tensor::device_f32() const {
  DT_CHECK(dtype_ == DType::F32, "expected an f32 tensor, got " << str());
  return device_data<float>();
}

void Tensor::host_access_error(const char* file_name, int line) const {
  std::string file = file_name;  // the folder and file: "parallel/data_parallel.cpp"
  if (auto last = file.rfind('/'); last != std::string::npos && last > 0)
    if (auto cut = file.rfind('/', last - 1); cut != std::string::npos) file = file.substr(cut + 1);
  throw Error("device",
              "host code read or wrote device memory: " + str() + " at " + file + ":" + std::to_string(line) +
                  "; device tensors go through the engine (copy_any, to_host)",
              __FILE__, __LINE__);
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape s = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      DT_CHECK(infer < 0, "reshape: more than one -1 in " << shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    DT_CHECK(known > 0 && numel_ % known == 0, "reshape " << str() << " to " << shape_str(shape));
    s[static_cast<size_t>(infer)] = numel_ / known;
  }
  DT_CHECK(shape_numel(s) == numel_, "reshape " << str() << " to " << shape_str(shape) << ": element counts differ");
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  DT_CHECK(dim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
           "slice0 [" << begin << ", " << end << ") of " << str());
  Tensor t = *this;
  int64_t row = shape_[0] ? numel_ / shape_[0] : 0;
  t.offset_ = offset_ + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  t.numel_ = (end - begin) * row;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  DT_CHECK(src.numel_ == numel_ && src.dtype_ == dtype_, "copy_from " << src.str() << " into " << str());
  DT_CHECK(device().is_cpu() && src.device().is_cpu(), "Tensor::copy_from is host-only; use the engine's copy");
  if (nbytes()) std::memmove(raw(), src.raw(), nbytes());
}

void Tensor::zero_() {
  DT_CHECK(device().is_cpu(), "Tensor::zero_ is host-only; use the engine's fill");
  if (nbytes()) std::memset(raw(), 0, nbytes());
}

void Tensor::fill_(float v) {
  float* p = f32();
  for (int64_t i = 0; i < numel_; ++i) p[i] = v;
}

double Tensor::item(int64_t i) const {
  DT_CHECK(device().is_cpu() && i >= 0 && i < numel_, "item(" << i << ") of " << str());
  switch (dtype_) {
    case DType::F32:
      return data<float>()[i];
    case DType::BF16:
      return bf16_to_float(data<uint16_t>()[i]);
    case DType::F16:
      return f16_to_float(data<uint16_t>()[i]);
    case DType::I32:
      return data<int32_t>()[i];
    case DType::I64:
      return static_cast<double>(data<int64_t>()[i]);
    case DType::U8:
      return data<uint8_t>()[i];
  }
  return 0;
}

void Tensor::set_item(int64_t i, double v) {
  DT_CHECK(device().is_cpu() && i >= 0 && i < numel_, "set_item(" << i << ") of " << str());
  switch (dtype_) {
    case DType::F32:
      data<float>()[i] = static_cast<float>(v);
      break;
    case DType::BF16:
      data<uint16_t>()[i] = float_to_bf16(static_cast<float>(v));
      break;
    case DType::F16:
      data<uint16_t>()[i] = float_to_f16(static_cast<float>(v));
      break;
    case DType::I32:
      data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::I64:
      data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
    case DType::U8:
      data<uint8_t>()[i] = static_cast<uint8_t>(v);
      break;
  }
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device().str();
}

}  // namespace dtrain

#pragma once
#include <string>

namespace dtrain {

// CPU: host memory, readable by any code. CUDA: a GPU's memory. SIM: a simulated accelerator for
// checking device code on CPU ranks: its memory lies in host RAM and the CPU engine computes on
// it, but it is marked as a device's, so host code that touches it directly (Tensor::data, f32,
// raw, item, copy_from, ...) throws, as reading a GPU pointer from the host would fault, and the
// MPI backend moves it through host staging, as it moves a GPU's buffers. `--device sim`.
enum class DeviceType { CPU, CUDA, SIM };
inline constexpr int kDeviceTypes = 3;

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i) { return {DeviceType::CUDA, i}; }
  static Device sim(int i = 0) { return {DeviceType::SIM, i}; }
  // Whether host code may read and write this device's memory directly.
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool operator==(const Device&) const = default;
  std::string str() const {
    switch (type) {
      case DeviceType::CPU:
        return "cpu";
      case DeviceType::CUDA:
        return "cuda:" + std::to_string(index);
      case DeviceType::SIM:
        return "sim:" + std::to_string(index);
    }
    return "?";
  }
};

}  // namespace dtrain

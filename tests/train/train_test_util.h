#pragma once
// A small learnable image set written as HDF5 shards: class c has a bright c-th row band, plus noise.
#include <hdf5.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "dtrain/core/rng.h"
#include "dtrain/data/convert.h"
#include "dtrain/data/hdf5_util.h"

namespace dtrain::test {

inline std::string make_band_dataset(const std::string& dir, int64_t n, int64_t hw = 8, int classes = 4,
                                     int64_t shard_size = 100, uint64_t seed = 3) {
  data::ImageSet set;
  set.sample_shape = {1, hw, hw};
  set.num_classes = classes;
  set.source = "band test set";
  Rng rng(seed);
  for (int64_t i = 0; i < n; ++i) {
    int c = static_cast<int>(rng.below(static_cast<uint64_t>(classes)));
    set.labels.push_back(c);
    for (int64_t y = 0; y < hw; ++y)
      for (int64_t x = 0; x < hw; ++x) {
        int v = static_cast<int>(rng.below(80)) + ((y * classes / hw) == c ? 150 : 0);
        set.inputs.push_back(static_cast<uint8_t>(std::min(v, 255)));
      }
  }
  std::filesystem::remove_all(dir);
  data::ShardWriterOptions o;
  o.shard_size = shard_size;
  data::write_shards(set, dir, o);
  return dir;
}

// Flips the bits `mask` of byte `offset` of dataset `name`'s data where HDF5 stored it in `path`: a
// change only the file's checksum can see. False when the dataset has no data in the file.
inline bool flip_dataset_byte(const std::string& path, const std::string& name, int64_t offset, unsigned char mask) {
  haddr_t data = HADDR_UNDEF;
  {
    auto lock = data::h5::lock();
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
    data = H5Dget_offset(ds);
    H5Dclose(ds);
    H5Fclose(file);
  }
  if (data == HADDR_UNDEF) return false;
  const auto at = static_cast<std::streamoff>(data + static_cast<haddr_t>(offset));
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char c;
  f.seekg(at);
  f.get(c);
  f.seekp(at);
  f.put(static_cast<char>(c ^ static_cast<char>(mask)));
  return static_cast<bool>(f);
}

inline std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("dtrain-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace dtrain::test

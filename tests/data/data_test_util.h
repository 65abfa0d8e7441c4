#pragma once
// Helpers shared by the data tests: temporary directories and small synthetic idx / image sets.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dtrain/data/convert.h"

namespace dtrain::data {
namespace fs = std::filesystem;
}

namespace dtrain::data::testing {

// A file of exactly `bytes`, its folders made.
inline void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A fresh directory under the build tree, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    fs::path base = fs::path(DTRAIN_BINARY_DIR) / "test-tmp";
    fs::create_directories(base);
    std::string templ = (base / "data-XXXXXX").string();
    char* made = ::mkdtemp(templ.data());
    EXPECT_NE(made, nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

inline void put_be32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
}

// An idx file: magic 0x0000 08 rank, big-endian dims, then `payload`; gzip-compressed when `gz`.
inline void write_idx(const std::string& path, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& payload,
                      bool gz, uint32_t magic = 0) {
  std::vector<uint8_t> bytes;
  put_be32(bytes, magic ? magic : 0x0800u | static_cast<uint32_t>(dims.size()));
  for (uint32_t d : dims) put_be32(bytes, d);
  bytes.insert(bytes.end(), payload.begin(), payload.end());
  if (gz) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
}

// A synthetic one-channel set: pixel (i, k) = (i * 31 + k * 7) % 256, label i % classes.
inline ImageSet synthetic_set(int64_t n, int64_t c, int64_t h, int64_t w, int classes) {
  ImageSet s;
  s.sample_shape = {c, h, w};
  s.num_classes = classes;
  s.source = "synthetic";
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < c * h * w; ++k)
      s.inputs.push_back(static_cast<uint8_t>((i * 31 + k * 7 + (i * k) % 13) % 256));
    s.labels.push_back(static_cast<int32_t>(i % classes));
  }
  return s;
}

inline bool have_h5py() {
  return fs::exists("/usr/bin/python3") && std::system("/usr/bin/python3 -c 'import h5py, numpy' >/dev/null 2>&1") == 0;
}

// Runs `fn`, expecting an InputError whose message contains every string in `needles`.
template <typename Fn>
void expect_input_error(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an InputError";
  } catch (const InputError& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' does not contain '" << n << "'";
  }
}

}  // namespace dtrain::data::testing

#include "fuzz_util.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "dtrain/data/convert.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/hdf5_util.h"

namespace dtrain::fuzz {

std::vector<Part> split_parts(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<Part> parts;
  std::string tag;
  size_t at = 0;
  for (;;) {
    const size_t sep = in.find(kPartSeparator, at);
    const size_t end = sep == std::string_view::npos ? in.size() : sep;
    parts.push_back({tag, std::span<const uint8_t>(data + at, end - at)});
    if (sep == std::string_view::npos) break;
    const size_t tag_begin = sep + kPartSeparator.size();
    size_t tag_end = in.find('\n', tag_begin);
    if (tag_end == std::string_view::npos) tag_end = in.size();
    tag = std::string(in.substr(tag_begin, tag_end - tag_begin));
    at = std::min(in.size(), tag_end + 1);
  }
  return parts;
}

std::string join_parts(const std::vector<std::pair<std::string, std::string>>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += std::string(kPartSeparator) + parts[i].first + "\n";
    out += parts[i].second;
  }
  return out;
}

namespace {

struct Scratch {
  fs::path path;
  Scratch() {
    fs::path base = "/tmp";
    if (const char* t = std::getenv("TMPDIR"); t && *t)
      base = t;
    else if (::access("/dev/shm", W_OK) == 0)
      base = "/dev/shm";  // memory: the targets write a file or more per input
    std::string templ = (base / "dtrain-fuzz-XXXXXX").string();
    if (!::mkdtemp(templ.data())) fail("cannot create a scratch directory under " + base.string());
    path = templ;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

Scratch& the_scratch() {
  static Scratch s;
  return s;
}

}  // namespace

const fs::path& scratch() { return the_scratch().path; }

fs::path fresh_scratch() {
  const fs::path& dir = scratch();
  for (const auto& e : fs::directory_iterator(dir)) fs::remove_all(e.path());
  return dir;
}

void write_file(const fs::path& path, std::span<const uint8_t> bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) fail("cannot write " + path.string());
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void expect_no_open_hdf5_objects(const char* after) {
  auto lock = data::h5::lock();
  const ssize_t open = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
  if (open != 0)
    fail(std::to_string(open) + " HDF5 object(s) still open after " + after +
         " (files: " + std::to_string(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_FILE)) + ")");
}

void read_checking_labels(data::ShardedHdf5Dataset& ds, const std::vector<int64_t>& rows) {
  Tensor inputs, labels;
  ds.read(rows, inputs, labels);
  for (int64_t i = 0; i < labels.numel(); ++i) {
    const int32_t l = labels.data<int32_t>()[i];
    if (l < 0 || l >= ds.info().num_classes)
      fail("label " + std::to_string(l) + " outside [0, " + std::to_string(ds.info().num_classes) + ")");
  }
}

void expect_shards_round_trip(const data::ImageSet& set, const fs::path& dir, size_t variant) {
  data::ShardWriterOptions opt;
  opt.shard_size = 1 + static_cast<int64_t>(variant % 3);
  opt.chunk_rows = 1 + static_cast<int64_t>(variant / 3 % 2);
  opt.compress_level = variant % 5 == 0 ? 1 : 0;
  const data::ConvertSummary sum = data::write_shards(set, dir.string(), opt);
  {
    data::ShardedHdf5Dataset ds(dir.string());
    if (ds.size() != set.size() || ds.info().sample_shape != set.sample_shape || sum.num_samples != set.size())
      fail("the shards hold " + std::to_string(ds.size()) + " samples " + shape_str(ds.info().sample_shape) +
           ", the converter read " + std::to_string(set.size()) + " " + shape_str(set.sample_shape));
    std::vector<int64_t> all(static_cast<size_t>(set.size()));
    for (int64_t i = 0; i < set.size(); ++i) all[static_cast<size_t>(i)] = i;
    Tensor inputs, labels;
    ds.read(all, inputs, labels);
    if (std::memcmp(inputs.raw(), set.inputs.data(), set.inputs.size()) != 0 ||
        std::memcmp(labels.raw(), set.labels.data(), set.labels.size() * sizeof(int32_t)) != 0)
      fail("the shards read back other samples or labels than the converter read");
  }
  expect_no_open_hdf5_objects("reading the converted shards");
}

void rejected(const std::exception& e) {
  static const bool verbose = std::getenv("DTRAIN_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "dtrain fuzz: rejected: %s\n", e.what());
}

void fail(const std::string& what) {
  std::fprintf(stderr, "dtrain fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace dtrain::fuzz

#include "dtrain/data/shard_index.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/hdf5_util.h"

namespace fs = std::filesystem;

namespace dtrain::data {

namespace {

constexpr const char* kFormat = "dtrain shard index 1";

std::string base_name(const std::string& path) { return fs::path(path).filename().string(); }

// The file names, each followed by a NUL, as one u8 dataset: HDF5's string datasets are awkward
// from C, and one byte array reads back in one call.
std::vector<uint8_t> pack_names(const std::vector<std::string>& names) {
  std::vector<uint8_t> packed;
  for (const std::string& n : names) {
    packed.insert(packed.end(), n.begin(), n.end());
    packed.push_back(0);
  }
  return packed;
}

std::vector<std::string> unpack_names(const std::vector<uint8_t>& packed, const std::string& path) {
  DT_INPUT_CHECK(packed.empty() || packed.back() == 0, "'" << path << "': dataset 'names' does not end in a NUL");
  std::vector<std::string> names;
  for (auto at = packed.begin(); at != packed.end();) {
    auto end = std::find(at, packed.end(), uint8_t{0});
    names.emplace_back(at, end);
    at = end + 1;
  }
  return names;
}

// Each shard's rows of samples, as the index states them, fit in the bytes it records for the
// shard (at most h5::kMaxInflation times them: deflate's limit): the sizes a run derives from the
// index (a row's bytes, a shard's, the cache's) are bounded by the shards' files, which the index is
// compared with before it is used.
void check_rows_fit_shards(const ShardIndex& ix, const std::string& path) {
  const int64_t row_bytes = shape_numel(ix.sample_shape, "'" + path + "': attribute sample_shape");
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  for (size_t s = 0; s < ix.rows.size(); ++s) {
    const uint64_t stored = static_cast<uint64_t>(std::max<int64_t>(ix.stamps[s].bytes, 0));
    const uint64_t limit = stored > kMax / h5::kMaxInflation ? kMax : stored * h5::kMaxInflation;
    uint64_t bytes = 0;
    DT_INPUT_CHECK(
        !__builtin_mul_overflow(static_cast<uint64_t>(ix.rows[s]), static_cast<uint64_t>(row_bytes), &bytes) &&
            bytes <= limit,
        "'" << path << "' gives shard '" << ix.names[s] << "' " << ix.rows[s] << " rows of "
            << shape_str(ix.sample_shape) << " bytes, more than its " << ix.stamps[s].bytes << " bytes can hold");
  }
}

// The index file at `path`, checked for consistency with itself (not yet with the folder).
ShardIndex read_index_file(const std::string& path) {
  h5::Handle file = h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  DT_INPUT_CHECK(file.valid(), "cannot open '" << path << "' as HDF5 (" << h5::last_error() << ")");
  const hid_t f = file.get();
  std::string format;
  DT_INPUT_CHECK(h5::read_attr_string(f, "format", format) && format == kFormat,
                 "'" << path << "' is not a dtrain shard index (attribute format is not '" << kFormat << "')");
  ShardIndex ix;
  ix.names = unpack_names(h5::read_1d<uint8_t>(f, "names", H5T_NATIVE_UINT8, path), path);
  const auto bytes = h5::read_1d<int64_t>(f, "bytes", H5T_NATIVE_INT64, path);
  const auto mtimes = h5::read_1d<int64_t>(f, "mtime_ns", H5T_NATIVE_INT64, path);
  ix.rows = h5::read_1d<int64_t>(f, "rows", H5T_NATIVE_INT64, path);
  ix.labels = h5::read_1d<int32_t>(f, "labels", H5T_NATIVE_INT32, path);
  const size_t n = ix.names.size();
  DT_INPUT_CHECK(n > 0 && bytes.size() == n && mtimes.size() == n && ix.rows.size() == n,
                 "'" << path << "' lists " << n << " names, " << bytes.size() << " sizes, " << mtimes.size()
                     << " times and " << ix.rows.size() << " row counts");
  // Every row is a label of this file, so the sum of the row counts is bounded by its size.
  int64_t samples = 0;
  for (size_t s = 0; s < n; ++s) {
    DT_INPUT_CHECK(ix.rows[s] >= 0 && ix.rows[s] <= static_cast<int64_t>(ix.labels.size()) - samples,
                   "'" << path << "' gives shard '" << ix.names[s] << "' " << ix.rows[s] << " rows, but holds "
                       << ix.labels.size() << " labels in all");
    samples += ix.rows[s];
    ix.stamps.push_back({bytes[s], mtimes[s]});
  }
  DT_INPUT_CHECK(samples == static_cast<int64_t>(ix.labels.size()),
                 "'" << path << "' counts " << samples << " rows but holds " << ix.labels.size() << " labels");
  std::vector<int64_t> shape, classes;
  DT_INPUT_CHECK(h5::read_attr_i64(f, "sample_shape", shape) && !shape.empty() &&
                     std::all_of(shape.begin(), shape.end(), [](int64_t d) { return d > 0; }) &&
                     h5::read_attr_i64(f, "num_classes", classes) && classes.size() == 1 && classes[0] > 0 &&
                     classes[0] <= std::numeric_limits<int32_t>::max(),
                 "'" << path << "' has no valid sample_shape and num_classes attributes");
  ix.sample_shape = Shape(shape);
  check_rows_fit_shards(ix, path);
  ix.num_classes = static_cast<int>(classes[0]);
  h5::read_attr_strings(f, "class_names", ix.class_names);
  const bool mean = h5::read_attr_f64(f, "mean", ix.mean), stdev = h5::read_attr_f64(f, "std", ix.std);
  DT_INPUT_CHECK(mean == stdev, "'" << path << "' holds only one of the attributes mean and std");
  if (mean) check_normalization(path, ix.sample_shape, ix.mean, ix.std);
  return ix;
}

// Why `ix` does not describe `shard_paths` as they are now, or "" when it does.
std::string stale_shard(const ShardIndex& ix, const std::vector<std::string>& shard_paths) {
  if (ix.names.size() != shard_paths.size())
    return "it lists " + std::to_string(ix.names.size()) + " shard(s), the folder holds " +
           std::to_string(shard_paths.size());
  for (size_t s = 0; s < shard_paths.size(); ++s) {
    if (base_name(shard_paths[s]) != ix.names[s]) return "shard '" + shard_paths[s] + "' is not in it";
    if (file_stamp(shard_paths[s]) != ix.stamps[s])
      return "shard '" + shard_paths[s] + "' changed (size or modification time) since it was written";
  }
  return "";
}

// Waits until the clock that stamps files, as it stamps `probe`, has passed `newest_ns`. That clock
// ticks every few milliseconds, so a shard changed in the tick it was indexed in would keep the
// size and time the index recorded; once the index is in place after this, any change to a shard
// gives it a later time.
void wait_for_the_clock_to_pass(const std::string& probe, int64_t newest_ns) {
  for (int tries = 0; tries < 1000 && file_stamp(probe).mtime_ns <= newest_ns; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ::utimensat(AT_FDCWD, probe.c_str(), nullptr, 0);  // both times to now
  }
}

}  // namespace

FileStamp file_stamp(const std::string& path) {
  struct stat st {};
  DT_INPUT_CHECK(::stat(path.c_str(), &st) == 0, "cannot read '" << path << "': " << std::strerror(errno));
  return {static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + static_cast<int64_t>(st.st_mtim.tv_nsec)};
}

int64_t write_shard_index(const std::string& dir) {
  DT_INPUT_CHECK(fs::is_directory(dir), "'" << dir << "' is not a folder of shards");
  const std::string path = (fs::path(dir) / kShardIndexName).string();
  std::error_code ec;
  fs::remove(path, ec);  // so the dataset below opens and checks every shard
  // Every shard stamped before it is read and again after: the index pairs a shard's rows and
  // labels with the size and time of the file they came from, or refuses.
  std::map<std::string, FileStamp> before;
  for (const std::string& shard : list_shards(dir)) before[shard] = file_stamp(shard);
  ShardedHdf5Dataset ds(dir);
  const DatasetInfo& info = ds.info();
  std::vector<std::string> names;
  std::vector<int64_t> bytes, mtimes;
  for (const std::string& shard : info.shards) {
    names.push_back(base_name(shard));
    const FileStamp st = file_stamp(shard);
    const auto was = before.find(shard);
    DT_INPUT_CHECK(was != before.end() && was->second == st,
                   "shard '" << shard << "' changed while it was indexed; run `dtrain convert index " << dir
                             << "` again once the folder is complete");
    bytes.push_back(st.bytes);
    mtimes.push_back(st.mtime_ns);
  }
  const std::vector<uint8_t> packed = pack_names(names);
  const std::span<const int32_t> labels = ds.labels();
  const std::string tmp = (fs::path(dir) / (".shards.index.tmp-" + std::to_string(::getpid()))).string();
  {
    auto lock = h5::lock();
    h5::Handle file = h5::file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    DT_INPUT_CHECK(file.valid(), "cannot create '" << tmp << "' (" << h5::last_error() << ")");
    const hid_t f = file.get();
    const std::vector<double> mean(info.mean.begin(), info.mean.end()), stdev(info.std.begin(), info.std.end());
    const bool ok =
        h5::write_attr_string(f, "format", kFormat) &&
        h5::write_1d(f, "names", H5T_STD_U8LE, H5T_NATIVE_UINT8, packed.size(), packed.data()) &&
        h5::write_1d(f, "bytes", H5T_STD_I64LE, H5T_NATIVE_INT64, bytes.size(), bytes.data()) &&
        h5::write_1d(f, "mtime_ns", H5T_STD_I64LE, H5T_NATIVE_INT64, mtimes.size(), mtimes.data()) &&
        h5::write_1d(f, "rows", H5T_STD_I64LE, H5T_NATIVE_INT64, info.shard_rows.size(), info.shard_rows.data()) &&
        h5::write_1d(f, "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, labels.size(), labels.data()) &&
        h5::write_attr_i64(f, "sample_shape", std::vector<int64_t>(info.sample_shape.begin(), info.sample_shape.end())) &&
        h5::write_attr_i64(f, "num_classes", {info.num_classes}) &&
        (info.class_names.empty() || h5::write_attr_strings(f, "class_names", info.class_names)) &&
        (!info.has_normalization || (h5::write_attr_f64(f, "mean", mean) && h5::write_attr_f64(f, "std", stdev)));
    if (!ok) {
      const std::string why = h5::last_error();
      file.reset();
      fs::remove(tmp, ec);
      throw InputError(DT_STR("cannot write '" << tmp << "' (" << why << ")"));
    }
  }
  wait_for_the_clock_to_pass(tmp, *std::max_element(mtimes.begin(), mtimes.end()));
  fs::rename(tmp, path, ec);
  DT_INPUT_CHECK(!ec, "cannot rename '" << tmp << "' to '" << path << "': " << ec.message());
  return static_cast<int64_t>(names.size());
}

std::optional<ShardIndex> read_shard_index(const std::string& dir, const std::vector<std::string>& shard_paths,
                                           std::string& why_not) {
  const std::string path = (fs::path(dir) / kShardIndexName).string();
  if (!fs::exists(path)) {
    why_not = std::string("no ") + kShardIndexName;
    return std::nullopt;
  }
  const std::string rewrite = "; `dtrain convert index " + dir + "` rewrites it";
  try {
    ShardIndex ix = read_index_file(path);
    why_not = stale_shard(ix, shard_paths);
    if (why_not.empty()) return ix;
    why_not = "'" + path + "' is out of date: " + why_not + rewrite;
  } catch (const InputError& e) {
    why_not = e.what() + rewrite;
  }
  return std::nullopt;
}

}  // namespace dtrain::data

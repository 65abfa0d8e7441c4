#include "dtrain/data/convert.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <regex>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/data/shard_index.h"

namespace fs = std::filesystem;

namespace dtrain::data {

namespace {

// The whole file, decompressed when it is gzip (zlib reads a plain file through the same calls).
std::vector<uint8_t> read_maybe_gz(const std::string& path) {
  DT_INPUT_CHECK(fs::is_regular_file(path), "cannot read '" << path << "': no such file");
  gzFile f = gzopen(path.c_str(), "rb");
  DT_INPUT_CHECK(f != nullptr, "cannot open '" << path << "'");
  std::vector<uint8_t> out;
  std::vector<uint8_t> buf(1 << 20);
  for (;;) {
    int n = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
    if (n < 0) {
      int errnum = 0;
      std::string msg = gzerror(f, &errnum);
      gzclose(f);
      DT_INPUT_CHECK(false, "cannot read '" << path << "': " << msg << " (corrupt gzip?)");
    }
    if (n == 0) break;
    out.insert(out.end(), buf.begin(), buf.begin() + n);
  }
  gzclose(f);
  return out;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

// Parses an idx header: 0x00 0x00, element type (0x08 = u8), rank; then `rank` big-endian u32 dims.
// Returns the dims and checks the payload size exactly.
std::vector<int64_t> parse_idx(const std::vector<uint8_t>& bytes, const std::string& path, int expect_rank,
                               const char* what) {
  DT_INPUT_CHECK(bytes.size() >= 4, "'" << path << "' is not an idx file: only " << bytes.size() << " bytes");
  uint32_t magic = be32(bytes.data());
  uint32_t expect_magic = 0x0800u | static_cast<uint32_t>(expect_rank);
  DT_INPUT_CHECK(magic == expect_magic, "'" << path << "' is not an idx " << what << " file: magic number 0x"
                                            << std::hex << std::setw(8) << std::setfill('0') << magic << ", expected 0x"
                                            << std::setw(8) << expect_magic);
  size_t header = 4 + 4 * static_cast<size_t>(expect_rank);
  DT_INPUT_CHECK(bytes.size() >= header, "'" << path << "' is truncated inside its idx header");
  const size_t have = bytes.size() - header;
  std::vector<int64_t> dims;
  size_t payload = 1;  // stays <= have: each dimension is checked against it first, so it cannot overflow
  for (int i = 0; i < expect_rank; ++i) {
    const uint32_t d = be32(bytes.data() + 4 + 4 * i);
    DT_INPUT_CHECK(d > 0, "'" << path << "' has an empty dimension in its idx header");
    DT_INPUT_CHECK(d <= have / payload, "'" << path << "' holds " << have << " data bytes but its idx header declares "
                                            << "more (dimension " << i << " is " << d << "; truncated or wrong file?)");
    payload *= d;
    dims.push_back(d);
  }
  DT_INPUT_CHECK(have == payload, "'" << path << "' holds " << have << " data bytes but its idx header declares "
                                      << payload << " (truncated or wrong file?)");
  return dims;
}

std::string shard_name(int64_t i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "shard-%05lld.h5", static_cast<long long>(i));
  return buf;
}

// Writes `rows` samples, the split's `first_sample`.. onwards, to `path` with the attributes of this
// shard alone (those of the whole split come at ShardWriter::finish). Caller holds the HDF5 lock.
void write_one_shard(const ImageSet& split, const uint8_t* inputs, const int32_t* labels, int64_t rows,
                     int64_t first_sample, int64_t shard_index, const std::string& path,
                     const ShardWriterOptions& opt) {
  h5::Handle file = h5::file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  DT_INPUT_CHECK(file.valid(), "cannot create '" << path << "': " << h5::last_error());
  auto fail = [&](const char* what) {
    DT_INPUT_CHECK(false, "writing " << what << " to '" << path << "' failed: " << h5::last_error());
  };

  const hsize_t chunk_rows = static_cast<hsize_t>(std::clamp<int64_t>(opt.chunk_rows, 1, rows));
  std::vector<hsize_t> dims = {static_cast<hsize_t>(rows)};
  std::vector<hsize_t> chunk = {chunk_rows};
  for (int64_t d : split.sample_shape) {
    dims.push_back(static_cast<hsize_t>(d));
    chunk.push_back(static_cast<hsize_t>(d));
  }

  {  // inputs: u8 [N, C, H, W], chunked by rows
    h5::Handle dcpl = h5::plist(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data());
    if (opt.compress_level > 0) {
      H5Pset_shuffle(dcpl.get());
      H5Pset_deflate(dcpl.get(), static_cast<unsigned>(opt.compress_level));
    }
    h5::Handle sp = h5::space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
    h5::Handle ds =
        h5::dataset(H5Dcreate2(file.get(), "inputs", H5T_STD_U8LE, sp.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
    if (!ds.valid()) fail("dataset 'inputs'");
    if (H5Dwrite(ds.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, inputs) < 0) fail("dataset 'inputs'");
  }
  {  // labels: i32 [N]
    h5::Handle dcpl = h5::plist(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(dcpl.get(), 1, &chunk_rows);
    if (opt.compress_level > 0) H5Pset_deflate(dcpl.get(), static_cast<unsigned>(opt.compress_level));
    hsize_t n = static_cast<hsize_t>(rows);
    h5::Handle sp = h5::space(H5Screate_simple(1, &n, nullptr));
    h5::Handle ds =
        h5::dataset(H5Dcreate2(file.get(), "labels", H5T_STD_I32LE, sp.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
    if (!ds.valid()) fail("dataset 'labels'");
    if (H5Dwrite(ds.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels) < 0) fail("dataset 'labels'");
  }

  hid_t root = file.get();  // attributes on the file id land on the root group "/"
  bool ok = h5::write_attr_string(root, "format", "dtrain-shards-1") &&
            h5::write_attr_i64(root, "sample_shape", split.sample_shape) &&
            h5::write_attr_string(root, "dtype", "u8") && h5::write_attr_string(root, "label_dtype", "i32") &&
            h5::write_attr_scalar_i64(root, "num_samples", rows) &&
            h5::write_attr_scalar_i64(root, "first_sample", first_sample) &&
            h5::write_attr_scalar_i64(root, "shard_index", shard_index) &&
            h5::write_attr_string(root, "source", split.source);
  if (!ok) fail("attributes");
  hid_t id = file.release();  // closed here, where a failure (e.g. a full disk while flushing) is reported
  DT_INPUT_CHECK(H5Fclose(id) >= 0, "closing '" << path << "' failed: " << h5::last_error());
}

// Adds the attributes that describe the whole split to the complete shard at `path`. Caller holds
// the HDF5 lock.
void write_split_attributes(const std::string& path, const ImageSet& split, int num_classes, int64_t num_shards,
                            int64_t total_samples, const std::vector<double>& mean, const std::vector<double>& stdev) {
  h5::Handle file = h5::file(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  DT_INPUT_CHECK(file.valid(), "cannot reopen '" << path << "': " << h5::last_error());
  hid_t root = file.get();
  bool ok = h5::write_attr_scalar_i64(root, "num_classes", num_classes) && h5::write_attr_f64(root, "mean", mean) &&
            h5::write_attr_f64(root, "std", stdev) && h5::write_attr_scalar_i64(root, "num_shards", num_shards) &&
            h5::write_attr_scalar_i64(root, "total_samples", total_samples) &&
            (split.class_names.empty() || h5::write_attr_strings(root, "class_names", split.class_names));
  DT_INPUT_CHECK(ok, "writing attributes to '" << path << "' failed: " << h5::last_error());
  hid_t id = file.release();
  DT_INPUT_CHECK(H5Fclose(id) >= 0, "closing '" << path << "' failed: " << h5::last_error());
}

}  // namespace

ImageSet read_idx(const std::string& images_path, const std::string& labels_path) {
  std::vector<uint8_t> img = read_maybe_gz(images_path);
  std::vector<int64_t> idims = parse_idx(img, images_path, 3, "image");
  std::vector<uint8_t> lab = read_maybe_gz(labels_path);
  std::vector<int64_t> ldims = parse_idx(lab, labels_path, 1, "label");
  DT_INPUT_CHECK(idims[0] == ldims[0], "image/label count mismatch: '" << images_path << "' holds " << idims[0]
                                                                       << " images but '" << labels_path << "' holds "
                                                                       << ldims[0] << " labels");
  ImageSet set;
  set.sample_shape = {1, idims[1], idims[2]};
  set.inputs.assign(img.begin() + 16, img.end());
  set.labels.assign(lab.begin() + 8, lab.end());
  set.source = "idx:" + fs::path(images_path).filename().string() + "," + fs::path(labels_path).filename().string();
  return set;
}

ImageSet read_cifar10(const std::vector<std::string>& files) {
  DT_INPUT_CHECK(!files.empty(), "cifar10: no input files given");
  constexpr int64_t kImage = 3 * 32 * 32;
  constexpr int64_t kRecord = 1 + kImage;
  ImageSet set;
  set.sample_shape = {3, 32, 32};
  set.num_classes = 10;
  set.source = "cifar10:";
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string& path = files[f];
    std::vector<uint8_t> bytes = read_maybe_gz(path);
    DT_INPUT_CHECK(!bytes.empty() && bytes.size() % kRecord == 0,
                   "'" << path << "' is not a CIFAR-10 binary batch: " << bytes.size()
                       << " bytes is not a positive multiple of the 3073-byte record");
    int64_t n = static_cast<int64_t>(bytes.size()) / kRecord;
    set.inputs.reserve(set.inputs.size() + n * kImage);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* rec = bytes.data() + i * kRecord;
      DT_INPUT_CHECK(rec[0] < 10, "'" << path << "' record " << i << " has label " << int(rec[0])
                                      << ", outside CIFAR-10's 0..9 (not a CIFAR-10 batch?)");
      set.labels.push_back(rec[0]);
      set.inputs.insert(set.inputs.end(), rec + 1, rec + kRecord);
    }
    set.source += (f ? "," : "") + fs::path(path).filename().string();
  }
  return set;
}

std::string ConvertSummary::str() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(4) << "converted " << num_samples << " samples " << shape_str(sample_shape)
     << ", " << num_classes << " classes, into " << num_shards << " shard(s) in " << out_dir << "; mean [";
  for (size_t c = 0; c < mean.size(); ++c) os << (c ? ", " : "") << mean[c];
  os << "] std [";
  for (size_t c = 0; c < std.size(); ++c) os << (c ? ", " : "") << std[c];
  os << "]; " << std::setprecision(2) << seconds << " s";
  return os.str();
}

ShardWriter::ShardWriter(const std::string& out_dir, const ImageSet& split, const ShardWriterOptions& opt)
    : out_dir_(out_dir), opt_(opt), start_s_(now_s()) {
  DT_INPUT_CHECK(split.sample_shape.size() == 3 && shape_numel(split.sample_shape) > 0,
                 "sample shape " << shape_str(split.sample_shape) << " is not [C, H, W]");
  DT_INPUT_CHECK(opt.shard_size > 0, "--shard-size must be positive, got " << opt.shard_size);
  DT_INPUT_CHECK(opt.chunk_rows > 0, "--chunk must be positive, got " << opt.chunk_rows);
  DT_INPUT_CHECK(opt.compress_level >= 0 && opt.compress_level <= 9,
                 "--compress must be a deflate level 0..9, got " << opt.compress_level);
  DT_CHECK(split.class_names.empty() || static_cast<int>(split.class_names.size()) == split.num_classes,
           split.class_names.size() << " class names for " << split.num_classes << " classes");
  split_.sample_shape = split.sample_shape;
  split_.num_classes = split.num_classes;
  split_.class_names = split.class_names;
  split_.source = split.source;
  channel_sum_.assign(split.sample_shape[0], 0);
  channel_sum_sq_.assign(split.sample_shape[0], 0);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  DT_INPUT_CHECK(!ec && fs::is_directory(out_dir),
                 "cannot create output directory '" << out_dir << "': " << ec.message());
}

ShardWriter::~ShardWriter() {
  if (finished_) return;
  std::error_code ec;
  for (const std::string& p : tmp_paths_) fs::remove(p, ec);
}

void ShardWriter::add(const uint8_t* inputs, const int32_t* labels, int64_t n) {
  const int64_t sample_bytes = split_.sample_bytes();
  const int64_t plane = sample_bytes / split_.sample_shape[0];
  for (int64_t i = 0; i < n; ++i) {
    DT_INPUT_CHECK(labels[i] >= 0, "input from " << split_.source << " has a negative label " << labels[i]);
    DT_INPUT_CHECK(split_.num_classes == 0 || labels[i] < split_.num_classes,
                   "input from " << split_.source << " has label " << labels[i] << " but " << split_.num_classes
                                 << " classes");
    max_label_ = std::max(max_label_, labels[i]);
    const uint8_t* sample = inputs + i * sample_bytes;
    for (size_t c = 0; c < channel_sum_.size(); ++c) {
      uint64_t sum = 0, sum_sq = 0;
      for (const uint8_t* p = sample + c * plane; p != sample + (c + 1) * plane; ++p) {
        sum += *p;
        sum_sq += uint32_t(*p) * *p;
      }
      channel_sum_[c] += sum;
      channel_sum_sq_[c] += sum_sq;
    }
  }
  // Whole shards straight from the caller's memory when nothing is pending, else through the buffer.
  int64_t at = 0;
  while (at < n) {
    const int64_t take = std::min(n - at, opt_.shard_size - pending_rows());
    if (pending_rows() == 0 && take == opt_.shard_size) {
      write_shard(inputs + at * sample_bytes, labels + at, take);
    } else {
      pending_inputs_.insert(pending_inputs_.end(), inputs + at * sample_bytes, inputs + (at + take) * sample_bytes);
      pending_labels_.insert(pending_labels_.end(), labels + at, labels + at + take);
      if (pending_rows() == opt_.shard_size) {
        write_shard(pending_inputs_.data(), pending_labels_.data(), pending_rows());
        pending_inputs_.clear();
        pending_labels_.clear();
      }
    }
    at += take;
  }
}

void ShardWriter::write_shard(const uint8_t* inputs, const int32_t* labels, int64_t rows) {
  const int64_t index = static_cast<int64_t>(tmp_paths_.size());
  tmp_paths_.push_back((fs::path(out_dir_) / ("." + shard_name(index) + ".tmp-" + std::to_string(::getpid()))).string());
  auto lock = h5::lock();
  write_one_shard(split_, inputs, labels, rows, written_, index, tmp_paths_.back(), opt_);
  written_ += rows;
}

ConvertSummary ShardWriter::finish() {
  DT_CHECK(!finished_, "ShardWriter::finish called twice");
  if (pending_rows() > 0) write_shard(pending_inputs_.data(), pending_labels_.data(), pending_rows());
  pending_inputs_ = {};
  pending_labels_ = {};
  DT_INPUT_CHECK(written_ > 0, "nothing to convert into '" << out_dir_ << "': the input holds no samples");
  ConvertSummary sum;
  sum.out_dir = out_dir_;
  sum.num_samples = written_;
  sum.num_shards = static_cast<int64_t>(tmp_paths_.size());
  sum.num_classes = split_.num_classes > 0 ? split_.num_classes : max_label_ + 1;
  sum.sample_shape = split_.sample_shape;
  const double count = static_cast<double>(written_) * static_cast<double>(split_.sample_bytes() / split_.sample_shape[0]);
  for (size_t c = 0; c < channel_sum_.size(); ++c) {
    const double m = static_cast<double>(channel_sum_[c]) / count / 255.0;
    const double m2 = static_cast<double>(channel_sum_sq_[c]) / count / (255.0 * 255.0);
    sum.mean.push_back(m);
    const double stdev = std::sqrt(std::max(0.0, m2 - m * m));
    sum.std.push_back(stdev > 0 ? stdev : 1.0);  // a constant channel: normalising only subtracts the mean
  }
  {
    auto lock = h5::lock();
    for (const std::string& p : tmp_paths_)
      write_split_attributes(p, split_, sum.num_classes, sum.num_shards, written_, sum.mean, sum.std);
  }
  std::error_code ec;
  for (int64_t s = 0; s < sum.num_shards; ++s) {
    std::string final_path = (fs::path(out_dir_) / shard_name(s)).string();
    fs::rename(tmp_paths_[s], final_path, ec);
    DT_INPUT_CHECK(!ec, "cannot rename '" << tmp_paths_[s] << "' to '" << final_path << "': " << ec.message());
    sum.files.push_back(final_path);
  }
  finished_ = true;
  // Shards beyond ours, left from an earlier conversion with more shards, would be read as part of
  // this dataset: remove them.
  static const std::regex shard_re(R"(shard-(\d+)\.h5)");
  for (const auto& entry : fs::directory_iterator(out_dir_)) {
    std::smatch m;
    std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, shard_re) && std::stoll(m[1].str()) >= sum.num_shards) fs::remove(entry.path(), ec);
  }
  write_shard_index(out_dir_);  // runs then open one file at start, not every shard
  sum.seconds = now_s() - start_s_;
  return sum;
}

ConvertSummary write_shards(const ImageSet& set, const std::string& out_dir, const ShardWriterOptions& opt) {
  DT_INPUT_CHECK(set.size() > 0, "nothing to convert into '" << out_dir << "': the input holds no samples");
  DT_CHECK(static_cast<int64_t>(set.inputs.size()) == set.size() * set.sample_bytes(),
           "ImageSet holds " << set.inputs.size() << " bytes for " << set.size() << " samples");
  ShardWriter writer(out_dir, set, opt);
  writer.add(set);
  return writer.finish();
}

}  // namespace dtrain::data

#include "dtrain/data/dataset.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>

#include "dtrain/core/error.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/data/shard_index.h"

namespace fs = std::filesystem;

namespace dtrain::data {

struct ShardedHdf5Dataset::Shard {
  std::string path;
  h5::Handle file;
  h5::Handle inputs;  // the `inputs` dataset, open for the dataset's lifetime
  int64_t rows = 0;
  uintmax_t file_bytes = 0;  // the file's size when opened: a shard that changes later is refused

  // Throws InputError when the file is gone or its size changed since it was opened (a read from a
  // truncated HDF5 file can return zeros instead of failing).
  void check_unchanged() const {
    std::error_code ec;
    const uintmax_t now = fs::file_size(path, ec);
    DT_INPUT_CHECK(!ec, "shard '" << path << "' disappeared during the run (" << ec.message() << ")");
    DT_INPUT_CHECK(now == file_bytes, "shard '" << path << "' changed during the run: " << file_bytes
                                                << " bytes when opened, " << now << " now");
  }

  // Opens the file and its `inputs` dataset, checks they are u8 (and of shape *expected, when
  // given) and returns their shape [rows, sample...]; on any failure the shard stays unopened.
  // Caller holds the HDF5 lock.
  Shape open(const Shape* expected = nullptr);

  std::mutex mu;  // serialises the loading of this shard into the cache
  // Guarded by the dataset's cache_mu_:
  bool cache_tried = false;                          // without eviction a shard is tried once
  std::shared_ptr<const std::vector<uint8_t>> cache;  // every row, when cached
  uint64_t last_use = 0;
};

std::vector<std::string> list_shards(const std::string& path) {
  DT_INPUT_CHECK(fs::exists(path), "dataset path '" << path << "' does not exist");
  if (!fs::is_directory(path)) return {path};
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(path)) {
    std::string name = e.path().filename().string();
    // Hidden names are the converter's temporaries; they are never part of a dataset.
    if (e.is_regular_file() && e.path().extension() == ".h5" && !name.starts_with(".")) files.push_back(e.path());
  }
  DT_INPUT_CHECK(!files.empty(),
                 "dataset directory '" << path << "' holds no .h5 shards (convert data with `dtrain convert`)");
  std::sort(files.begin(), files.end());
  return files;
}

namespace {

std::string with_detail(const std::string& detail) { return detail.empty() ? "" : " (HDF5: " + detail + ")"; }

h5::Handle open_dataset(hid_t file, const char* name, const std::string& path) {
  DT_INPUT_CHECK(
      H5Lexists(file, name, H5P_DEFAULT) > 0,
      "'" << path << "' has no dataset '" << name << "' (not a dtrain shard? write one with `dtrain convert`)");
  h5::Handle d = h5::dataset(H5Dopen2(file, name, H5P_DEFAULT));
  DT_INPUT_CHECK(d.valid(),
                 "cannot open dataset '" << name << "' in '" << path << "'" << with_detail(h5::last_error()));
  return d;
}

}  // namespace

Shape ShardedHdf5Dataset::Shard::open(const Shape* expected) {
  DT_INPUT_CHECK(H5Fis_hdf5(path.c_str()) > 0, "'" << path << "' is not an HDF5 file (corrupt or truncated?)");
  // Opened into locals and kept only once every check has passed: a shard that failed one is
  // never taken for opened by a later read.
  h5::Handle f = h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  DT_INPUT_CHECK(f.valid(), "cannot open '" << path << "' as HDF5 (corrupt or truncated?)" << with_detail(h5::last_error()));
  h5::Handle d = open_dataset(f.get(), "inputs", path);
  {
    h5::Handle t = h5::type(H5Dget_type(d.get()));
    DT_INPUT_CHECK(
        H5Tget_class(t.get()) == H5T_INTEGER && H5Tget_size(t.get()) == 1 && H5Tget_sign(t.get()) == H5T_SGN_NONE,
        "dataset 'inputs' in '" << path << "' is not of type u8 (unsigned 8-bit integers)");
  }
  // Sizes checked against the file before anything of their size is allocated.
  const Shape dims = h5::read_shape(d.get(), 1, path, "inputs");
  DT_INPUT_CHECK(dims.size() >= 2, "dataset 'inputs' in '" << path << "' has rank " << dims.size()
                                                           << "; expected [N, C, H, W] (or at least [N, F])");
  DT_INPUT_CHECK(shape_numel(Shape(dims.begin() + 1, dims.end())) > 0,
                 "dataset 'inputs' in '" << path << "' has empty samples of shape " << shape_str(dims));
  DT_INPUT_CHECK(!expected || dims == *expected, "shard '" << path << "' holds inputs of shape " << shape_str(dims)
                                                           << " but " << kShardIndexName << " says "
                                                           << shape_str(*expected));
  file = std::move(f);
  inputs = std::move(d);
  return dims;
}

// A shard listed by the index is opened on its first read and must hold what the index says.
// Caller holds the HDF5 lock.
void ShardedHdf5Dataset::open_on_first_use(Shard& shard) const {
  if (shard.inputs.valid()) return;
  Shape expected = {shard.rows};
  expected.insert(expected.end(), info_.sample_shape.begin(), info_.sample_shape.end());
  try {
    shard.open(&expected);
  } catch (const InputError& e) {
    throw InputError(std::string(e.what()) + " (opened on first use from " + kShardIndexName +
                     "; `dtrain convert index " + info_.path + "` rewrites the index)");
  }
}

ShardedHdf5Dataset::ShardedHdf5Dataset(const std::string& path, DatasetOptions opt) : opt_(opt) {
  info_.path = path;
  info_.shards = list_shards(path);
  shard_begin_.push_back(0);
  auto lock = h5::lock();
  try {
    std::string why_not = "a single file";
    std::optional<ShardIndex> index;
    if (fs::is_directory(path)) index = read_shard_index(path, info_.shards, why_not);
    if (index) {
      take_index(std::move(*index));
    } else {
      open_every_shard();
      info_.opened = std::to_string(shards_.size()) + " shard(s) opened at start (" + why_not + ")";
    }
  } catch (...) {
    shards_.clear();  // close what was opened while the HDF5 lock is still held
    throw;
  }
  lock.unlock();
  check_labels();
}

void ShardedHdf5Dataset::take_index(ShardIndex&& ix) {
  for (size_t s = 0; s < info_.shards.size(); ++s) {
    auto shard = std::make_unique<Shard>();
    shard->path = info_.shards[s];
    shard->rows = ix.rows[s];
    shard->file_bytes = static_cast<uintmax_t>(ix.stamps[s].bytes);
    add_shard(std::move(shard));
  }
  labels_ = std::move(ix.labels);
  info_.sample_shape = ix.sample_shape;
  info_.num_classes = ix.num_classes;
  info_.class_names = std::move(ix.class_names);
  info_.has_normalization = !ix.mean.empty();
  info_.mean.assign(ix.mean.begin(), ix.mean.end());
  info_.std.assign(ix.std.begin(), ix.std.end());
  info_.opened = std::to_string(shards_.size()) + " shard(s) from " + kShardIndexName + ", each opened on first use";
}

void ShardedHdf5Dataset::add_shard(std::unique_ptr<Shard> shard) {
  info_.shard_rows.push_back(shard->rows);
  shard_begin_.push_back(shard_begin_.back() + shard->rows);
  shards_.push_back(std::move(shard));
}

// Every shard opened and checked in turn, its labels read and the split's attributes taken from the
// shards. Caller holds the HDF5 lock.
void ShardedHdf5Dataset::open_every_shard() {
  std::string first;  // the shard that set the expected shape, for messages
  for (const std::string& file : info_.shards) {
    auto shard = std::make_unique<Shard>();
    shard->path = file;
    shard->file_bytes = fs::file_size(file);
    const Shape idims = shard->open();
    shard->rows = idims[0];
    const Shape sample(idims.begin() + 1, idims.end());
    if (first.empty()) {
      info_.sample_shape = sample;
      first = file;
    } else {
      DT_INPUT_CHECK(sample == info_.sample_shape, "dataset 'inputs' in '" << file << "' has sample shape "
                                                                           << shape_str(sample) << " but '" << first
                                                                           << "' has " << shape_str(info_.sample_shape)
                                                                           << ": the shards do not agree");
    }
    read_shard_attributes(*shard, sample);
    add_shard(std::move(shard));
  }
}

// The shard's labels (appended to labels_) and its attributes, checked against the shards before it.
void ShardedHdf5Dataset::read_shard_attributes(const Shard& shard, const Shape& sample) {
  const hid_t f = shard.file.get();
  const std::string& file = shard.path;
  std::vector<int64_t> attr_shape;
  if (h5::read_attr_i64(f, "sample_shape", attr_shape))
    DT_INPUT_CHECK(Shape(attr_shape) == sample, "'" << file << "' attribute sample_shape " << shape_str(attr_shape)
                                                    << " disagrees with dataset 'inputs' " << shape_str(sample));
  std::string dtype;
  if (h5::read_attr_string(f, "dtype", dtype))
    DT_INPUT_CHECK(dtype == "u8", "'" << file << "' attribute dtype is '" << dtype << "'; only u8 is supported");

  // labels: integer [N], read whole and kept
  h5::Handle labels = open_dataset(f, "labels", file);
  h5::Handle t = h5::type(H5Dget_type(labels.get()));
  DT_INPUT_CHECK(H5Tget_class(t.get()) == H5T_INTEGER, "dataset 'labels' in '" << file << "' is not integer");
  const Shape ldims = h5::read_shape(labels.get(), sizeof(int32_t), file, "labels");
  DT_INPUT_CHECK(ldims.size() == 1 && ldims[0] == shard.rows, "dataset 'labels' in '"
                                                                  << file << "' has shape " << shape_str(ldims)
                                                                  << " but dataset 'inputs' holds " << shard.rows
                                                                  << " samples");
  const size_t at = labels_.size();
  labels_.resize(at + shard.rows);
  if (shard.rows > 0)
    DT_INPUT_CHECK(H5Dread(labels.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels_.data() + at) >= 0,
                   "cannot read dataset 'labels' in '" << file << "' (corrupt or truncated?)"
                                                       << with_detail(h5::last_error()));

  std::vector<int64_t> classes;
  if (h5::read_attr_i64(f, "num_classes", classes) && !classes.empty()) {
    DT_INPUT_CHECK(classes[0] > 0 && classes[0] <= std::numeric_limits<int32_t>::max(),
                   "'" << file << "' attribute num_classes is " << classes[0]);
    DT_INPUT_CHECK(info_.num_classes == 0 || classes[0] == info_.num_classes,
                   "'" << file << "' attribute num_classes is " << classes[0] << " but earlier shards say "
                       << info_.num_classes);
    info_.num_classes = static_cast<int>(classes[0]);
  }
  if (info_.class_names.empty()) h5::read_attr_strings(f, "class_names", info_.class_names);
  if (!info_.has_normalization) {
    std::vector<double> mean, stdev;
    if (h5::read_attr_f64(f, "mean", mean) && h5::read_attr_f64(f, "std", stdev)) {
      check_normalization(file, info_.sample_shape, mean, stdev);
      info_.mean.assign(mean.begin(), mean.end());
      info_.std.assign(stdev.begin(), stdev.end());
      info_.has_normalization = true;
    }
  }
}

void check_normalization(const std::string& file, const Shape& sample_shape, const std::vector<double>& mean,
                         const std::vector<double>& stdev) {
  const size_t c = static_cast<size_t>(sample_channels(sample_shape));
  DT_INPUT_CHECK(mean.size() == c && stdev.size() == c, "'" << file << "' attributes mean/std have " << mean.size()
                                                            << "/" << stdev.size() << " values for " << c
                                                            << " channel(s)");
  for (double s : stdev) DT_INPUT_CHECK(s > 0, "'" << file << "' attribute std holds " << s << " (must be > 0)");
}

// The totals, defaults for what the shards did not say, and every label within [0, num_classes).
void ShardedHdf5Dataset::check_labels() {
  info_.num_samples = shard_begin_.back();
  DT_INPUT_CHECK(info_.num_samples > 0, "dataset '" << info_.path << "' holds no samples");
  if (!info_.has_normalization) {
    info_.mean.assign(info_.channels(), 0.0f);
    info_.std.assign(info_.channels(), 1.0f);
  }
  auto shard_of = [&](int64_t g) {
    return static_cast<size_t>(std::upper_bound(shard_begin_.begin(), shard_begin_.end(), g) - shard_begin_.begin() - 1);
  };
  const auto max_at = std::max_element(labels_.begin(), labels_.end());
  if (info_.num_classes == 0) {
    const int64_t g = max_at - labels_.begin();
    DT_INPUT_CHECK(*max_at < std::numeric_limits<int32_t>::max(),
                   "dataset 'labels' in '" << shards_[shard_of(g)]->path << "' row " << g - shard_begin_[shard_of(g)]
                                           << " holds label " << *max_at
                                           << ": no class count above it fits (no num_classes attribute)");
    info_.num_classes = *max_at + 1;
  }
  DT_INPUT_CHECK(info_.class_names.empty() || static_cast<int>(info_.class_names.size()) == info_.num_classes,
                 "dataset '" << info_.path << "' has " << info_.class_names.size() << " class names for "
                             << info_.num_classes << " classes");
  for (int64_t g = 0; g < info_.num_samples; ++g) {
    DT_INPUT_CHECK(labels_[g] >= 0 && labels_[g] < info_.num_classes,
                   "dataset 'labels' in '" << shards_[shard_of(g)]->path << "' row " << g - shard_begin_[shard_of(g)]
                                           << " holds label " << labels_[g] << ", outside [0, " << info_.num_classes
                                           << ")");
  }
}

ShardedHdf5Dataset::~ShardedHdf5Dataset() {
  auto lock = h5::lock();
  shards_.clear();  // closes the HDF5 handles under the lock
}

int32_t ShardedHdf5Dataset::label(int64_t index) const {
  DT_CHECK(index >= 0 && index < size(), "sample index " << index << " outside [0, " << size() << ")");
  return labels_[index];
}

int64_t ShardedHdf5Dataset::cached_bytes() const {
  std::lock_guard<std::mutex> g(cache_mu_);
  return cached_bytes_;
}

void ShardedHdf5Dataset::read(std::span<const int64_t> indices, Tensor& inputs, Tensor& labels) const {
  Shape shape = {static_cast<int64_t>(indices.size())};
  shape.insert(shape.end(), info_.sample_shape.begin(), info_.sample_shape.end());
  inputs = Tensor::empty(shape, DType::U8);
  labels = Tensor::empty({static_cast<int64_t>(indices.size())}, DType::I32);
  read(indices, inputs.data<uint8_t>(), labels.data<int32_t>());
}

void ShardedHdf5Dataset::read_whole_shard(size_t s, uint8_t* rows) const {
  DT_CHECK(s < shards_.size(), "shard " << s << " of " << shards_.size());
  read_all_rows(*shards_[s], rows);
}

void ShardedHdf5Dataset::read(std::span<const int64_t> indices, uint8_t* inputs, int32_t* labels) const {
  // Group (row within shard, slot in the output) by shard.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> per_shard(shards_.size());
  for (size_t slot = 0; slot < indices.size(); ++slot) {
    const int64_t g = indices[slot];
    DT_CHECK(g >= 0 && g < size(), "sample index " << g << " outside [0, " << size() << ")");
    if (labels) labels[slot] = labels_[g];
    size_t s = std::upper_bound(shard_begin_.begin(), shard_begin_.end(), g) - shard_begin_.begin() - 1;
    if (shared_rows_ && shard_in_place_[s].load(std::memory_order_acquire) == 1) {
      const int64_t row_bytes = info_.sample_bytes();
      std::memcpy(inputs + slot * row_bytes, shared_rows_ + g * row_bytes, static_cast<size_t>(row_bytes));
      continue;
    }
    per_shard[s].emplace_back(g - shard_begin_[s], static_cast<int64_t>(slot));
  }
  for (size_t s = 0; s < shards_.size(); ++s)
    if (!per_shard[s].empty()) read_shard(*shards_[s], per_shard[s], inputs);
}

void ShardedHdf5Dataset::set_options(const DatasetOptions& opt) {
  std::lock_guard<std::mutex> c(cache_mu_);
  DT_CHECK(cached_bytes_ == 0 && whole_reads_ == 0, "dataset '" << info_.path << "': cache options set after reads");
  opt_ = opt;
}

int store_holder(size_t shard, int data_ranks) { return static_cast<int>(shard % static_cast<size_t>(data_ranks)); }

namespace {
std::string megabytes(int64_t bytes) {
  char mb[32];
  std::snprintf(mb, sizeof mb, "%.1f MB", static_cast<double>(bytes) / (1 << 20));
  return mb;
}

// The most bytes of shards one of `data_ranks` ranks holds in the store.
int64_t largest_store_share(const DatasetInfo& info, int data_ranks) {
  std::vector<int64_t> held(static_cast<size_t>(data_ranks), 0);
  for (size_t s = 0; s < info.shards.size(); ++s) held[store_holder(s, data_ranks)] += info.shard_rows[s] * info.sample_bytes();
  return *std::max_element(held.begin(), held.end());
}
}  // namespace

DataReading choose_reading(const DatasetInfo& info, const std::string& mode, int64_t node_cache_mb, int ranks_on_node,
                           int data_ranks) {
  DT_INPUT_CHECK(mode == "auto" || mode == "cache" || mode == "store" || mode == "stream",
                 "option --data-mode must be auto, cache, store or stream, got '" << mode << "'");
  DT_INPUT_CHECK(node_cache_mb >= 0, "option --data-cache-mb must be >= 0, got " << node_cache_mb);
  ranks_on_node = std::max(ranks_on_node, 1);
  const int64_t per_node = node_cache_mb << 20, per_rank = per_node / ranks_on_node;
  const int64_t total = info.num_samples * info.sample_bytes();
  const int64_t largest = *std::max_element(info.shard_rows.begin(), info.shard_rows.end()) * info.sample_bytes();
  const int64_t store_share = largest_store_share(info, std::max(data_ranks, 1));
  DataReading r;
  r.mode = mode != "auto"                            ? mode
           : total <= per_node                       ? "cache"
           : data_ranks > 1 && store_share <= per_rank ? "store"
                                                     : "stream";
  r.node_shared = r.mode == "cache" && total <= per_node;
  const std::string why = mode == "auto" ? "auto: " : "";
  const std::string size = megabytes(total) + " in " + std::to_string(info.shards.size()) + " shard(s)";
  const std::string budget = "cache budget " + megabytes(per_rank) + " per rank = " + std::to_string(node_cache_mb) +
                             " MB per node / " + std::to_string(ranks_on_node) + " rank(s)";
  const std::string against_budget = size + (total <= per_rank ? " <= " : " > ") + budget;
  r.dataset.cache_bytes = per_rank;
  if (r.node_shared) {
    r.dataset.cache_bytes = 0;  // rows not yet in the node's copy are read per request
    r.text = "mode cache (" + why + size + " <= cache budget " + std::to_string(node_cache_mb) +
             " MB per node: one copy shared by the node's " + std::to_string(ranks_on_node) + " rank(s))";
  } else if (r.mode == "store") {
    DT_INPUT_CHECK(store_share <= per_rank,
                   "option --data-cache-mb " << node_cache_mb << ": the store of '" << info.path << "' gives one of its "
                                             << data_ranks << " rank(s) " << megabytes(store_share) << " of shards, over its "
                                             << budget << "; give at least "
                                             << (store_share * ranks_on_node + (1 << 20) - 1) / (1 << 20));
    r.text = "mode store (" + why + size + " over " + std::to_string(data_ranks) + " rank(s), at most " +
             megabytes(store_share) + " each, within the " + budget + "; batches gathered by all-to-all)";
  } else if (r.mode == "stream") {
    DT_INPUT_CHECK(per_rank >= 2 * largest,
                   "option --data-cache-mb " << node_cache_mb << ": streaming '" << info.path << "' holds two shards of "
                                             << megabytes(largest) << " per rank (" << ranks_on_node
                                             << " on this node): give at least "
                                             << (2 * largest * ranks_on_node + (1 << 20) - 1) / (1 << 20));
    r.dataset.evict = true;
    // One window being read, the next read ahead into; no more than the shards there are.
    r.window_shards = std::clamp<int64_t>(per_rank / largest / 2, 1, static_cast<int64_t>(info.shards.size()));
    r.text = "mode stream (" + why + against_budget + "; windows of " + std::to_string(r.window_shards) +
             " shard(s))";
  } else {
    r.text = "mode cache (" + why + against_budget + ")";
  }
  return r;
}

int64_t ShardedHdf5Dataset::bytes_read() const {
  std::lock_guard<std::mutex> g(cache_mu_);
  return bytes_read_;
}

int64_t ShardedHdf5Dataset::whole_shard_reads() const {
  std::lock_guard<std::mutex> g(cache_mu_);
  return whole_reads_;
}

// Rows [first, first + count) of the shard's inputs into `out`: one hyperslab. Caller holds the
// HDF5 lock and has opened the shard.
bool ShardedHdf5Dataset::read_rows(const Shard& shard, int64_t first, int64_t count, uint8_t* out) const {
  h5::Handle fspace = h5::space(H5Dget_space(shard.inputs.get()));
  const int rank = static_cast<int>(info_.sample_shape.size()) + 1;
  std::vector<hsize_t> start(rank, 0), dims(rank);
  for (int d = 1; d < rank; ++d) dims[d] = static_cast<hsize_t>(info_.sample_shape[d - 1]);
  start[0] = static_cast<hsize_t>(first);
  dims[0] = static_cast<hsize_t>(count);
  h5::Handle mspace = h5::space(H5Screate_simple(rank, dims.data(), nullptr));
  return fspace.valid() && mspace.valid() &&
         H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, dims.data(), nullptr) >= 0 &&
         H5Dread(shard.inputs.get(), H5T_NATIVE_UINT8, mspace.get(), fspace.get(), H5P_DEFAULT, out) >= 0;
}

// Every row of the shard's inputs into `rows`: one sequential pass over a file unchanged since it was
// opened, counted in whole_shard_reads() and bytes_read(). It goes in slabs of about kSlabBytes, the
// HDF5 lock taken for each, so that a whole shard (an image folder's are 256 MiB) read by the
// node-shared cache's filler or the store does not hold every per-request read of the process
// behind it.
void ShardedHdf5Dataset::read_all_rows(Shard& shard, uint8_t* rows) const {
  constexpr int64_t kSlabBytes = int64_t(4) << 20;
  shard.check_unchanged();
  const int64_t row_bytes = info_.sample_bytes();
  const int64_t slab_rows = std::max<int64_t>(1, kSlabBytes / row_bytes);
  for (int64_t first = 0; first < shard.rows; first += slab_rows) {
    auto lock = h5::lock();
    open_on_first_use(shard);
    DT_INPUT_CHECK(read_rows(shard, first, std::min(slab_rows, shard.rows - first), rows + first * row_bytes),
                   "cannot read dataset 'inputs' in '" << shard.path << "' (corrupt or truncated?)"
                                                       << with_detail(h5::last_error()));
  }
  std::lock_guard<std::mutex> c(cache_mu_);
  ++whole_reads_;
  bytes_read_ += shard.rows * row_bytes;
}

// The shard's rows from the cache, read whole (one sequential read) if they are not there and fit
// (evicting the least recently used shards when `evict`); null when the shard is read per request.
std::shared_ptr<const std::vector<uint8_t>> ShardedHdf5Dataset::cached_rows(Shard& shard) const {
  auto cached = [&]() -> std::shared_ptr<const std::vector<uint8_t>> {  // under cache_mu_
    if (shard.cache) shard.last_use = ++use_clock_;
    return shard.cache;
  };
  {
    std::lock_guard<std::mutex> c(cache_mu_);
    if (auto rows = cached()) return rows;
  }
  std::lock_guard<std::mutex> g(shard.mu);  // one thread loads a shard; the others wait for it
  const int64_t bytes = shard.rows * info_.sample_bytes();
  {
    std::lock_guard<std::mutex> c(cache_mu_);
    if (auto rows = cached()) return rows;
    if ((shard.cache_tried && !opt_.evict) || bytes > opt_.cache_bytes) return nullptr;
    shard.cache_tried = true;
    while (opt_.evict && cached_bytes_ + bytes > opt_.cache_bytes) {
      Shard* oldest = nullptr;
      for (const auto& other : shards_)
        if (other->cache && (!oldest || other->last_use < oldest->last_use)) oldest = other.get();
      if (!oldest) break;
      oldest->cache.reset();  // freed when its last reader lets go
      cached_bytes_ -= oldest->rows * info_.sample_bytes();
    }
    if (cached_bytes_ + bytes > opt_.cache_bytes) return nullptr;
    cached_bytes_ += bytes;
  }
  auto rows = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
  try {
    read_all_rows(shard, rows->data());
  } catch (const InputError&) {
    std::lock_guard<std::mutex> c(cache_mu_);
    cached_bytes_ -= bytes;
    throw;
  }
  std::lock_guard<std::mutex> c(cache_mu_);
  shard.cache = rows;
  shard.last_use = ++use_clock_;
  return shard.cache;
}

void ShardedHdf5Dataset::read_shard(Shard& shard, std::span<const std::pair<int64_t, int64_t>> rows_and_slots,
                                    uint8_t* inputs) const {
  const int64_t row_bytes = info_.sample_bytes();
  if (const auto cache = cached_rows(shard)) {
    for (const auto& [row, slot] : rows_and_slots)
      std::memcpy(inputs + slot * row_bytes, cache->data() + row * row_bytes, static_cast<size_t>(row_bytes));
    return;
  }

  // Not cached: read the distinct requested rows in ascending order, one hyperslab per run of
  // consecutive rows. (One H5Dread per run: a single OR-ed union selection of the same runs measured
  // 5-8x slower with HDF5 1.10 for 128 random rows.)
  std::vector<std::pair<int64_t, int64_t>> sorted(rows_and_slots.begin(), rows_and_slots.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> unique_rows;
  std::vector<int64_t> position(sorted.size());  // sorted[i]'s row is unique_rows[position[i]]
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (unique_rows.empty() || unique_rows.back() != sorted[i].first) unique_rows.push_back(sorted[i].first);
    position[i] = static_cast<int64_t>(unique_rows.size()) - 1;
  }
  std::vector<uint8_t> buf(unique_rows.size() * static_cast<size_t>(row_bytes));
  shard.check_unchanged();
  {
    auto lock = h5::lock();
    open_on_first_use(shard);
    bool ok = true;
    for (size_t i = 0; i < unique_rows.size() && ok;) {
      size_t j = i + 1;
      while (j < unique_rows.size() && unique_rows[j] == unique_rows[j - 1] + 1) ++j;
      ok = read_rows(shard, unique_rows[i], static_cast<int64_t>(j - i), buf.data() + i * static_cast<size_t>(row_bytes));
      i = j;
    }
    DT_INPUT_CHECK(ok, "cannot read dataset 'inputs' in '" << shard.path << "' (corrupt or truncated?)"
                                                           << with_detail(h5::last_error()));
  }
  {
    std::lock_guard<std::mutex> c(cache_mu_);
    bytes_read_ += static_cast<int64_t>(buf.size());
  }
  for (size_t i = 0; i < sorted.size(); ++i)
    std::memcpy(inputs + sorted[i].second * row_bytes, buf.data() + position[i] * row_bytes,
                static_cast<size_t>(row_bytes));
}

}  // namespace dtrain::data

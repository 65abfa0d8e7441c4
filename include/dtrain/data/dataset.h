#pragma once
// ShardedHdf5Dataset: a read-only view of a directory of HDF5 shards written by `dtrain convert`
// (format in docs/data.md), addressed by global sample index 0..num_samples-1 across the shards
// taken in sorted file-name order.
//
// Reading: the whole `labels` column is loaded at open (4 bytes a sample; it is needed to validate
// the label range anyway). Inputs are read on demand. A shard is cached whole in memory the first
// time any of its rows is read, as long as the cache stays under `cache_bytes` (or, with `evict`, by
// making room: least recently used shards leave); a shard that does not fit is read per request: the requested rows are sorted, de-duplicated and coalesced into runs of
// consecutive rows, each read as one hyperslab. So a rank reads only the shards its samples fall in; under the default
// budget small datasets (Fashion-MNIST: 47 MB) end up read once, sequentially, and served from memory after that.
//
// Thread safety: read() may be called from several loader threads at once. HDF5 itself is serialised
// by one process-wide mutex (the installed parallel HDF5 is not thread-safe).
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"

namespace dtrain::data {

// Channels for per-channel normalisation: C of a [C, H, W] sample, else 1.
inline int64_t sample_channels(const Shape& sample_shape) {
  return sample_shape.size() == 3 ? sample_shape[0] : 1;
}

struct DatasetInfo {
  std::string path;                 // the directory or file opened
  std::vector<std::string> shards;  // the shard files, in global index order
  std::vector<int64_t> shard_rows;  // samples in each shard
  Shape sample_shape;               // e.g. [1, 28, 28]
  int64_t num_samples = 0;          // over all shards
  int num_classes = 0;
  std::vector<std::string> class_names;  // one per class when the shards carry `class_names`, else empty
  std::vector<float> mean;         // per channel, pixel/255 units; 0 when the shards carry no `mean`
  std::vector<float> std;          // per channel; 1 when the shards carry no `std`
  bool has_normalization = false;  // the shards carried `mean` and `std`
  std::string opened;  // how the shards were opened: "60 shard(s) from shards.index, each opened on first use", ...

  int64_t sample_bytes() const { return shape_numel(sample_shape); }
  int64_t channels() const { return sample_channels(sample_shape); }
};

// Throws InputError naming `file` unless `mean` and `stdev` hold one value per channel of samples
// shaped `sample_shape` and every std is > 0: the shards' attributes and the shard index alike.
void check_normalization(const std::string& file, const Shape& sample_shape, const std::vector<double>& mean,
                         const std::vector<double>& stdev);

// The shard files of a dataset `path`: every non-hidden *.h5 file of a directory, sorted, or `path`
// itself when it is a file. Throws InputError when it does not exist or holds no shard.
std::vector<std::string> list_shards(const std::string& path);

struct ShardIndex;  // shard_index.h

struct DatasetOptions {
  int64_t cache_bytes = int64_t(2) << 30;  // memory for whole-shard caching; 0 disables the cache
  // Streaming (--data-mode stream): when a shard does not fit, the least recently used shards leave
  // the cache to make room (a reader still copying from one keeps it alive until it is done), so
  // reads that walk the shards in turn read each whole, sequentially, once per pass. Without it a
  // shard that does not fit is read per request.
  bool evict = false;
};

class ShardedHdf5Dataset {
 public:
  // `path` is a directory (all *.h5 files in it, sorted) or one .h5 file. A directory whose
  // shards.index describes it as it is (shard_index.h) is opened from the index, each shard opened
  // and checked against it on its first read; otherwise every shard is opened and checked here.
  // Throws InputError naming the file and dataset on anything unreadable or inconsistent.
  explicit ShardedHdf5Dataset(const std::string& path, DatasetOptions opt = {});
  ~ShardedHdf5Dataset();
  ShardedHdf5Dataset(const ShardedHdf5Dataset&) = delete;
  ShardedHdf5Dataset& operator=(const ShardedHdf5Dataset&) = delete;

  const DatasetInfo& info() const { return info_; }
  int64_t size() const { return info_.num_samples; }

  // Reads the samples `indices` (global, any order, repeats allowed) into `inputs`
  // (indices.size() * sample_bytes() bytes, sample-major) and `labels` (indices.size() values).
  void read(std::span<const int64_t> indices, uint8_t* inputs, int32_t* labels) const;

  // The same into new tensors: u8 [n, C, H, W] and i32 [n].
  void read(std::span<const int64_t> indices, Tensor& inputs, Tensor& labels) const;

  // Sets the cache's budget and eviction before the first read (a run decides them from the
  // dataset's size: choose_reading).
  void set_options(const DatasetOptions& opt);

  // The node-shared cache: `rows` has room for every sample's inputs in global index order, filled
  // shard by shard by the node's ranks with read_whole_shard (shared through
  // comm::NodeSharedMemory) while training runs; `in_place[s]` turns 1 (release) once shard s is
  // there. Reads copy the rows of shards in place and read the others' per request.
  void read_whole_shard(size_t shard, uint8_t* rows) const;
  void use_shared_rows(const uint8_t* rows, const std::atomic<uint32_t>* in_place) {
    shared_rows_ = rows;
    shard_in_place_ = in_place;
  }

  int32_t label(int64_t index) const;
  std::span<const int32_t> labels() const { return labels_; }  // every sample's, in global index order
  int64_t cached_bytes() const;  // inputs held by the whole-shard cache now
  int64_t whole_shard_reads() const;  // shards read whole into the cache so far (each once, sequentially)
  int64_t bytes_read() const;         // input bytes read from the files so far, whole shards and rows

 private:
  struct Shard;
  void read_shard(Shard& shard, std::span<const std::pair<int64_t, int64_t>> rows_and_slots, uint8_t* inputs) const;
  void take_index(ShardIndex&& index);
  void open_every_shard();
  void read_shard_attributes(const Shard& shard, const Shape& sample);
  void add_shard(std::unique_ptr<Shard> shard);
  void check_labels();
  void open_on_first_use(Shard& shard) const;
  bool read_rows(const Shard& shard, int64_t first, int64_t count, uint8_t* out) const;

  DatasetInfo info_;
  DatasetOptions opt_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<int64_t> shard_begin_;  // global index of each shard's first row, plus the total at the end
  std::vector<int32_t> labels_;       // all labels, global order
  const uint8_t* shared_rows_ = nullptr;  // every sample's inputs (use_shared_rows), or null
  const std::atomic<uint32_t>* shard_in_place_ = nullptr;  // per shard: 1 when its rows are in shared_rows_
  std::shared_ptr<const std::vector<uint8_t>> cached_rows(Shard& shard) const;
  void read_all_rows(Shard& shard, uint8_t* rows) const;

  mutable std::mutex cache_mu_;       // guards every shard's cache pointer and last use, and these:
  mutable int64_t cached_bytes_ = 0;
  mutable int64_t whole_reads_ = 0;
  mutable int64_t bytes_read_ = 0;
  mutable uint64_t use_clock_ = 0;
};

// How a run reads a dataset (--data-mode, --data-cache-mb): `cache` keeps whole shards in memory up to
// the budget (the rest read per request); `store` spreads the shards over the job's data-parallel
// ranks (store_holder), each holding its own whole in memory, and every batch gathers its rows from
// their holders by an all-to-all (DataLoader::use_store); `stream` walks shards in windows through an
// evicting cache (DistributedSampler's streaming order). `auto` caches a set that fits the node's
// budget, stores one whose largest share fits a rank's, and streams the rest. The budget is per node:
// a set that fits it is cached once per node, shared by the node's ranks; otherwise the budget is
// split among the node's ranks.
struct DataReading {
  std::string mode;            // "cache", "store" or "stream"
  bool node_shared = false;    // cache: the whole set in one copy per node (it fits the node's budget)
  DatasetOptions dataset;      // the training set's cache
  int64_t window_shards = 0;   // streaming: shards shuffled together (LoaderOptions::stream_window_shards)
  std::string text;            // "mode stream (2900.0 MB > ...)": what was chosen and why
};
// `data_ranks`: the ranks that share the store (the data-parallel ranks). Throws InputError naming
// --data-mode or --data-cache-mb when they cannot work for this dataset.
DataReading choose_reading(const DatasetInfo& info, const std::string& mode, int64_t node_cache_mb, int ranks_on_node,
                           int data_ranks);
// The rank of `data_ranks` that holds shard `shard` in the store: shards are dealt round-robin.
int store_holder(size_t shard, int data_ranks);

}  // namespace dtrain::data

#pragma once
// The shard index: DIR/shards.index, one HDF5 file that describes a directory of shards (each
// shard's file name, size, modification time and row count; every label; the split's attributes),
// so that a run reads one file at start and opens each shard on first use: the start no longer
// grows with the shard count (2,400 shards took 1 s to open one by one). `dtrain convert` writes it
// beside the shards; `dtrain convert index DIR` writes it for shards made some other way. An index
// is used only while it describes the directory as it is: the same shard names, and each shard the
// size and modification time it had when indexed. Format in docs/data.md.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"

namespace dtrain::data {

inline constexpr const char* kShardIndexName = "shards.index";

// A file's size and modification time, as the index records them.
struct FileStamp {
  int64_t bytes = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};
// Throws InputError naming `path` when it cannot be read (gone, or not a file).
FileStamp file_stamp(const std::string& path);

struct ShardIndex {
  std::vector<std::string> names;  // shard file names (no folder), sorted
  std::vector<FileStamp> stamps;   // per shard
  std::vector<int64_t> rows;       // per shard
  std::vector<int32_t> labels;     // every sample's, in global index order
  Shape sample_shape;
  int num_classes = 0;
  std::vector<std::string> class_names;
  std::vector<double> mean, std;  // empty when the shards carry no normalisation
};

// Opens and checks every shard of directory `dir` (as a run without an index does) and writes
// DIR/shards.index for them, replacing any index there (written under a hidden name, then renamed).
// Returns the number of shards indexed. Throws InputError on a shard that does not open.
int64_t write_shard_index(const std::string& dir);

// The index of `dir` when there is one and it describes `shard_paths` (the directory's shards, in
// order) as they are now; otherwise nullopt and `why_not` says why ("no shards.index", "shard 'x'
// changed since the index was written", a corrupt index). Caller holds the HDF5 lock.
std::optional<ShardIndex> read_shard_index(const std::string& dir, const std::vector<std::string>& shard_paths,
                                           std::string& why_not);

}  // namespace dtrain::data

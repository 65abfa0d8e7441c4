#pragma once
// Converters from the classic image formats (MNIST-style idx, CIFAR-10 binary batches) to dtrain's
// on-disk dataset: a directory of self-describing HDF5 shards (format in docs/data.md).
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"

namespace dtrain::data {

// A labelled image set held in memory while it is converted.
struct ImageSet {
  Shape sample_shape;           // [C, H, W]
  std::vector<uint8_t> inputs;  // size() * C*H*W bytes, sample-major, each sample CHW
  std::vector<int32_t> labels;  // size() labels
  int num_classes = 0;          // 0: infer as max(label) + 1 when writing
  std::vector<std::string> class_names;  // optional, one per class: the `class_names` attribute
  std::string source;           // where it came from, stored in the `source` attribute

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  int64_t sample_bytes() const { return shape_numel(sample_shape); }
};

// Reads an idx image file (magic 0x00000803, u8 [N, H, W]) and an idx label file (magic 0x00000801,
// u8 [N]) as a one-channel ImageSet. Each may be gzip-compressed or raw. Throws InputError naming the
// file on a bad magic number, truncated data or an image/label count mismatch.
ImageSet read_idx(const std::string& images_path, const std::string& labels_path);

// Reads CIFAR-10 binary batches (records of 1 label byte + 3072 bytes of a 3x32x32 CHW image), in
// the order given, into one ImageSet with num_classes = 10.
ImageSet read_cifar10(const std::vector<std::string>& files);

struct ShardWriterOptions {
  int64_t shard_size = 10000;  // samples per shard (the last shard may hold fewer)
  // HDF5 chunk along the sample dimension (clamped to the shard size). Small chunks keep random
  // reads of single rows cheap (a read pulls whole chunks): 64 Fashion-MNIST rows are 50 KB.
  int64_t chunk_rows = 64;
  int compress_level = 0;  // deflate level 0..9; 0 stores the chunks uncompressed
};

struct ConvertSummary {
  std::string out_dir;
  int64_t num_samples = 0;
  int64_t num_shards = 0;
  int num_classes = 0;
  Shape sample_shape;
  std::vector<double> mean;        // per channel, pixel/255 units
  std::vector<double> std;         // per channel, population standard deviation, pixel/255 units (1: constant)
  std::vector<std::string> files;  // the shards written, in order
  double seconds = 0;

  std::string str() const;  // one line for the CLI
};

// Writes one split as out_dir/shard-00000.h5, shard-00001.h5, ... (creating out_dir) from samples
// given in any number of add() calls, holding at most one shard in memory. Each shard is written
// under a hidden temporary name; finish() sets the attributes that describe the whole split (class
// count, per-channel mean/std, totals) in every shard, renames them to their final names and removes
// shard-*.h5 files left in out_dir from an earlier, larger conversion, so the directory holds exactly
// this split. A writer destroyed before finish() (an exception) removes its temporaries.
class ShardWriter {
 public:
  // `split`: the sample shape [C, H, W], num_classes (0: the largest label + 1), class_names and
  // source of the split; its samples are not written (pass them to add()).
  ShardWriter(const std::string& out_dir, const ImageSet& split, const ShardWriterOptions& opt = {});
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // `n` samples: inputs holds n * C*H*W bytes (each sample CHW), labels n labels.
  void add(const uint8_t* inputs, const int32_t* labels, int64_t n);
  void add(const ImageSet& set) { add(set.inputs.data(), set.labels.data(), set.size()); }
  int64_t samples() const { return written_ + pending_rows(); }
  ConvertSummary finish();

 private:
  int64_t pending_rows() const { return static_cast<int64_t>(pending_labels_.size()); }
  void write_shard(const uint8_t* inputs, const int32_t* labels, int64_t rows);

  std::string out_dir_;
  ImageSet split_;  // header only: no samples
  ShardWriterOptions opt_;
  std::vector<std::string> tmp_paths_;
  std::vector<uint8_t> pending_inputs_;  // samples of the shard being filled
  std::vector<int32_t> pending_labels_;
  int64_t written_ = 0;
  int32_t max_label_ = -1;
  std::vector<uint64_t> channel_sum_, channel_sum_sq_;  // pixel values and their squares
  double start_s_ = 0;
  bool finished_ = false;
};

// `set` as one split (see ShardWriter).
ConvertSummary write_shards(const ImageSet& set, const std::string& out_dir, const ShardWriterOptions& opt = {});

}  // namespace dtrain::data

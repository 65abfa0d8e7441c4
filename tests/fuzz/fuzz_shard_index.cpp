// Fuzz target: the shard index (DIR/shards.index) as ShardedHdf5Dataset opens a folder of shards:
// read_shard_index, then, when the index describes the folder, each shard opened on its first read
// and checked against what the index says. The folder holds one of three small sets of valid shards
// (written once per process, so their sizes and times stay what their index records).
// fuzz_shard_index: the input's first byte picks the set, the rest is the index file (rarely fresh:
// its times are those of the seed maker's shards). fuzz_shard_index_h5: the input picks the set, then
// edits its valid index through HDF5's writer (fuzz_h5.h): datasets and attributes replaced, added,
// of other types and sizes, so that the reader's checks behind a fresh index are reached. A dataset
// that opens must read its first, middle and last samples and give labels inside [0, num_classes).
#include <array>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/convert.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/data/shard_index.h"
#include "fuzz_util.h"
#ifdef DTRAIN_FUZZ_H5_RECIPE
#include "fuzz_h5.h"
#endif

using namespace dtrain;

namespace {

// Set k: 5 + 2k samples of [1 + k % 2, 2, 2 + k], in shards of 2 + k rows, its valid index kept aside.
struct ShardSet {
  fuzz::fs::path dir;
  std::string index;
};

ShardSet write_set(int k) {
  data::ImageSet set;
  set.sample_shape = {1 + k % 2, 2, 2 + k};
  set.num_classes = 3 + k;
  set.class_names = k == 1 ? std::vector<std::string>{"a", "b", "c", "d"} : std::vector<std::string>{};
  const int64_t n = 5 + 2 * k;
  for (int64_t i = 0; i < n; ++i) {
    set.labels.push_back(static_cast<int32_t>(i % set.num_classes));
    for (int64_t j = 0; j < shape_numel(set.sample_shape); ++j) set.inputs.push_back(static_cast<uint8_t>(i * 31 + j));
  }
  data::ShardWriterOptions opt;
  opt.shard_size = 2 + k;
  opt.chunk_rows = 1 + k % 2;
  opt.compress_level = k == 2 ? 1 : 0;
  ShardSet s{fuzz::scratch() / ("set" + std::to_string(k)), ""};
  data::write_shards(set, s.dir.string(), opt);
  s.index = fuzz::read_file(s.dir / data::kShardIndexName);
  return s;
}

const ShardSet& shard_set(size_t k) {
  static const std::array<ShardSet, 3> sets = {write_set(0), write_set(1), write_set(2)};
  return sets[k % sets.size()];
}

void read_dataset(const fuzz::fs::path& dir) {
  try {
    data::ShardedHdf5Dataset ds(dir.string());
    const int64_t n = ds.size();
    fuzz::read_checking_labels(ds, {n - 1, 0, n / 2});
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  fuzz::expect_no_open_hdf5_objects("ShardedHdf5Dataset over shards.index");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return -1;
  const ShardSet& set = shard_set(data[0]);
  const fuzz::fs::path index = set.dir / data::kShardIndexName;
#ifdef DTRAIN_FUZZ_H5_RECIPE
  static const fuzz::H5Vocabulary vocabulary{{{"names", H5T_STD_U8LE, 1},
                                              {"bytes", H5T_STD_I64LE, 1},
                                              {"mtime_ns", H5T_STD_I64LE, 1},
                                              {"rows", H5T_STD_I64LE, 1},
                                              {"labels", H5T_STD_I32LE, 1}},
                                             {{"format", H5T_C_S1, 0},
                                              {"sample_shape", H5T_STD_I64LE, 1},
                                              {"num_classes", H5T_STD_I64LE, 1},
                                              {"class_names", H5T_C_S1, 1},
                                              {"mean", H5T_IEEE_F64LE, 1},
                                              {"std", H5T_IEEE_F64LE, 1}},
                                             {"dtrain shard index 1", "shard-00000.h5", "a", "b"}};
  fuzz::write_file(index, {reinterpret_cast<const uint8_t*>(set.index.data()), set.index.size()});
  FuzzedDataProvider in(data + 1, size - 1);
  {
    auto lock = data::h5::lock();
    data::h5::Handle file = data::h5::file(H5Fopen(index.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!file.valid()) fuzz::fail("cannot reopen " + index.string());
    fuzz::add_h5_objects(in, file.get(), vocabulary, 4, false);
  }
#else
  fuzz::write_file(index, {data + 1, size - 1});
#endif
  read_dataset(set.dir);
  return 0;
}

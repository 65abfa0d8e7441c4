// Fuzz target: ShardedHdf5Dataset over a directory of shards (shard-00000.h5, shard-00001.h5, ...).
// fuzz_shard: each part of the input is one shard file. fuzz_shard_h5: the input is a recipe of up
// to three shards built by HDF5's writer (fuzz_h5.h). A dataset that opens must read its first,
// middle and last samples and give labels inside [0, num_classes); inputs of odd length (a recipe:
// its choice) are read without the whole-shard cache (hyperslabs of the requested rows).
#include <cstdio>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/dataset.h"
#include "fuzz_util.h"
#ifdef DTRAIN_FUZZ_H5_RECIPE
#include "fuzz_h5.h"
#endif

using namespace dtrain;

namespace {

fuzz::fs::path shard_path(const fuzz::fs::path& dir, size_t i) {
  char name[32];
  std::snprintf(name, sizeof name, "shard-%05zu.h5", i);
  return dir / name;
}

void read_shards(const fuzz::fs::path& dir, bool cached) {
  try {
    data::DatasetOptions opt;
    opt.cache_bytes = cached ? int64_t(1) << 20 : 0;
    data::ShardedHdf5Dataset ds(dir.string(), opt);
    const int64_t n = ds.size();
    fuzz::read_checking_labels(ds, {n - 1, 0, n / 2, n - 1});
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  fuzz::expect_no_open_hdf5_objects("ShardedHdf5Dataset");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path dir = fuzz::fresh_scratch() / "shards";
#ifdef DTRAIN_FUZZ_H5_RECIPE
  static const fuzz::H5Vocabulary vocabulary{{{"inputs", H5T_STD_U8LE, 4}, {"labels", H5T_STD_I32LE, 1}},
                                             {{"format", H5T_C_S1, 0},
                                              {"sample_shape", H5T_STD_I64LE, 1},
                                              {"dtype", H5T_C_S1, 0},
                                              {"num_classes", H5T_STD_I64LE, 0},
                                              {"mean", H5T_IEEE_F64LE, 1},
                                              {"std", H5T_IEEE_F64LE, 1},
                                              {"class_names", H5T_C_S1, 1}},
                                             {"dtrain-shards-1", "u8", "i32", "f32"}};
  FuzzedDataProvider in(data, size);
  const bool cached = in.ConsumeBool();
  for (size_t i = 0, shards = in.ConsumeIntegralInRange(1, 3); i < shards; ++i)
    fuzz::write_h5_recipe(in, shard_path(dir, i), vocabulary, 6);
  read_shards(dir, cached);
#else
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  if (parts.size() > 8) return -1;
  for (size_t i = 0; i < parts.size(); ++i) fuzz::write_file(shard_path(dir, i), parts[i].bytes);
  read_shards(dir, size % 2 == 0);
#endif
  return 0;
}

// ShardedHdf5Dataset: validation messages, cached and uncached reads, concurrent reads.
#include <hdf5.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <thread>

#include "data_test_util.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/dataset.h"

namespace dtrain::data {
namespace {

using testing::expect_input_error;
using testing::TempDir;

// A converted synthetic set of `n` samples [1, h, w] in `dir`.
ImageSet make_dataset(const std::string& dir, int64_t n, int64_t h = 4, int64_t w = 3, int64_t shard = 10) {
  ImageSet set = testing::synthetic_set(n, 1, h, w, 5);
  ShardWriterOptions opt;
  opt.shard_size = shard;
  opt.chunk_rows = 3;
  write_shards(set, dir, opt);
  return set;
}

TEST(Dataset, MissingPath) {
  TempDir tmp;
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "does-not-exist"); }, {"does-not-exist", "does not exist"});
}

TEST(Dataset, EmptyDirectory) {
  TempDir tmp;
  fs::create_directories(tmp / "empty");
  std::ofstream(tmp / "empty/readme.txt") << "not a shard";
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "empty"); }, {"empty", "no .h5 shards"});
}

TEST(Dataset, GarbageFile) {
  TempDir tmp;
  make_dataset(tmp / "d", 20);
  std::ofstream(tmp / "d/shard-00009.h5") << std::string(5000, 'g');
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "d"); }, {"shard-00009.h5", "not an HDF5 file"});
}

TEST(Dataset, TruncatedShard) {
  TempDir tmp;
  make_dataset(tmp / "d", 30);
  const std::string victim = tmp / "d/shard-00001.h5";
  fs::resize_file(victim, fs::file_size(victim) / 2);
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "d"); }, {"shard-00001.h5"});
}

TEST(Dataset, MissingInputsDataset) {
  TempDir tmp;
  make_dataset(tmp / "d", 20);
  // A third shard holding only labels.
  hid_t f = H5Fcreate((tmp / "d/shard-00002.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hsize_t n = 4;
  int32_t labels[4] = {0, 1, 2, 3};
  hid_t sp = H5Screate_simple(1, &n, nullptr);
  hid_t d = H5Dcreate2(f, "labels", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels);
  H5Dclose(d);
  H5Sclose(sp);
  H5Fclose(f);
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "d"); }, {"shard-00002.h5", "'inputs'"});
}

TEST(Dataset, InconsistentShapesAcrossShards) {
  TempDir tmp;
  make_dataset(tmp / "a", 10, 4, 3);
  make_dataset(tmp / "b", 10, 5, 3);
  fs::copy_file(tmp / "b/shard-00000.h5", tmp / "a/shard-00001.h5");
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "a"); }, {"shard-00001.h5", "sample shape", "[1, 5, 3]"});
}

TEST(Dataset, LabelOutsideNumClasses) {
  TempDir tmp;
  make_dataset(tmp / "d", 10);
  hid_t f = H5Fopen((tmp / "d/shard-00000.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t a = H5Aopen(f, "num_classes", H5P_DEFAULT);
  int64_t two = 2;
  H5Awrite(a, H5T_NATIVE_INT64, &two);
  H5Aclose(a);
  H5Fclose(f);
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "d"); }, {"shard-00000.h5", "'labels'", "outside [0, 2)"});
}

// An attribute whose dataspace declares 2^61 + 291 elements: times 8 bytes that wraps to the 2328
// bytes the file stores, so HDF5 opens it, and its reader must not size a vector by the count.
TEST(Dataset, AttributeDeclaringMoreThanTheFile) {
  TempDir tmp;
  make_dataset(tmp / "d", 10);
  const std::string shard = tmp / "d/shard-00000.h5";
  hid_t f = H5Fopen(shard.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  H5Adelete(f, "num_classes");
  const hsize_t n = 0x123;
  const std::vector<int64_t> threes(n, 3);
  hid_t sp = H5Screate_simple(1, &n, nullptr);
  hid_t a = H5Acreate2(f, "num_classes", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, threes.data()), 0);
  H5Aclose(a);
  H5Sclose(sp);
  H5Fclose(f);

  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string dims("\x23\x01\0\0\0\0\0\0", 8);
  int patched = 0;
  for (size_t at = bytes.find(dims); at != std::string::npos; at = bytes.find(dims, at + 8), ++patched)
    bytes[at + 7] = '\x20';
  ASSERT_GE(patched, 1);
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  expect_input_error([&] { ShardedHdf5Dataset ds(tmp / "d"); },
                     {"shard-00000.h5", "attribute 'num_classes'", "2305843009213694243 element(s)", "corrupt"});
}

TEST(Dataset, SingleFileAndHiddenTemporariesIgnored) {
  TempDir tmp;
  ImageSet set = make_dataset(tmp / "d", 25);
  std::ofstream(tmp / "d/.shard-00005.h5.tmp-1") << "half written";
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "d").size(), 25);
  ShardedHdf5Dataset one(tmp / "d/shard-00002.h5");
  EXPECT_EQ(one.size(), 5);
  std::vector<uint8_t> px(12);
  int32_t label = -1;
  std::vector<int64_t> idx = {0};
  one.read(idx, px.data(), &label);
  EXPECT_TRUE(std::equal(px.begin(), px.end(), set.inputs.begin() + 20 * 12));
  EXPECT_EQ(label, set.labels[20]);
}

// Random reads with repeats, cached and uncached (coalesced hyperslabs), from several threads at once.
TEST(Dataset, CachedAndUncachedReadsAgreeAcrossThreads) {
  TempDir tmp;
  const int64_t n = 97, row = 12;
  ImageSet set = make_dataset(tmp / "d", n, 4, 3, 20);
  DatasetOptions uncached;
  uncached.cache_bytes = 0;
  DatasetOptions partial;
  partial.cache_bytes = 2 * 20 * row;  // room for two of the five shards
  ShardedHdf5Dataset a(tmp / "d"), b(tmp / "d", uncached), c(tmp / "d", partial);

  auto check = [&](const ShardedHdf5Dataset& ds, uint64_t seed) {
    Rng rng(seed);
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<int64_t> idx;
      for (int k = 0; k < 33; ++k) idx.push_back(static_cast<int64_t>(rng.below(n)));
      idx.push_back(idx.front());                          // a repeat
      for (int64_t r = 40; r < 46; ++r) idx.push_back(r);  // a contiguous run
      std::vector<uint8_t> px(idx.size() * row);
      std::vector<int32_t> lab(idx.size());
      ds.read(idx, px.data(), lab.data());
      for (size_t k = 0; k < idx.size(); ++k) {
        ASSERT_EQ(lab[k], set.labels[idx[k]]);
        ASSERT_TRUE(std::equal(px.begin() + k * row, px.begin() + (k + 1) * row, set.inputs.begin() + idx[k] * row))
            << "sample " << idx[k];
      }
    }
  };
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] { check(a, t); });
    threads.emplace_back([&, t] { check(b, 10 + t); });
    threads.emplace_back([&, t] { check(c, 20 + t); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(a.cached_bytes(), n * row);
  EXPECT_EQ(b.cached_bytes(), 0);
  EXPECT_EQ(c.cached_bytes(), 2 * 20 * row);
}

// The node-shared copy: rows of shards whose flag is up come from the shared block, the others are
// read per request from their files until the filler (read_whole_shard) has put them in place.
TEST(Dataset, SharedRowsServeShardsInPlaceAndReadTheRestPerRequest) {
  TempDir tmp;
  const int64_t n = 40, row = 12;
  const ImageSet set = make_dataset(tmp / "d", n);  // 4 shards of 10
  DatasetOptions uncached;
  uncached.cache_bytes = 0;
  ShardedHdf5Dataset ds(tmp / "d", uncached);
  std::vector<uint8_t> shared(static_cast<size_t>(n * row), 0xEE);  // not the files' bytes: where rows came from
  std::vector<std::atomic<uint32_t>> in_place(4);
  ds.use_shared_rows(shared.data(), in_place.data());
  ds.read_whole_shard(1, shared.data() + 10 * row);
  in_place[1].store(1, std::memory_order_release);
  in_place[3].store(1, std::memory_order_release);  // up, but its rows are still the marker

  const std::vector<int64_t> idx = {5, 15, 35, 25, 12};
  Tensor inputs, labels;
  const int64_t bytes_before = ds.bytes_read();
  ds.read(idx, inputs, labels);
  for (size_t k = 0; k < idx.size(); ++k) {
    const uint8_t* got = inputs.data<uint8_t>() + k * row;
    EXPECT_EQ(labels.data<int32_t>()[k], set.labels[idx[k]]);
    if (idx[k] >= 30)
      EXPECT_TRUE(std::all_of(got, got + row, [](uint8_t v) { return v == 0xEE; })) << "sample " << idx[k];
    else
      EXPECT_TRUE(std::equal(got, got + row, set.inputs.begin() + idx[k] * row)) << "sample " << idx[k];
  }
  EXPECT_EQ(ds.bytes_read() - bytes_before, 2 * row);  // samples 5 and 25, per request
  EXPECT_EQ(ds.whole_shard_reads(), 1);
}

}  // namespace
}  // namespace dtrain::data

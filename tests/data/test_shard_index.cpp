// The shard index: written by convert, used while it describes the folder, each shard opened on its
// first read; a stale or broken index is set aside with the reason, never trusted.
#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <thread>

#include "data_test_util.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/data/shard_index.h"

namespace dtrain::data {
namespace {

using testing::expect_input_error;
using testing::TempDir;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// 95 samples [1, 4, 3] in shards of 10, with class names and normalisation from the converter.
ImageSet make_dataset(const std::string& dir) {
  ImageSet set = testing::synthetic_set(95, 1, 4, 3, 5);
  set.class_names = {"a", "b", "c", "d", "e"};
  ShardWriterOptions opt;
  opt.shard_size = 10;
  opt.chunk_rows = 3;
  write_shards(set, dir, opt);
  return set;
}

// Overwrites `path` with as many garbage bytes as it holds and gives it back its modification time:
// a change the index cannot see.
void corrupt_keeping_size_and_time(const std::string& path) {
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << std::string(static_cast<size_t>(st.st_size), 'g');
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

void expect_same_reads(const ShardedHdf5Dataset& a, const ShardedHdf5Dataset& b) {
  std::vector<int64_t> all(static_cast<size_t>(a.size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>((i * 37) % all.size());
  Tensor ai, al, bi, bl;
  a.read(all, ai, al);
  b.read(all, bi, bl);
  EXPECT_EQ(0, std::memcmp(ai.data<uint8_t>(), bi.data<uint8_t>(), ai.nbytes()));
  EXPECT_EQ(0, std::memcmp(al.data<int32_t>(), bl.data<int32_t>(), al.nbytes()));
}

TEST(ShardIndex, ConvertWritesOneThatDescribesTheSetAsOpeningEveryShardDoes) {
  TempDir tmp;
  const ImageSet set = make_dataset(tmp / "d");
  ASSERT_TRUE(fs::exists(tmp / "d/shards.index"));
  fs::create_directories(tmp / "plain");
  for (const auto& e : fs::directory_iterator(tmp / "d"))
    if (e.path().extension() == ".h5") fs::copy_file(e.path(), tmp.path() / "plain" / e.path().filename());

  const ShardedHdf5Dataset indexed(tmp / "d"), plain(tmp / "plain");
  EXPECT_TRUE(has(indexed.info().opened, "10 shard(s) from shards.index, each opened on first use"))
      << indexed.info().opened;
  EXPECT_TRUE(has(plain.info().opened, "10 shard(s) opened at start (no shards.index)")) << plain.info().opened;
  const DatasetInfo &a = indexed.info(), &b = plain.info();
  EXPECT_EQ(a.shard_rows, b.shard_rows);
  EXPECT_EQ(a.sample_shape, b.sample_shape);
  EXPECT_EQ(a.num_samples, 95);
  EXPECT_EQ(a.num_classes, b.num_classes);
  EXPECT_EQ(a.class_names, set.class_names);
  EXPECT_EQ(a.mean, b.mean);
  EXPECT_EQ(a.std, b.std);
  EXPECT_TRUE(a.has_normalization && b.has_normalization);
  EXPECT_TRUE(std::equal(indexed.labels().begin(), indexed.labels().end(), set.labels.begin(), set.labels.end()));
  expect_same_reads(indexed, plain);
}

// With the index, a shard is opened on its first read: one broken behind the index's back fails
// that read, naming the shard, and no other.
TEST(ShardIndex, EachShardIsOpenedAndCheckedOnItsFirstRead) {
  TempDir tmp;
  const ImageSet set = make_dataset(tmp / "d");
  corrupt_keeping_size_and_time(tmp / "d/shard-00003.h5");
  DatasetOptions uncached;
  uncached.cache_bytes = 0;
  for (const DatasetOptions& opt : {DatasetOptions{}, uncached}) {
    const ShardedHdf5Dataset ds(tmp / "d", opt);
    EXPECT_TRUE(has(ds.info().opened, "from shards.index"));
    std::vector<int64_t> first = {0, 9, 12, 29, 40, 94};
    Tensor inputs, labels;
    ds.read(first, inputs, labels);
    for (size_t k = 0; k < first.size(); ++k) EXPECT_EQ(labels.data<int32_t>()[k], set.labels[first[k]]);
    std::vector<int64_t> in_shard_3 = {31};
    expect_input_error([&] { ds.read(in_shard_3, inputs, labels); }, {"shard-00003.h5", "not an HDF5 file"});
    std::vector<uint8_t> rows(10 * 12);
    expect_input_error([&] { ds.read_whole_shard(3, rows.data()); }, {"shard-00003.h5"});
  }
}

// Shards opened on first use from several threads at once, as a run does: loader threads reading
// batches of one dataset (cached and per request), a filler reading whole shards into a node copy,
// and the evaluation reading a second dataset over the same files. Every read gives the set's rows.
TEST(ShardIndex, ShardsOpenedFromManyThreadsAtOnce) {
  TempDir tmp;
  const ImageSet set = make_dataset(tmp / "d");
  const int64_t row = 12, n = set.size();
  for (int rep = 0; rep < 5; ++rep) {
    DatasetOptions small;
    small.cache_bytes = 3 * 10 * row;
    ShardedHdf5Dataset train(tmp / "d", small), test(tmp / "d");
    std::vector<uint8_t> shared(static_cast<size_t>(n * row));
    std::vector<std::atomic<uint32_t>> in_place(10);
    train.use_shared_rows(shared.data(), in_place.data());
    auto reader = [&](const ShardedHdf5Dataset& ds, uint64_t seed) {
      Rng rng(seed);
      for (int k = 0; k < 30; ++k) {
        std::vector<int64_t> idx;
        for (int j = 0; j < 7; ++j) idx.push_back(static_cast<int64_t>(rng.below(static_cast<uint64_t>(n))));
        Tensor inputs, labels;
        ds.read(idx, inputs, labels);
        for (size_t j = 0; j < idx.size(); ++j)
          ASSERT_TRUE(std::equal(inputs.data<uint8_t>() + j * row, inputs.data<uint8_t>() + (j + 1) * row,
                                 set.inputs.begin() + idx[j] * row));
      }
    };
    std::vector<std::thread> threads;
    threads.emplace_back([&] {
      for (size_t s = 0; s < 10; ++s) {
        train.read_whole_shard(s, shared.data() + s * 10 * row);
        in_place[s].store(1, std::memory_order_release);
      }
    });
    for (uint64_t t = 0; t < 3; ++t) threads.emplace_back([&, t] { reader(train, 100 * rep + t); });
    threads.emplace_back([&] { reader(test, 100 * rep + 50); });
    for (auto& t : threads) t.join();
  }
}

// A valid shard of another shape behind the index's back (padded to the old size, its time given
// back): every read of it fails naming it, the second as the first (a failed open leaves it
// unopened, never half-opened and trusted).
TEST(ShardIndex, AShardOfAnotherShapeFailsEveryRead) {
  TempDir tmp;
  make_dataset(tmp / "d");
  ImageSet narrow = testing::synthetic_set(10, 1, 4, 2, 5);
  write_shards(narrow, tmp / "narrow");
  const std::string victim = tmp / "d/shard-00003.h5";
  struct stat st {};
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  ASSERT_LT(fs::file_size(tmp / "narrow/shard-00000.h5"), static_cast<uintmax_t>(st.st_size));
  fs::copy_file(tmp / "narrow/shard-00000.h5", victim, fs::copy_options::overwrite_existing);
  fs::resize_file(victim, static_cast<uintmax_t>(st.st_size));
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, victim.c_str(), times, 0), 0);
  DatasetOptions uncached;
  uncached.cache_bytes = 0;
  const ShardedHdf5Dataset ds(tmp / "d", uncached);
  ASSERT_TRUE(has(ds.info().opened, "from shards.index"));
  std::vector<int64_t> in_shard_3 = {33};
  Tensor inputs, labels;
  for (int attempt = 0; attempt < 2; ++attempt)
    expect_input_error([&] { ds.read(in_shard_3, inputs, labels); },
                       {"shard-00003.h5", "holds inputs of shape [10, 1, 4, 2]", "says [10, 1, 4, 3]"});
}

TEST(ShardIndex, AStaleOrBrokenIndexIsSetAsideWithTheReason) {
  TempDir tmp;
  make_dataset(tmp / "d");
  const std::string dir = tmp / "d";
  auto opened = [&] { return ShardedHdf5Dataset(dir).info().opened; };

  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / "d/shard-00002.h5").c_str(), nullptr, 0), 0);  // touched
  std::string why = opened();
  EXPECT_TRUE(has(why, "opened at start") && has(why, "out of date") && has(why, "shard-00002.h5") &&
              has(why, "changed") && has(why, "dtrain convert index " + dir))
      << why;

  EXPECT_EQ(write_shard_index(dir), 10);
  EXPECT_TRUE(has(opened(), "from shards.index"));

  fs::remove(tmp / "d/shard-00009.h5");
  why = opened();
  EXPECT_TRUE(has(why, "lists 10 shard(s), the folder holds 9")) << why;

  EXPECT_EQ(write_shard_index(dir), 9);
  fs::rename(tmp / "d/shard-00008.h5", tmp / "d/shard-00008b.h5");
  why = opened();
  EXPECT_TRUE(has(why, "shard-00008b.h5' is not in it")) << why;

  std::ofstream(tmp / "d/shards.index", std::ios::trunc) << "not an index";
  why = opened();
  EXPECT_TRUE(has(why, "opened at start") && has(why, "shards.index") && has(why, "rewrites it")) << why;
  EXPECT_EQ(ShardedHdf5Dataset(dir).size(), 90);
}

TEST(ShardIndex, WritingOneChecksEveryShard) {
  TempDir tmp;
  make_dataset(tmp / "d");
  std::ofstream(tmp / "d/shard-00004.h5", std::ios::trunc) << "garbage";
  expect_input_error([&] { write_shard_index(tmp / "d"); }, {"shard-00004.h5", "not an HDF5 file"});
  EXPECT_FALSE(fs::exists(tmp / "d/shards.index"));
  expect_input_error([&] { write_shard_index(tmp / "nowhere"); }, {"nowhere", "not a folder of shards"});
}

// Edits the index of `dir` in place through HDF5 (a crafted index): `edit` gets the open file.
void edit_index(const std::string& dir, const std::function<void(hid_t)>& edit) {
  auto lock = h5::lock();
  h5::Handle f = h5::file(H5Fopen((dir + "/shards.index").c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  ASSERT_TRUE(f.valid());
  edit(f.get());
}

// Sizes a run derives from the index (a row's bytes, a shard's, their sums) are overflow-checked and
// bounded by the shards' files the index records, so a crafted index cannot ask for terabytes.
TEST(ShardIndex, SizesItStatesAreBoundedByTheShardsFiles) {
  TempDir tmp;
  make_dataset(tmp / "d");
  const std::string dir = tmp / "d";
  auto opened = [&] { return ShardedHdf5Dataset(dir).info().opened; };
  auto with_shape = [&](std::vector<int64_t> shape) {
    edit_index(dir, [&](hid_t f) { ASSERT_TRUE(h5::write_attr_i64(f, "sample_shape", shape)); });
  };
  with_shape({int64_t{1} << 40, int64_t{1} << 40, 1});
  std::string why = opened();
  EXPECT_TRUE(has(why,
                  "shards.index': attribute sample_shape: shape [1099511627776, 1099511627776, 1] has more "
                  "than 2^63 elements"))
      << why;
  with_shape({1, 4, int64_t{1} << 30});  // 10 rows of 4 GiB in a shard of a few KiB
  why = opened();
  EXPECT_TRUE(has(why, "gives shard 'shard-00000.h5' 10 rows of [1, 4, 1073741824] bytes, more than its ")) << why;
  with_shape({1, -4, -3});
  EXPECT_TRUE(has(opened(), "no valid sample_shape"));
  with_shape({1, 4, 3});
  EXPECT_TRUE(has(opened(), "from shards.index"));

  // Row counts whose sum wraps around int64 to the number of labels.
  std::vector<int64_t> rows(10, 0);
  rows[0] = std::numeric_limits<int64_t>::max();
  rows[1] = std::numeric_limits<int64_t>::max();
  rows[2] = 97;  // 2 * (2^63 - 1) + 97 = 95 mod 2^64
  edit_index(dir, [&](hid_t f) {
    h5::Handle d = h5::dataset(H5Dopen2(f, "rows", H5P_DEFAULT));
    ASSERT_GE(H5Dwrite(d.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()), 0);
  });
  why = opened();
  EXPECT_TRUE(has(why, "gives shard 'shard-00000.h5' 9223372036854775807 rows, but holds 95 labels in all")) << why;
  EXPECT_EQ(ShardedHdf5Dataset(dir).size(), 95);
}

}  // namespace
}  // namespace dtrain::data

// Converters: idx and CIFAR-10 to HDF5 shards, read back byte for byte.
#include <hdf5.h>

#include <cmath>
#include <fstream>
#include <numeric>

#include "data_test_util.h"
#include "dtrain/data/dataset.h"

namespace dtrain::data {
namespace {

using testing::TempDir;

// Every file in `dir`, by name, sorted.
std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

int64_t scalar_attr(hid_t f, const char* name) {
  int64_t v = -1;
  hid_t a = H5Aopen(f, name, H5P_DEFAULT);
  EXPECT_GE(a, 0) << name;
  EXPECT_GE(H5Aread(a, H5T_NATIVE_INT64, &v), 0);
  H5Aclose(a);
  return v;
}

std::string string_attr(hid_t f, const char* name) {
  hid_t a = H5Aopen(f, name, H5P_DEFAULT);
  EXPECT_GE(a, 0) << name;
  hid_t t = H5Aget_type(a);
  std::string s(H5Tget_size(t), '\0');
  EXPECT_GE(H5Aread(a, t, s.data()), 0);
  H5Tclose(t);
  H5Aclose(a);
  return s.substr(0, s.find('\0'));
}

TEST(Convert, IdxRoundTripThroughShards) {
  TempDir tmp;
  const int64_t n = 37, h = 5, w = 4;
  ImageSet want = testing::synthetic_set(n, 1, h, w, 7);
  std::vector<uint8_t> labels(want.labels.begin(), want.labels.end());
  // Images gzip-compressed, labels raw: both must be accepted.
  testing::write_idx(tmp / "img.gz", {uint32_t(n), uint32_t(h), uint32_t(w)}, want.inputs, true);
  testing::write_idx(tmp / "lab", {uint32_t(n)}, labels, false);

  ImageSet got = read_idx(tmp / "img.gz", tmp / "lab");
  EXPECT_EQ(got.sample_shape, (Shape{1, h, w}));
  EXPECT_EQ(got.inputs, want.inputs);
  EXPECT_EQ(got.labels, want.labels);

  ShardWriterOptions opt;
  opt.shard_size = 10;
  opt.chunk_rows = 4;
  opt.compress_level = 3;
  ConvertSummary sum = write_shards(got, tmp / "out", opt);
  EXPECT_EQ(sum.num_samples, n);
  EXPECT_EQ(sum.num_shards, 4);
  EXPECT_EQ(sum.num_classes, 7);
  EXPECT_EQ(files_in(tmp.path() / "out"),
            (std::vector<std::string>{"shard-00000.h5", "shard-00001.h5", "shard-00002.h5", "shard-00003.h5",
                                      "shards.index"}));

  // Mean and std against a direct two-pass computation.
  double mean = 0, var = 0;
  for (uint8_t v : want.inputs) mean += v / 255.0;
  mean /= static_cast<double>(want.inputs.size());
  for (uint8_t v : want.inputs) var += (v / 255.0 - mean) * (v / 255.0 - mean);
  const double sd = std::sqrt(var / static_cast<double>(want.inputs.size()));
  ASSERT_EQ(sum.mean.size(), 1u);
  EXPECT_NEAR(sum.mean[0], mean, 1e-9);
  EXPECT_NEAR(sum.std[0], sd, 1e-9);

  ShardedHdf5Dataset ds(tmp / "out");
  const DatasetInfo& info = ds.info();
  EXPECT_EQ(info.num_samples, n);
  EXPECT_EQ(info.sample_shape, (Shape{1, h, w}));
  EXPECT_EQ(info.num_classes, 7);
  EXPECT_TRUE(info.has_normalization);
  EXPECT_NEAR(info.mean[0], mean, 1e-6);
  EXPECT_NEAR(info.std[0], sd, 1e-6);
  EXPECT_EQ(info.shard_rows, (std::vector<int64_t>{10, 10, 10, 7}));

  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  Tensor inputs, lab;
  ds.read(all, inputs, lab);
  EXPECT_EQ(inputs.shape(), (Shape{n, 1, h, w}));
  EXPECT_EQ(std::vector<uint8_t>(inputs.data<uint8_t>(), inputs.data<uint8_t>() + inputs.numel()), want.inputs);
  EXPECT_EQ(std::vector<int32_t>(lab.data<int32_t>(), lab.data<int32_t>() + n), want.labels);

  // Attributes of one shard, through the plain HDF5 API.
  hid_t f = H5Fopen((tmp / "out/shard-00003.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  EXPECT_EQ(scalar_attr(f, "num_samples"), 7);
  EXPECT_EQ(scalar_attr(f, "shard_index"), 3);
  EXPECT_EQ(scalar_attr(f, "num_shards"), 4);
  EXPECT_EQ(scalar_attr(f, "total_samples"), n);
  EXPECT_EQ(scalar_attr(f, "first_sample"), 30);
  EXPECT_EQ(scalar_attr(f, "num_classes"), 7);
  EXPECT_EQ(string_attr(f, "dtype"), "u8");
  EXPECT_EQ(string_attr(f, "label_dtype"), "i32");
  EXPECT_NE(string_attr(f, "source").find("img.gz"), std::string::npos);
  hid_t d = H5Dopen2(f, "labels", H5P_DEFAULT);
  hid_t t = H5Dget_type(d);
  EXPECT_TRUE(H5Tequal(t, H5T_STD_I32LE) > 0);
  H5Tclose(t);
  H5Dclose(d);
  H5Fclose(f);
}

TEST(Convert, RewriteRemovesStaleShardsAndLeavesNoTemporaries) {
  TempDir tmp;
  ImageSet set = testing::synthetic_set(25, 1, 3, 3, 5);
  ShardWriterOptions opt;
  opt.shard_size = 10;
  write_shards(set, tmp / "out", opt);
  EXPECT_EQ(files_in(tmp.path() / "out").size(), 4u);  // 3 shards and their index
  opt.shard_size = 100;
  write_shards(set, tmp / "out", opt);
  EXPECT_EQ(files_in(tmp.path() / "out"), (std::vector<std::string>{"shard-00000.h5", "shards.index"}));
  EXPECT_NE(ShardedHdf5Dataset(tmp / "out").info().opened.find("1 shard(s) from shards.index"), std::string::npos);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "out").size(), 25);
}

TEST(Convert, IdxWrongMagicNamesTheFile) {
  TempDir tmp;
  testing::write_idx(tmp / "images.idx", {2, 2, 2}, std::vector<uint8_t>(8, 1), false, 0x00000801);
  testing::write_idx(tmp / "labels.idx", {2}, {0, 1}, false);
  testing::expect_input_error([&] { read_idx(tmp / "images.idx", tmp / "labels.idx"); }, {"images.idx", "magic"});
  // A gzip label file given as the images: also a magic-number error.
  testing::write_idx(tmp / "labels-as-images.gz", {2}, {0, 1}, true);
  testing::expect_input_error([&] { read_idx(tmp / "labels-as-images.gz", tmp / "labels.idx"); },
                              {"labels-as-images.gz", "magic"});
}

TEST(Convert, IdxCountMismatchNamesBothFiles) {
  TempDir tmp;
  testing::write_idx(tmp / "imgs", {3, 2, 2}, std::vector<uint8_t>(12, 1), true);
  testing::write_idx(tmp / "labs", {2}, {0, 1}, true);
  testing::expect_input_error([&] { read_idx(tmp / "imgs", tmp / "labs"); }, {"imgs", "labs", "mismatch"});
}

TEST(Convert, IdxTruncatedAndMissingFiles) {
  TempDir tmp;
  testing::write_idx(tmp / "short", {3, 2, 2}, std::vector<uint8_t>(11, 1), false);
  testing::write_idx(tmp / "labs", {3}, {0, 1, 2}, false);
  testing::expect_input_error([&] { read_idx(tmp / "short", tmp / "labs"); }, {"short", "11 data bytes"});
  testing::expect_input_error([&] { read_idx(tmp / "nope", tmp / "labs"); }, {"nope"});
}

TEST(Convert, Cifar10Batches) {
  TempDir tmp;
  ImageSet want = testing::synthetic_set(5, 3, 32, 32, 10);
  auto write_batch = [&](const std::string& path, int64_t begin, int64_t end) {
    std::ofstream f(path, std::ios::binary);
    for (int64_t i = begin; i < end; ++i) {
      char label = static_cast<char>(want.labels[i]);
      f.write(&label, 1);
      f.write(reinterpret_cast<const char*>(want.inputs.data() + i * 3072), 3072);
    }
  };
  write_batch(tmp / "data_batch_1.bin", 0, 3);
  write_batch(tmp / "data_batch_2.bin", 3, 5);
  ImageSet got = read_cifar10({tmp / "data_batch_1.bin", tmp / "data_batch_2.bin"});
  EXPECT_EQ(got.sample_shape, (Shape{3, 32, 32}));
  EXPECT_EQ(got.num_classes, 10);
  EXPECT_EQ(got.inputs, want.inputs);
  EXPECT_EQ(got.labels, want.labels);
  ConvertSummary sum = write_shards(got, tmp / "out");
  EXPECT_EQ(sum.num_classes, 10);
  EXPECT_EQ(sum.mean.size(), 3u);
  ShardedHdf5Dataset ds(tmp / "out");
  EXPECT_EQ(ds.info().num_classes, 10);
  std::vector<uint8_t> buf(5 * 3072);
  std::vector<int32_t> lab(5);
  std::vector<int64_t> idx = {4, 0, 3, 1, 2};
  ds.read(idx, buf.data(), lab.data());
  for (size_t k = 0; k < idx.size(); ++k) {
    EXPECT_EQ(lab[k], want.labels[idx[k]]);
    EXPECT_TRUE(std::equal(buf.begin() + k * 3072, buf.begin() + (k + 1) * 3072, want.inputs.begin() + idx[k] * 3072));
  }

  std::ofstream(tmp / "bad.bin", std::ios::binary) << std::string(3073 + 5, 'x');
  testing::expect_input_error([&] { read_cifar10({tmp / "bad.bin"}); }, {"bad.bin", "3073"});
}

TEST(Convert, RealFashionMnistTestSplitReadableByH5py) {
  const std::string src = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(src + "/t10k-images-idx3-ubyte.gz")) GTEST_SKIP() << "Fashion-MNIST not installed at " << src;
  TempDir tmp;
  ImageSet set = read_idx(src + "/t10k-images-idx3-ubyte.gz", src + "/t10k-labels-idx1-ubyte.gz");
  ASSERT_EQ(set.size(), 10000);
  ShardWriterOptions opt;
  opt.shard_size = 4000;
  ConvertSummary sum = write_shards(set, tmp / "test", opt);
  EXPECT_EQ(sum.num_shards, 3);
  EXPECT_EQ(sum.num_classes, 10);
  // Fashion-MNIST's commonly quoted statistics: mean 0.286, std 0.353.
  EXPECT_NEAR(sum.mean[0], 0.286, 0.003);
  EXPECT_NEAR(sum.std[0], 0.353, 0.003);

  ShardedHdf5Dataset ds(tmp / "test");
  EXPECT_EQ(ds.size(), 10000);
  std::vector<int64_t> idx = {6789};
  std::vector<uint8_t> px(784);
  int32_t label = -1;
  ds.read(idx, px.data(), &label);
  const long ours = std::accumulate(px.begin(), px.end(), 0L);

  if (!testing::have_h5py()) GTEST_SKIP() << "/usr/bin/python3 with h5py not available";
  const std::string out = tmp / "h5py.txt";
  const std::string script =
      "import h5py, sys\n"
      "f = h5py.File(sys.argv[1] + '/shard-00001.h5', 'r')\n"
      "x = f['inputs']; y = f['labels']\n"
      "assert x.shape == (4000, 1, 28, 28) and x.dtype == 'uint8', (x.shape, x.dtype)\n"
      "assert y.shape == (4000,) and y.dtype == 'int32', (y.shape, y.dtype)\n"
      "assert int(f.attrs['num_classes']) == 10 and int(f.attrs['total_samples']) == 10000\n"
      "assert list(f.attrs['sample_shape']) == [1, 28, 28]\n"
      "open(sys.argv[2], 'w').write('%d %d' % (int(x[2789].astype('int64').sum()), int(y[2789])))\n";
  std::ofstream(tmp / "check.py") << script;
  const std::string cmd = "/usr/bin/python3 " + (tmp / "check.py") + " " + (tmp / "test") + " " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  long py_sum = -1, py_label = -1;
  std::ifstream(out) >> py_sum >> py_label;
  EXPECT_EQ(py_sum, ours);
  EXPECT_EQ(py_label, label);
}

}  // namespace
}  // namespace dtrain::data

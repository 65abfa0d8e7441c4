// The `dtrain convert` subcommand, run in-process.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "commands.h"
#include "data_test_util.h"
#include "dtrain/data/dataset.h"
#include "image_test_util.h"

namespace dtrain::data {
namespace {

using testing::TempDir;

// Runs cmd_convert with `args` (after "convert"), capturing stdout.
int run(std::vector<std::string> args, std::string* out = nullptr) {
  args.insert(args.begin(), "convert");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::ostringstream captured;
  std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
  int rc = -1;
  try {
    rc = cli::cmd_convert(static_cast<int>(argv.size()), argv.data());
  } catch (...) {
    std::cout.rdbuf(old);
    throw;
  }
  std::cout.rdbuf(old);
  if (out) *out = captured.str();
  return rc;
}

void write_pair(const TempDir& tmp, const std::string& prefix, int n) {
  ImageSet s = testing::synthetic_set(n, 1, 4, 4, 10);
  testing::write_idx(tmp / (prefix + "-images-idx3-ubyte.gz"), {uint32_t(n), 4, 4}, s.inputs, true);
  testing::write_idx(tmp / (prefix + "-labels-idx1-ubyte.gz"), {uint32_t(n)},
                     std::vector<uint8_t>(s.labels.begin(), s.labels.end()), true);
}

TEST(CmdConvert, HelpListsEveryOptionWithItsDefault) {
  std::string out;
  EXPECT_EQ(run({"--help"}, &out), 0);
  for (const char* opt : {"--images", "--labels", "--inputs", "--out", "--shard-size", "--chunk", "--compress",
                          "--source", "--num-classes", "idx", "cifar10", "fashion-mnist"})
    EXPECT_NE(out.find(opt), std::string::npos) << opt;
  EXPECT_NE(out.find("(=10000)"), std::string::npos) << out;
  EXPECT_EQ(run({"idx", "--help"}, &out), 0);
  EXPECT_NE(out.find("--shard-size"), std::string::npos);
}

TEST(CmdConvert, UnknownKindOrOptionAndMissingRequired) {
  testing::expect_input_error([] { run({"mnist-ish"}); }, {"mnist-ish"});
  testing::expect_input_error([] { run({"idx", "--bogus", "1"}); }, {"bogus"});
  testing::expect_input_error([] { run({"idx", "--images", "a"}); }, {"labels"});
  testing::expect_input_error([] { run({}); }, {"KIND"});
}

TEST(CmdConvert, TextKind) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "txt");
  std::ofstream(tmp / "txt/a.txt") << std::string(20000, 'q');
  std::string out;
  EXPECT_EQ(run({"text", "--inputs", tmp / "txt", "--out", tmp / "tok", "--val-fraction", "0.25"}, &out), 0);
  EXPECT_TRUE(std::filesystem::exists(tmp / "tok/train.h5"));
  EXPECT_TRUE(std::filesystem::exists(tmp / "tok/val.h5"));
  EXPECT_EQ(run({"text", "--help"}, &out), 0);
  EXPECT_NE(out.find("--val-fraction"), std::string::npos);
  testing::expect_input_error([] { run({"text", "--out", "x"}); }, {"inputs"});
}

TEST(CmdConvert, IdxAndFashionMnistKinds) {
  TempDir tmp;
  write_pair(tmp, "train", 30);
  write_pair(tmp, "t10k", 12);
  std::string out;
  EXPECT_EQ(run({"idx", "--images", tmp / "train-images-idx3-ubyte.gz", "--labels", tmp / "train-labels-idx1-ubyte.gz",
                 "--out", tmp / "idx", "--shard-size", "8", "--compress", "4"},
                &out),
            0);
  EXPECT_NE(out.find("30 samples"), std::string::npos) << out;
  EXPECT_NE(out.find("4 shard(s)"), std::string::npos) << out;
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "idx").size(), 30);

  EXPECT_EQ(run({"fashion-mnist", "--source", tmp.path().string(), "--out", tmp / "fm"}, &out), 0);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "fm/train").size(), 30);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "fm/test").size(), 12);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "fm/test").info().num_classes, 10);
  testing::expect_input_error(
      [&] {
        run({"fashion-mnist", "--source", tmp / "nowhere", "--out", tmp / "x"});
      },
      {"nowhere"});
}

// `convert index` writes the index of shards written without one (here: the index removed, a
// shard replaced), after which a run opens the folder from it; a folder that is no set is named.
TEST(CmdConvert, IndexKind) {
  TempDir tmp;
  write_pair(tmp, "train", 30);
  ASSERT_EQ(run({"idx", "--images", tmp / "train-images-idx3-ubyte.gz", "--labels", tmp / "train-labels-idx1-ubyte.gz",
                 "--out", tmp / "a", "--shard-size", "8"}),
            0);
  EXPECT_NE(ShardedHdf5Dataset(tmp / "a").info().opened.find("from shards.index"), std::string::npos);
  fs::copy(tmp / "a", tmp / "b");
  fs::remove(tmp / "b/shards.index");
  fs::copy_file(tmp / "a/shard-00000.h5", tmp / "a/shard-00001.h5", fs::copy_options::overwrite_existing);
  EXPECT_NE(ShardedHdf5Dataset(tmp / "a").info().opened.find("out of date"), std::string::npos);
  EXPECT_EQ(run({"index", tmp / "a", tmp / "b"}), 0);
  for (const char* dir : {"a", "b"}) {
    const ShardedHdf5Dataset ds(tmp / dir);
    EXPECT_NE(ds.info().opened.find("4 shard(s) from shards.index"), std::string::npos) << ds.info().opened;
    EXPECT_EQ(ds.size(), 30);
  }
  testing::expect_input_error([&] { run({"index", tmp / "train-images-idx3-ubyte.gz"}); }, {"not a folder of shards"});
  testing::expect_input_error([&] { run({"index"}); }, {"dirs"});
}

TEST(CmdConvert, ImagesKind) {
  TempDir tmp;
  std::string out;
  EXPECT_EQ(run({"images", "--help"}, &out), 0);
  for (const char* opt : {"--root", "--size", "--channels", "--val-fraction", "--strict", "--threads", "--shard-size"})
    EXPECT_NE(out.find(opt), std::string::npos) << opt;
  for (const char* name : {"cat", "dog"}) {
    fs::create_directories(tmp / ("pets/" + std::string(name)));
    for (int i = 0; i < 3; ++i)
      testing::write_png(tmp / ("pets/" + std::string(name) + "/" + std::to_string(i) + ".png"), 6, 4, 3,
                         testing::solid(6, 4, {uint8_t(40 * i), 90, 200}));
  }
  std::ofstream(tmp / "pets/dog/broken.jpg") << "broken";
  EXPECT_EQ(
      run({"images", "--root", tmp / "pets", "--size", "4", "--out", tmp / "out", "--val-fraction", "0.34"}, &out), 0);
  EXPECT_NE(out.find("2 classes (cat ... dog); 1 unreadable image(s) skipped; 0 other file(s) ignored"),
            std::string::npos)
      << out;
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "out/train").size() + ShardedHdf5Dataset(tmp / "out/val").size(), 6);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "out/val").info().class_names, (std::vector<std::string>{"cat", "dog"}));
  testing::expect_input_error([&] { run({"images", "--root", tmp / "pets", "--out", tmp / "x"}); }, {"size"});
  testing::expect_input_error(
      [&] {
        run({"images", "--root", tmp / "pets", "--size", "4", "--out", tmp / "x", "--strict"});
      },
      {"broken.jpg", "--strict"});
}

}  // namespace
}  // namespace dtrain::data

// Text to byte tokens: which files are read, the held-out split, and the training windows.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data_test_util.h"
#include "dtrain/core/error.h"
#include "dtrain/data/text.h"

namespace dtrain::data {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(Text, ConvertSkipsLinksAndBinaryFilesAndSplitsByBlocks) {
  TempDir tmp;
  std::string a(3000, 'a'), b(3000, 'b');
  write_file(tmp / "in/one.txt", a);
  write_file(tmp / "in/sub/two.txt", b);
  write_file(tmp / "in/index.dat", std::string("xx\0yy", 5));  // binary: skipped
  fs::create_symlink(tmp / "in/one.txt", tmp / "in/one.u8");   // a duplicate: skipped
  TextConvertOptions opt;
  opt.val_fraction = 0.3;
  opt.block_bytes = 500;
  TextConvertSummary s = convert_text({tmp / "in"}, tmp / "out", opt);
  EXPECT_EQ(s.files, 2);
  EXPECT_EQ(s.train_tokens + s.val_tokens, 6000);
  EXPECT_GT(s.val_tokens, 0);
  EXPECT_EQ(s.val_tokens % 500, 0);  // whole blocks
  TokenStream train = load_tokens(tmp / "out/train.h5"), val = load_tokens(tmp / "out/val.h5");
  EXPECT_EQ(static_cast<int64_t>(train.tokens.size()), s.train_tokens);
  EXPECT_EQ(static_cast<int64_t>(val.tokens.size()), s.val_tokens);
  EXPECT_EQ(train.vocab, 256);
  EXPECT_EQ(train.tokenizer, "bytes");
  for (int32_t t : train.tokens) EXPECT_TRUE(t == 'a' || t == 'b');
  // Same seed, same split.
  TextConvertSummary again = convert_text({tmp / "in"}, tmp / "out2", opt);
  EXPECT_EQ(again.val_tokens, s.val_tokens);
}

TEST(Text, WindowsAreShiftedTargets) {
  TokenStream s;
  for (int i = 0; i < 100; ++i) s.tokens.push_back(i);
  Rng rng(3);
  TokenBatch b = random_windows(s, 4, 10, rng);
  ASSERT_EQ(b.ids.shape(), (Shape{4, 10}));
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(b.targets.data<int32_t>()[i], b.ids.data<int32_t>()[i] + 1);
  EXPECT_EQ(window_count(s, 10), 9);  // 99 (input, target) pairs hold 9 whole windows
  TokenBatch q = sequential_windows(s, 2, 10, 3);
  EXPECT_EQ(q.ids.data<int32_t>()[0], 30);
  EXPECT_EQ(q.ids.data<int32_t>()[10], 40);
  EXPECT_EQ(q.targets.data<int32_t>()[19], 50);
}

TEST(Text, ErrorsNameTheInput) {
  TempDir tmp;
  testing::expect_input_error([&] { convert_text({tmp / "missing"}, tmp / "out"); }, {"missing"});
  testing::expect_input_error([&] { load_tokens(tmp / "none.h5"); }, {"none.h5"});
  write_file(tmp / "empty/e.txt", "");
  testing::expect_input_error([&] { convert_text({tmp / "empty"}, tmp / "out"); }, {"no bytes"});
}

}  // namespace
}  // namespace dtrain::data

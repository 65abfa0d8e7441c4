// GPT-2's byte-level BPE: a hand-computed case, equality with an independent encoder on real text,
// every byte string back from its ids, and the files' errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "data_test_util.h"
#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/text.h"
#include "dtrain/data/tokenizer.h"

namespace dtrain::data {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::TempDir;
using testing::write_file;

// GPT-2's stand-in for byte b, as UTF-8, written from its published definition.
std::string stand_in(int b) {
  static std::vector<int> others;
  if (others.empty())
    for (int c = 0; c < 256; ++c)
      if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174)) others.push_back(c);
  int cp = b;
  for (size_t k = 0; k < others.size(); ++k)
    if (others[k] == b) cp = 256 + static_cast<int>(k);
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A vocabulary of the 256 byte pieces (ids 0-255 in byte order) and `extra` pieces after them,
// written as raw UTF-8 JSON; and its merges.
void write_vocab(const std::string& dir, const std::vector<std::string>& extra, const std::string& merges) {
  std::string json = "{";
  for (int b = 0; b < 256; ++b) {
    std::string piece = stand_in(b);
    if (piece == "\"" || piece == "\\") piece = "\\" + piece;
    json += "\"" + piece + "\": " + std::to_string(b) + ", ";
  }
  for (size_t k = 0; k < extra.size(); ++k) json += "\"" + extra[k] + "\": " + std::to_string(256 + k) + ", ";
  json.resize(json.size() - 2);
  write_file(dir + "/vocab.json", json + "}");
  write_file(dir + "/merges.txt", "#version: 0.2\n" + merges);
}

TEST(ByteBpe, MergesByRankAsComputedByHand) {
  TempDir tmp;
  // 256 "ab", 257 "abc", 258 "bc", 259 "\u0120b" (space then b).
  write_vocab(tmp / "m",
              {"ab", "abc", "bc",
               "\xC4\xA0"
               "b"},
              "a b\nab c\nb c\n\xC4\xA0 b\n");
  const Tokenizer tok = Tokenizer::from_file(tmp / "m");
  EXPECT_EQ(tok.name(), kByteBpeTokenizer);
  EXPECT_EQ(tok.vocab(), 260);
  // "abc": a+b (rank 0) before b+c (rank 2), then ab+c (rank 1). " bca": space+b (rank 3) loses to
  // b+c (rank 2). "bb": no merge. "it's": the contraction is its own pre-token. "  x": the last space
  // goes with the letter.
  EXPECT_EQ(tok.encode("abc bca"), (std::vector<int32_t>{257, ' ', 258, 'a'}));
  EXPECT_EQ(tok.encode(" b bb"), (std::vector<int32_t>{259, 259, 'b'}));
  EXPECT_EQ(tok.encode("it's  x"), (std::vector<int32_t>{'i', 't', '\'', 's', ' ', ' ', 'x'}));
  EXPECT_EQ(tok.decode({257, 259, '\n'}), "abc b\n");
  EXPECT_EQ(tok.piece_text(259), " b");
}

// Scripts, digits, contractions and white space the pre-tokenizer must split as GPT-2's pattern does.
const std::string kSampler =
    "\nna\xC3\xAFve caf\xC3\xA9 \xCE\xB1\xCE\xB2\xCE\xB3 \xD0\xBC\xD0\xB8\xD1\x80 \xE6\x9D\xB1\xE4\xBA\xAC "
    "\xF0\x9F\x98\x80\xF0\x9F\x98\x80 x\xC2\xB2 abc123def 4,567.89 it's we'll THEY'RE I'd\n"
    "a   b\t\tc\r\n\n  d  \xE2\x80\x83 e\xC2\xA0"
    "f   ";

// The ids the independent encoder (tests/data/byte_bpe_reference.py) gives `text` under the
// vocabulary in `vocab_dir`, the text written to `work`/text.txt on the way.
std::vector<int32_t> reference_ids(const fs::path& vocab_dir, const std::string& text, const fs::path& work) {
  write_file(work / "text.txt", text);
  const std::string script = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/byte_bpe_reference.py";
  const std::string encode = "/usr/bin/python3 " + script + " encode " + vocab_dir.string() + " " +
                             (work / "text.txt").string() + " " + (work / "ids.txt").string();
  EXPECT_EQ(std::system(encode.c_str()), 0) << "python3-regex (scripts/install-deps.sh) runs: " << encode;
  std::vector<int32_t> ids;
  std::ifstream in(work / "ids.txt");
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

// A vocabulary learned by the independent encoder (tests/data/byte_bpe_reference.py, Python's
// `regex` module) on fortunes, and a text it encodes: other fortunes and a sampler of scripts,
// digits, contractions and white space.
class LearnedByteBpe : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    std::string train, text;
    for (const char* name : {"computers", "science", "law"})
      train += read_file(std::string("/usr/share/games/fortunes/") + name);
    text = read_file("/usr/share/games/fortunes/people");
    ASSERT_GT(train.size(), 100000u) << "the fortunes package (scripts/install-deps.sh) gives the text";
    text += kSampler;
    write_file(*dir_ / "train.txt", train);
    const std::string script = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/byte_bpe_reference.py";
    fs::create_directories(*dir_ / "gpt2");
    const std::string learn =
        "/usr/bin/python3 " + script + " learn " + (*dir_ / "train.txt") + " 600 " + (*dir_ / "gpt2");
    ASSERT_EQ(std::system(learn.c_str()), 0) << "python3-regex (scripts/install-deps.sh) runs: " << learn;
    want_ = new std::vector<int32_t>(reference_ids(*dir_ / "gpt2", text, dir_->path()));
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete want_;
  }
  static TempDir* dir_;
  static std::vector<int32_t>* want_;  // the independent encoder's ids of text.txt
};
TempDir* LearnedByteBpe::dir_ = nullptr;
std::vector<int32_t>* LearnedByteBpe::want_ = nullptr;

TEST_F(LearnedByteBpe, EqualsTheIndependentEncoderOnRealText) {
  const std::vector<int32_t>& want = *want_;
  const std::string text = read_file(*dir_ / "text.txt");
  const Tokenizer tok = Tokenizer::from_file(*dir_ / "gpt2/vocab.json");
  EXPECT_EQ(tok.vocab(), 256 + 600 + 1);
  ASSERT_GT(want.size(), 30000u);
  EXPECT_LT(want.size(), text.size() / 2) << "the merges shorten the text";
  EXPECT_EQ(tok.encode(text), want);
  EXPECT_EQ(tok.decode(want), text);

  // The tokenizer travels in the token files, and from them as its serialized model.
  TextConvertOptions opt;
  opt.tokenizer = *dir_ / "gpt2";
  opt.val_fraction = 0;
  convert_text({*dir_ / "text.txt"}, *dir_ / "out", opt);
  const TokenStream train = load_tokens(*dir_ / "out/train.h5");
  EXPECT_EQ(train.tokenizer.name(), kByteBpeTokenizer);
  EXPECT_EQ(train.vocab, 857);
  EXPECT_EQ(train.tokens, want);
  const Tokenizer again = Tokenizer::from_model(kByteBpeTokenizer, train.tokenizer.model(), "test");
  EXPECT_EQ(again.encode(text), want);
}

TEST_F(LearnedByteBpe, EveryByteStringComesBack) {
  const Tokenizer tok = Tokenizer::from_file(*dir_ / "gpt2");
  for (int a = 0; a < 256; ++a)
    for (int b = 0; b < 256; ++b) {
      const std::string s{static_cast<char>(a), static_cast<char>(b)};
      ASSERT_EQ(tok.decode(tok.encode(s)), s) << "bytes " << a << " " << b;
    }
  // Random strings: arbitrary bytes, and valid UTF-8 with stray bytes among it.
  const std::vector<std::string> parts = {
      "the", " ", "'s", "\xC3\xA9", "\xF0\x9F\x98\x80", "42", "\n", "\xC3", "\x80", "\xFF", "\xED\xA0\x80", "  ", "!?"};
  Rng rng(7);
  for (int trial = 0; trial < 4000; ++trial) {
    std::string s;
    const uint64_t length = rng.below(48);
    for (uint64_t k = 0; k < length; ++k) {
      if (trial % 2)
        s += static_cast<char>(rng.below(256));
      else
        s += parts[rng.below(parts.size())];
    }
    ASSERT_EQ(tok.decode(tok.encode(s)), s) << "trial " << trial;
  }
}

// GPT-2's own files (tests/data/gpt2/SOURCE.md): 50,257 pieces and 50,000 merges. Ids of strings
// GPT-2 is known to give, and every id of real text equal to the independent encoder's.
TEST(Gpt2Files, KnownIdsAndTheIndependentEncoderOnRealText) {
  const fs::path dir = fs::path(DTRAIN_SOURCE_DIR) / "tests/data/gpt2";
  const Tokenizer tok = Tokenizer::from_file(dir);
  EXPECT_EQ(tok.vocab(), 50257);
  EXPECT_EQ(tok.piece_text(50256), "<|endoftext|>");
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok.encode(" the quick brown fox"), (std::vector<int32_t>{262, 2068, 7586, 21831}));

  TempDir tmp;
  std::string text;
  for (const char* name : {"people", "computers", "science"})
    text += read_file(std::string("/usr/share/games/fortunes/") + name);
  text += kSampler;
  const std::vector<int32_t> want = reference_ids(dir, text, tmp.path());
  ASSERT_GT(want.size(), 100000u);
  EXPECT_LT(want.size(), text.size() / 3) << "50,000 merges shorten English text more than 3 times";
  EXPECT_EQ(tok.encode(text), want);
  EXPECT_EQ(tok.decode(want), text);
}

TEST(ByteBpe, BrokenFilesAreNamed) {
  TempDir tmp;
  write_vocab(tmp / "ok", {"ab"}, "a b\n");
  EXPECT_NO_THROW(Tokenizer::from_file(tmp / "ok/vocab.json"));

  write_vocab(tmp / "unknown", {"ab"}, "a b\nab q\n");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "unknown"); }, {"merges.txt", "line 3", "abq"});
  write_vocab(tmp / "bad_line", {"ab"}, "a b c\n");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "bad_line"); }, {"merges.txt", "line 2"});
  write_vocab(tmp / "repeat", {"ab"}, "a b\na b\n");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "repeat"); }, {"merges.txt", "line 3", "repeats"});
  write_vocab(tmp / "no_merges", {"ab"}, "");
  fs::remove(tmp / "no_merges/merges.txt");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "no_merges"); }, {"merges.txt"});
  write_file(tmp / "not_json/vocab.json", "{\"a\": 0,");
  write_file(tmp / "not_json/merges.txt", "");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "not_json"); }, {"vocab.json", "not JSON"});
  write_file(tmp / "deep/vocab.json", std::string(100000, '[') + std::string(100000, ']'));
  write_file(tmp / "deep/merges.txt", "");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "deep"); }, {"vocab.json", "deeper than 64 levels"});
  write_file(tmp / "no_bytes/vocab.json", "{\"a\": 0, \"b\": 1}");
  write_file(tmp / "no_bytes/merges.txt", "");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "no_bytes"); }, {"vocab.json", "no piece for byte"});
  write_file(tmp / "ids/vocab.json", "{\"a\": 0, \"b\": 5}");
  write_file(tmp / "ids/merges.txt", "");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "ids"); }, {"vocab.json", "'b'", "each once"});
  fs::create_directories(tmp / "empty");
  testing::expect_input_error([&] { Tokenizer::from_file(tmp / "empty"); }, {"empty", "tokenizer.model", "vocab.json"});
  testing::expect_input_error([&] { Tokenizer::from_model(kByteBpeTokenizer, "{}", "x.h5"); }, {"x.h5", "merges"});
}

}  // namespace
}  // namespace dtrain::data

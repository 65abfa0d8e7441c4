// Text to tokens (bytes, BPE): which files are read, the held-out split, the tokenizers, the windows.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "data_test_util.h"
#include "dtrain/core/error.h"
#include "dtrain/data/text.h"
#include "dtrain/data/tokenizer.h"

namespace dtrain::data {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::write_file;

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
  EXPECT_EQ(train.tokenizer.name(), "bytes");
  for (int32_t t : train.tokens) EXPECT_TRUE(t == 'a' || t == 'b');
  // Same seed, same split.
  TextConvertSummary again = convert_text({tmp / "in"}, tmp / "out2", opt);
  EXPECT_EQ(again.val_tokens, s.val_tokens);
}

// English-like text with what a tokenizer may mangle: runs of spaces, tabs, leading spaces, empty
// lines, CRLF, UTF-8, and characters absent from the training text.
std::string awkward_text(int paragraphs) {
  std::string text;
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "caf\xC3\xA9", "na\xC3\xAFve"};
  for (int p = 0; p < paragraphs; ++p) {
    for (int w = 0; w < 40; ++w) {
      text += words[(p * 7 + w * 3) % 10];
      text += (w % 11 == 10) ? "\n" : (w % 7 == 6) ? "  " : (w % 13 == 12) ? "\t" : " ";
    }
    text += p % 3 == 0 ? "\r\n\n   indented\n" : "\n";
  }
  return text;
}

TEST(Tokenizer, BpeDecodesExactlyWhatItEncoded) {
  const std::string train = awkward_text(200);
  const Tokenizer bpe = Tokenizer::train_bpe(train, 340, 2);
  EXPECT_EQ(bpe.name(), kBpeTokenizer);
  EXPECT_EQ(bpe.vocab(), 340);
  const std::string unseen =
      " \xE2\x82\xAC{~}  \n\n\tthe quick  dog\n\xF0\x9F\x98\x80 end";  // euro sign, emoji: never seen
  for (const std::string& text : {train, unseen, std::string("\n"), std::string(" ")}) {
    const std::vector<int32_t> ids = bpe.encode(text);
    EXPECT_EQ(bpe.decode(ids), text);
    int64_t bytes = 0;
    for (int32_t id : ids) bytes += static_cast<int64_t>(bpe.piece_text(id).size());
    EXPECT_EQ(bytes, static_cast<int64_t>(text.size()));
  }
  EXPECT_LT(bpe.encode(train).size(), train.size() / 2) << "merges should shorten English-like text";
  // The model travels as bytes and comes back the same.
  const Tokenizer again = Tokenizer::from_model(kBpeTokenizer, bpe.model(), "test");
  EXPECT_EQ(again.encode(unseen), bpe.encode(unseen));
  testing::expect_input_error([&] { Tokenizer::from_model(kBpeTokenizer, "garbage", "x.h5"); },
                              {"x.h5", "does not load"});
  testing::expect_input_error([&] { Tokenizer::from_model("wordpiece", "", "x.h5"); }, {"x.h5", "wordpiece"});
  testing::expect_input_error([&] { Tokenizer::train_bpe(train, 100, 1); }, {"--vocab-size"});
}

// A model's own SentencePiece tokenizer (here one trained by the Python module with the Llama
// family's settings: BPE, byte fallback, identity normalisation, a dummy prefix) gives the ids the
// Python module gives on real text, decodes them back, and travels in the token files.
TEST(Tokenizer, PretrainedSentencePieceMatchesThePythonModule) {
  TempDir tmp;
  const std::string text_file = tmp / "text.txt", model = tmp / "sp";
  std::string text;
  {
    std::ifstream in("/usr/share/games/fortunes/computers");
    ASSERT_TRUE(in) << "the fortunes package (scripts/install-deps.sh) provides real text";
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  text = text.substr(0, 60000) + "\n\xE2\x82\xAC 5 \xF0\x9F\x98\x80 end";  // unseen: byte fallback
  write_file(text_file, text);
  const std::string script =
      "import sentencepiece as sp\n"
      "sp.SentencePieceTrainer.train(input='" +
      text_file + "', model_prefix='" + model +
      "', model_type='bpe', "
      "vocab_size=600, byte_fallback=True, character_coverage=1.0, normalization_rule_name='identity', "
      "remove_extra_whitespaces=False, minloglevel=2)\n"
      "p = sp.SentencePieceProcessor(model_file='" +
      model +
      ".model')\n"
      "open('" +
      model + ".ids', 'w').write(' '.join(map(str, p.encode(open('" + text_file + "', encoding='utf-8').read()))))\n";
  write_file(tmp / "make.py", script);
  ASSERT_EQ(std::system(("/usr/bin/python3 " + tmp / "make.py" + " > /dev/null 2>&1").c_str()), 0)
      << "python3-sentencepiece (scripts/install-deps.sh) trains and encodes: " << script;
  std::vector<int32_t> want;
  {
    std::ifstream in(model + ".ids");
    for (int32_t id; in >> id;) want.push_back(id);
  }
  const Tokenizer tok = Tokenizer::from_file(model + ".model");
  EXPECT_EQ(tok.name(), kSentencePieceTokenizer);
  EXPECT_EQ(tok.vocab(), 600);
  ASSERT_GT(want.size(), 1000u);
  EXPECT_EQ(tok.encode(text), want);
  EXPECT_EQ(tok.decode(want), text);

  TextConvertOptions opt;
  opt.tokenizer = model + ".model";
  convert_text({text_file}, tmp / "out", opt);
  const TokenStream train = load_tokens(tmp / "out/train.h5");
  EXPECT_EQ(train.tokenizer.name(), kSentencePieceTokenizer);
  EXPECT_EQ(train.vocab, 600);
  EXPECT_EQ(train.tokenizer.encode(text), want);
  opt.tokenizer = tmp / "missing.model";
  testing::expect_input_error([&] { convert_text({text_file}, tmp / "out2", opt); }, {"--tokenizer", "missing.model"});
  opt.tokenizer = text_file;  // a file that is no SentencePiece model
  testing::expect_input_error([&] { convert_text({text_file}, tmp / "out2", opt); }, {"text.txt", "does not load"});
  // Pieces SentencePiece's trie would end the process on (an empty one, one with a NUL byte):
  // refused with the piece's index. ModelProto field 1 holds a piece message, its field 1 the text.
  const std::string unk("\x0a\x07\x0a\x05<unk>", 9);
  testing::expect_input_error(
      [&] { Tokenizer::from_model(kSentencePieceTokenizer, unk + std::string("\x0a\x02\x0a\x00", 4), "e.model"); },
      {"e.model", "piece 1 is empty or holds a NUL byte"});
  testing::expect_input_error(
      [&] { Tokenizer::from_model(kSentencePieceTokenizer, std::string("\x0a\x03\x0a\x01\x00", 5) + unk, "n.model"); },
      {"n.model", "piece 0 is empty or holds a NUL byte"});
}

TEST(Text, BpeTokenFilesCarryTheirModel) {
  TempDir tmp;
  write_file(tmp / "in/a.txt", awkward_text(300));
  TextConvertOptions opt;
  opt.tokenizer = "bpe";
  opt.vocab_size = 320;
  opt.block_bytes = 1000;
  const TextConvertSummary s = convert_text({tmp / "in"}, tmp / "out", opt);
  EXPECT_EQ(s.vocab, 320);
  EXPECT_LT(s.train_tokens, s.train_bytes);
  const TokenStream train = load_tokens(tmp / "out/train.h5"), val = load_tokens(tmp / "out/val.h5");
  EXPECT_EQ(train.vocab, 320);
  EXPECT_EQ(train.tokenizer.model(), val.tokenizer.model());
  EXPECT_EQ(train.text_bytes, s.train_bytes);
  EXPECT_EQ(val.bytes_of(0, static_cast<int64_t>(val.tokens.size())), s.val_bytes);
  EXPECT_EQ(static_cast<int64_t>(val.tokens.size()), s.val_tokens);
  opt.vocab_size = 0;
  testing::expect_input_error([&] { convert_text({tmp / "in"}, tmp / "out2", opt); }, {"--vocab-size"});
  opt.tokenizer = "words";
  testing::expect_input_error([&] { convert_text({tmp / "in"}, tmp / "out2", opt); }, {"--tokenizer", "words"});
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

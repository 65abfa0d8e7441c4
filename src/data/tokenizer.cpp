#include "dtrain/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include "dtrain/core/error.h"
#include "dtrain/data/byte_bpe.h"

namespace dtrain::data {

namespace {

namespace fs = std::filesystem;

// Feeds the lines of a text to SentencePiece's trainer without copying them into a file.
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(std::string_view text) : text_(text) { next(); }
  bool done() const override { return done_; }
  void Next() override { next(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void next() {
    // Empty lines are no sentences; skip them.
    while (at_ < text_.size() && text_[at_] == '\n') ++at_;
    if (at_ >= text_.size()) {
      done_ = true;
      return;
    }
    size_t end = text_.find('\n', at_);
    if (end == std::string_view::npos) end = text_.size();
    line_.assign(text_.substr(at_, end - at_));
    at_ = end;
  }

  std::string_view text_;
  size_t at_ = 0;
  std::string line_;
  bool done_ = false;
};

// "<0x0A>" -> 10 for SentencePiece's byte pieces.
int byte_of_piece(const std::string& piece) {
  unsigned value = 0;
  return std::sscanf(piece.c_str(), "<0x%2X>", &value) == 1 ? static_cast<int>(value) : -1;
}

}  // namespace

// How one kind of tokenizer turns text into ids and back (ids are checked against the vocabulary
// before decode is called).
class TokenCodec {
 public:
  virtual ~TokenCodec() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids, const std::vector<std::string>& pieces) const {
    std::string text;
    for (int32_t id : ids) text += pieces[static_cast<size_t>(id)];
    return text;
  }
};

namespace {

class ByteCodec final : public TokenCodec {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    return {reinterpret_cast<const uint8_t*>(text.data()), reinterpret_cast<const uint8_t*>(text.data()) + text.size()};
  }
};

// A BPE model trained here: applied line by line, as it was trained; each newline is its byte piece.
class TrainedBpeCodec final : public TokenCodec {
 public:
  TrainedBpeCodec(std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp, int32_t newline)
      : sp_(std::move(sp)), newline_(newline) {}
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    std::vector<int> line_ids;
    for (size_t at = 0; at <= text.size();) {
      size_t end = text.find('\n', at);
      if (end == std::string_view::npos) end = text.size();
      if (end > at) {
        const auto status = sp_->Encode(text.substr(at, end - at), &line_ids);
        DT_CHECK(status.ok(), "SentencePiece could not encode a line: " << status.ToString());
        ids.insert(ids.end(), line_ids.begin(), line_ids.end());
      }
      if (end == text.size()) break;
      ids.push_back(newline_);
      at = end + 1;
    }
    return ids;
  }

 private:
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;
  int32_t newline_;
};

// A model's own SentencePiece model: the whole text, as the model's own users encode and decode it
// (its dummy prefix removed on decoding).
class SentencePieceCodec final : public TokenCodec {
 public:
  explicit SentencePieceCodec(std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp) : sp_(std::move(sp)) {}
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> all;
    const auto status = sp_->Encode(text, &all);
    DT_CHECK(status.ok(), "SentencePiece could not encode the text: " << status.ToString());
    return {all.begin(), all.end()};
  }
  std::string decode(const std::vector<int32_t>& ids, const std::vector<std::string>&) const override {
    std::string text;
    const auto status = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    DT_CHECK(status.ok(), "SentencePiece could not decode: " << status.ToString());
    return text;
  }

 private:
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;
};

class ByteBpeCodec final : public TokenCodec {
 public:
  explicit ByteBpeCodec(ByteLevelBpe bpe) : bpe_(std::move(bpe)) {}
  std::vector<int32_t> encode(std::string_view text) const override { return bpe_.encode(text); }

 private:
  ByteLevelBpe bpe_;
};

std::string read_file(const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  DT_INPUT_CHECK(in && fs::is_regular_file(path), what << " '" << path.string() << "' cannot be opened");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The pieces of a SentencePiece model as text (its space mark a space; byte pieces their byte), and
// the id of the newline's byte piece (-1 without one).
// Reads a protobuf varint at `at` of `b` (false past the end or past 10 bytes).
bool read_varint(std::string_view b, size_t& at, uint64_t& value) {
  value = 0;
  for (int shift = 0; shift < 70 && at < b.size(); shift += 7) {
    const auto byte = static_cast<uint8_t>(b[at++]);
    value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

// Skips the value of a field of wire type `wire` at `at`; false when it runs past `b` or the type
// is unknown. `length` receives a length-delimited field's size (its bytes then start at `at`).
bool skip_field(std::string_view b, size_t& at, uint64_t wire, uint64_t* length = nullptr) {
  uint64_t v = 0;
  switch (wire) {
    case 0:
      return read_varint(b, at, v);
    case 1:
    case 5:
      at += wire == 1 ? 8 : 4;
      return at <= b.size();
    case 2:
      if (!read_varint(b, at, v) || v > b.size() - at) return false;
      if (length) *length = v;
      at += static_cast<size_t>(v);
      return true;
    default:
      return false;
  }
}

// Index of the first piece (ModelProto field 1, a message whose string field 1 is the piece) that
// is empty or holds a NUL byte, or -1. SentencePiece's trie builder reads pieces as C strings and
// throws from a noexcept path on an empty one (the process ends), so such a model is refused
// before it is loaded; a text whose wire format breaks off is left to SentencePiece's own parser,
// which reports it.
int64_t first_empty_piece(std::string_view model) {
  size_t at = 0;
  int64_t index = 0;
  while (at < model.size()) {
    uint64_t key = 0, length = 0;
    if (!read_varint(model, at, key)) return -1;
    if (!skip_field(model, at, key & 7, &length)) return -1;
    if (key >> 3 != 1 || (key & 7) != 2) continue;
    const std::string_view piece_message = model.substr(at - length, length);
    bool named = false;
    for (size_t p = 0; p < piece_message.size();) {
      uint64_t k = 0, n = 0;
      if (!read_varint(piece_message, p, k) || !skip_field(piece_message, p, k & 7, &n)) return -1;
      if (k >> 3 == 1 && (k & 7) == 2)
        named = n > 0 && piece_message.substr(p - n, n).find('\0') == std::string_view::npos;
    }
    if (!named) return index;
    ++index;
  }
  return -1;
}

std::vector<std::string> sentencepiece_pieces(const sentencepiece::SentencePieceProcessor& sp, int32_t& newline,
                                              const std::string& where) {
  std::vector<std::string> pieces(static_cast<size_t>(sp.GetPieceSize()));
  newline = -1;
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's mark of a space
  for (int id = 0; id < sp.GetPieceSize(); ++id) {
    std::string& text = pieces[static_cast<size_t>(id)];
    if (sp.IsControl(id) || sp.IsUnknown(id)) continue;  // decode to nothing
    if (sp.IsByte(id)) {
      const int b = byte_of_piece(sp.IdToPiece(id));
      DT_INPUT_CHECK(b >= 0, "'" << where << "': byte piece " << id << " is '" << sp.IdToPiece(id) << "'");
      text.assign(1, static_cast<char>(b));
      if (b == '\n') newline = id;
      continue;
    }
    const std::string& piece = sp.IdToPiece(id);
    for (size_t i = 0; i < piece.size();) {
      const bool space = piece.compare(i, kSpace.size(), kSpace) == 0;
      text += space ? ' ' : piece[i];
      i += space ? kSpace.size() : 1;
    }
  }
  return pieces;
}

}  // namespace

Tokenizer::Tokenizer() : name_(kBytesTokenizer), codec_(std::make_shared<ByteCodec>()) {
  for (int b = 0; b < 256; ++b) pieces_.emplace_back(1, static_cast<char>(b));
}

Tokenizer Tokenizer::from_model(const std::string& name, const std::string& model, const std::string& where) {
  if (name == kBytesTokenizer) return Tokenizer();
  Tokenizer t;
  t.name_ = name;
  t.model_ = model;
  if (name == kByteBpeTokenizer) {
    const size_t cut = model.find('\0');
    DT_INPUT_CHECK(cut != std::string::npos, "'" << where << "': its " << name << " model lacks its merges");
    return byte_bpe(model.substr(0, cut), model.substr(cut + 1), where + " (vocab.json)", where + " (merges.txt)");
  }
  DT_INPUT_CHECK(name == kBpeTokenizer || name == kSentencePieceTokenizer,
                 "'" << where << "' uses tokenizer '" << name << "'; known are " << kBytesTokenizer << ", "
                     << kBpeTokenizer << ", " << kSentencePieceTokenizer << " and " << kByteBpeTokenizer);
  const int64_t empty = first_empty_piece(model);
  DT_INPUT_CHECK(empty < 0, "'" << where << "': its " << name << " model's piece " << empty
                                << " is empty or holds a NUL byte (corrupt file?)");
  auto sp = std::make_shared<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->LoadFromSerializedProto(model);
  DT_INPUT_CHECK(status.ok(), "'" << where << "': its " << name << " model does not load (" << status.ToString()
                                  << "; corrupt file?)");
  int32_t newline = -1;
  t.pieces_ = sentencepiece_pieces(*sp, newline, where);
  if (name == kSentencePieceTokenizer) {
    t.codec_ = std::make_shared<SentencePieceCodec>(std::move(sp));
    return t;
  }
  DT_INPUT_CHECK(newline >= 0, "'" << where << "': its " << kBpeTokenizer << " model has no byte piece for '\\n'");
  t.codec_ = std::make_shared<TrainedBpeCodec>(std::move(sp), newline);
  return t;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  DT_INPUT_CHECK(fs::exists(path), "tokenizer '" << path << "' does not exist");
  fs::path vocab = path;
  if (fs::is_directory(path)) {
    if (fs::exists(fs::path(path) / "tokenizer.model")) return from_file((fs::path(path) / "tokenizer.model").string());
    vocab = fs::path(path) / "vocab.json";
    DT_INPUT_CHECK(fs::exists(vocab), "tokenizer folder '" << path
                                                           << "' holds neither tokenizer.model (SentencePiece) nor "
                                                              "vocab.json and merges.txt (GPT-2's byte-level BPE)");
  }
  if (vocab.extension() == ".json") {
    const fs::path merges = vocab.parent_path() / "merges.txt";
    return byte_bpe(read_file(vocab, "tokenizer vocabulary"),
                    read_file(merges, "the merges of tokenizer '" + vocab.string() + "',"), vocab.string(),
                    merges.string());
  }
  return from_model(kSentencePieceTokenizer, read_file(path, "tokenizer"), path);
}
Tokenizer Tokenizer::byte_bpe(const std::string& vocab, const std::string& merges, const std::string& vocab_where,
                              const std::string& merges_where) {
  ByteLevelBpe bpe(vocab, merges, vocab_where, merges_where);
  Tokenizer t;
  t.name_ = kByteBpeTokenizer;
  t.model_ = vocab + '\0' + merges;
  t.pieces_ = bpe.pieces();
  t.codec_ = std::make_shared<ByteBpeCodec>(std::move(bpe));
  return t;
}

Tokenizer Tokenizer::train_bpe(std::string_view text, int vocab_size, int threads) {
  DT_INPUT_CHECK(vocab_size > 256 + 1,
                 "--vocab-size must exceed 257 (the 256 byte pieces and <unk>), got " << vocab_size);
  std::ostringstream args;
  args << "--model_type=bpe --vocab_size=" << vocab_size << " --byte_fallback=true --character_coverage=1.0"
       << " --normalization_rule_name=identity --add_dummy_prefix=false --remove_extra_whitespaces=false"
       << " --split_digits=false --bos_id=-1 --eos_id=-1 --pad_id=-1 --unk_id=0"
       << " --max_sentence_length=65536 --input_sentence_size=0 --num_threads=" << std::max(threads, 1)
       << " --minloglevel=2";
  LineIterator lines(text);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args.str(), &lines, &model);
  DT_INPUT_CHECK(status.ok(),
                 "training the BPE tokenizer (--vocab-size " << vocab_size << ") failed: " << status.ToString());
  return from_model(kBpeTokenizer, model, "the BPE model just trained");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const { return codec_->encode(text); }

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  for (int32_t id : ids) DT_CHECK(id >= 0 && id < vocab(), "token " << id << " outside the vocabulary of " << vocab());
  return codec_->decode(ids, pieces_);
}

}  // namespace dtrain::data

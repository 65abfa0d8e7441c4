#include "dtrain/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain::data {

namespace {

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

Tokenizer::Tokenizer() : name_(kBytesTokenizer) {
  for (int b = 0; b < 256; ++b) pieces_.emplace_back(1, static_cast<char>(b));
}

Tokenizer Tokenizer::from_model(const std::string& name, const std::string& model, const std::string& where) {
  if (name == kBytesTokenizer) return Tokenizer();
  DT_INPUT_CHECK(name == kBpeTokenizer || name == kSentencePieceTokenizer,
                 "'" << where << "' uses tokenizer '" << name << "'; known are " << kBytesTokenizer << ", "
                     << kBpeTokenizer << " and " << kSentencePieceTokenizer);
  auto sp = std::make_shared<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->LoadFromSerializedProto(model);
  DT_INPUT_CHECK(status.ok(), "'" << where << "': its " << kBpeTokenizer << " model does not load ("
                                  << status.ToString() << "; corrupt file?)");
  Tokenizer t;
  t.name_ = name;
  t.model_ = model;
  t.pieces_.assign(static_cast<size_t>(sp->GetPieceSize()), std::string());
  t.newline_ = -1;
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's mark of a space
  for (int id = 0; id < sp->GetPieceSize(); ++id) {
    std::string& text = t.pieces_[static_cast<size_t>(id)];
    if (sp->IsControl(id) || sp->IsUnknown(id)) continue;  // decode to nothing
    if (sp->IsByte(id)) {
      const int b = byte_of_piece(sp->IdToPiece(id));
      DT_INPUT_CHECK(b >= 0, "'" << where << "': byte piece " << id << " is '" << sp->IdToPiece(id) << "'");
      text.assign(1, static_cast<char>(b));
      if (b == '\n') t.newline_ = id;
      continue;
    }
    const std::string& piece = sp->IdToPiece(id);
    for (size_t i = 0; i < piece.size();) {
      const bool space = piece.compare(i, kSpace.size(), kSpace) == 0;
      text += space ? ' ' : piece[i];
      i += space ? kSpace.size() : 1;
    }
  }
  DT_INPUT_CHECK(t.newline_ >= 0 || name == kSentencePieceTokenizer,
                 "'" << where << "': its " << kBpeTokenizer << " model has no byte piece for '\\n'");
  t.sp_ = std::move(sp);
  return t;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DT_INPUT_CHECK(in, "tokenizer '" << path << "' cannot be opened");
  const std::string model((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return from_model(kSentencePieceTokenizer, model, path);
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

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  if (!sp_) {
    ids.assign(reinterpret_cast<const uint8_t*>(text.data()),
               reinterpret_cast<const uint8_t*>(text.data()) + text.size());
    return ids;
  }
  if (name_ == kSentencePieceTokenizer) {  // the whole text, as the model's own users encode it
    std::vector<int> all;
    const auto status = sp_->Encode(text, &all);
    DT_CHECK(status.ok(), "SentencePiece could not encode the text: " << status.ToString());
    return {all.begin(), all.end()};
  }
  // Line by line, as it was trained; each newline is its byte piece.
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

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  if (name_ == kSentencePieceTokenizer) {  // SentencePiece's own decoding (its dummy prefix removed)
    for (int32_t id : ids)
      DT_CHECK(id >= 0 && id < vocab(), "token " << id << " outside the vocabulary of " << vocab());
    const auto status = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    DT_CHECK(status.ok(), "SentencePiece could not decode: " << status.ToString());
    return text;
  }
  for (int32_t id : ids) {
    DT_CHECK(id >= 0 && id < vocab(), "token " << id << " outside the vocabulary of " << vocab());
    text += pieces_[static_cast<size_t>(id)];
  }
  return text;
}

}  // namespace dtrain::data

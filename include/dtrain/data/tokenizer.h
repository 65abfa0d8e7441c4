#pragma once
// The tokenizers of dtrain's language models: bytes (token = byte, vocabulary 256), a subword BPE
// model trained and applied by SentencePiece, and a model's own pretrained SentencePiece model. A BPE model travels as
// its serialized bytes inside the token files and the GPT's checkpoints, so generation and evaluation need nothing
// else.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace dtrain::data {

inline constexpr const char* kBytesTokenizer = "bytes";
inline constexpr const char* kBpeTokenizer = "sentencepiece-bpe";
// A pretrained SentencePiece model as a model family ships it (a Llama's tokenizer.model): applied
// to the whole text as SentencePiece's own encode does (its normalisation, its dummy prefix).
inline constexpr const char* kSentencePieceTokenizer = "sentencepiece";

class Tokenizer {
 public:
  Tokenizer();  // bytes
  // `name` is kBytesTokenizer (no model) or kBpeTokenizer with its serialized SentencePiece model.
  // Throws InputError naming `where` (a file) for an unknown name or a model that does not load.
  static Tokenizer from_model(const std::string& name, const std::string& model, const std::string& where);
  // A model's own tokenizer from its file: a SentencePiece model (tokenizer.model). InputError
  // naming the file when it is missing or does not load.
  static Tokenizer from_file(const std::string& path);
  // Trains a BPE model of `vocab_size` pieces on `text` (its lines are SentencePiece's sentences)
  // on `threads` threads: every character of the text is kept (character coverage 1), bytes the
  // model has not seen fall back to byte pieces, and the text is not normalised, so decoding gives
  // back exactly the bytes encoded.
  static Tokenizer train_bpe(std::string_view text, int vocab_size, int threads);

  const std::string& name() const { return name_; }
  const std::string& model() const { return model_; }  // empty for bytes
  int64_t vocab() const { return static_cast<int64_t>(pieces_.size()); }
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  const std::string& piece_text(int32_t id) const {
    return pieces_[static_cast<size_t>(id)];
  }  // the bytes id stands for

 private:
  std::string name_, model_;
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;
  std::vector<std::string> pieces_;  // per id, the text it decodes to
  int32_t newline_ = '\n';           // the id of "\n" (a byte piece under BPE)
};

}  // namespace dtrain::data

#pragma once
// The tokenizers of dtrain's language models: bytes (token = byte, vocabulary 256), a subword BPE
// model trained and applied by SentencePiece, and a model's own pretrained tokenizer (a SentencePiece
// model as the Llama family ships it, or GPT-2's byte-level BPE). A tokenizer travels as its name and
// its serialized model inside the token files and the language models' checkpoints, so generation
// and evaluation need nothing else.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::data {

inline constexpr const char* kBytesTokenizer = "bytes";
inline constexpr const char* kBpeTokenizer = "sentencepiece-bpe";
// A pretrained SentencePiece model as a model family ships it (a Llama's tokenizer.model): applied
// to the whole text as SentencePiece's own encode does (its normalisation, its dummy prefix).
inline constexpr const char* kSentencePieceTokenizer = "sentencepiece";
// GPT-2's byte-level BPE (vocab.json and merges.txt; see byte_bpe.h). Its serialized model is the
// two files' contents joined by a NUL byte.
inline constexpr const char* kByteBpeTokenizer = "gpt2-bpe";

class TokenCodec;  // how one kind of tokenizer encodes and decodes (tokenizer.cpp)

class Tokenizer {
 public:
  Tokenizer();  // bytes
  // `name` is one of the kinds above, `model` its serialized model (empty for bytes).
  // Throws InputError naming `where` (a file) for an unknown name or a model that does not load.
  static Tokenizer from_model(const std::string& name, const std::string& model, const std::string& where);
  // A model's own tokenizer: a SentencePiece model (tokenizer.model), GPT-2's vocab.json (its
  // merges.txt beside it), or a folder holding either. InputError naming the path when it is missing
  // or does not load.
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
  static Tokenizer byte_bpe(const std::string& vocab, const std::string& merges, const std::string& vocab_where,
                            const std::string& merges_where);

  std::string name_, model_;
  std::shared_ptr<const TokenCodec> codec_;
  std::vector<std::string> pieces_;  // per id, the text it decodes to
};

}  // namespace dtrain::data

#pragma once
// Text as token streams for language models. `dtrain convert text` writes <out>/train.h5 and
// <out>/val.h5, each one HDF5 file with a 1-D dataset `tokens` (u8, u16 or i32: the narrowest that
// holds the vocabulary) and root attributes `tokenizer` ("bytes": token = byte, vocabulary 256;
// "sentencepiece-bpe": subword pieces, the serialized SentencePiece model in the u8 dataset
// `tokenizer_model`), `vocab`, `text_bytes` (the bytes of text the tokens encode) and `sources`
// (file count). The stream is small enough to be held in memory (fortunes: ~3 MB); batches are
// windows of T+1 tokens at random offsets.
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/rng.h"
#include "dtrain/core/tensor.h"
#include "dtrain/data/tokenizer.h"

namespace dtrain::data {

struct TextConvertOptions {
  double val_fraction = 0.1;   // share of blocks held out for validation
  int64_t block_bytes = 4096;  // the split is by whole blocks, so validation text is unseen text
  uint64_t seed = 1;
  std::string tokenizer = kBytesTokenizer;  // or "bpe": a SentencePiece BPE model trained on the training text
  int vocab_size = 0;                       // pieces of the BPE model
  int threads = 0;                          // BPE training threads (0: every core this process may use)
};

struct TextConvertSummary {
  int64_t files = 0, train_tokens = 0, val_tokens = 0, train_bytes = 0, val_bytes = 0, vocab = 0;
  std::string tokenizer;
};

// Reads every regular file in `inputs` (files, or directories walked recursively in sorted order,
// skipping symbolic links and binary files, i.e. those with a NUL byte) and writes <out_dir>/train.h5 and
// <out_dir>/val.h5. Throws InputError naming a missing input or an empty result.
TextConvertSummary convert_text(const std::vector<std::string>& inputs, const std::string& out_dir,
                                const TextConvertOptions& opt = {});

struct TokenStream {
  std::vector<int32_t> tokens;
  int64_t vocab = 256;
  Tokenizer tokenizer;     // bytes unless the file carries a model
  int64_t text_bytes = 0;  // bytes of text the tokens encode
  // Prompt/completion samples (convert_sft; empty for plain text): sample i is tokens
  // [sample_offsets[i], sample_offsets[i + 1]), and loss_mask[j] is 1 where token j belongs to a
  // completion (its prediction is trained), 0 in a prompt.
  std::vector<int64_t> sample_offsets;
  std::vector<uint8_t> loss_mask;

  // Bytes of text that tokens [first, first + count) stand for (bits per byte of a loss over them).
  int64_t bytes_of(int64_t first, int64_t count) const;
  bool has_samples() const { return !sample_offsets.empty(); }
  int64_t sample_count() const { return has_samples() ? static_cast<int64_t>(sample_offsets.size()) - 1 : 0; }
};

// Prompt/completion data for fine-tuning (`dtrain convert sft`): JSON lines, each a record
// {"prompt": "...", "completion": "..."} or {"messages": [{"role": "system"|"user"|"assistant",
// "content": "..."}, ...]}. A chat is rendered as "<|role|>\n" + content + "\n" per turn; the loss is
// taken on the assistant turns' content and newline only, and on a completion. Each record is one
// sample; records go to val.h5 with probability val_fraction (seeded), the rest to train.h5.
struct SftConvertOptions {
  double val_fraction = 0.1;
  uint64_t seed = 1;
  std::string tokenizer = kBytesTokenizer;  // or a model's tokenizer file (a SentencePiece tokenizer.model)
};
struct SftConvertSummary {
  int64_t records = 0, train_samples = 0, val_samples = 0, train_tokens = 0, completion_tokens = 0, vocab = 0;
  std::string tokenizer;
};
// Throws InputError naming the file and line of a record that is not one of the two forms.
SftConvertSummary convert_sft(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const SftConvertOptions& opt = {});

// Loads <path> (a file written by convert_text). Throws InputError naming the file when it is
// missing or not a token file.
TokenStream load_tokens(const std::string& path);

// A batch of B windows: ids [B, T] and targets [B, T] (the next token), both i32.
struct TokenBatch {
  Tensor ids, targets;
};

// Windows at offsets drawn from `rng` (training).
TokenBatch random_windows(const TokenStream& s, int64_t batch, int64_t t, Rng& rng);
// Window k of the evaluation pass: windows at offsets k*T, k*T + T, ... (consecutive, not
// overlapping) so an evaluation over all k covers the stream once. Returns the number of windows
// in the stream through `count` when not null.
TokenBatch sequential_windows(const TokenStream& s, int64_t batch, int64_t t, int64_t first_window,
                              int64_t* count = nullptr);
int64_t window_count(const TokenStream& s, int64_t t);
// Samples `samples` of a prompt/completion stream, one per window (padded, never packed: no window
// holds two samples, so none attends across a boundary; a sample longer than T + 1 tokens is cut):
// ids [B, T] (padding 0) and targets [B, T], -1 (no loss) where the target token is a prompt's or
// padding. `trained`, when given, counts the targets that are not -1.
TokenBatch sample_windows(const TokenStream& s, const std::vector<int64_t>& samples, int64_t t,
                          int64_t* trained = nullptr);

}  // namespace dtrain::data

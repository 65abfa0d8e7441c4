// Text conversion to HDF5 token files (bytes or BPE pieces) and the windows a language model trains on.
#include "dtrain/data/text.h"

#include <algorithm>
#include <boost/property_tree/ptree.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "dtrain/core/cores.h"
#include "dtrain/core/error.h"
#include "dtrain/core/json.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/hdf5_util.h"

namespace dtrain::data {

namespace fs = std::filesystem;

namespace {

// The narrowest HDF5 integer type that holds every token of a vocabulary.
hid_t token_type(int64_t vocab) { return vocab <= 256 ? H5T_STD_U8LE : vocab <= 65536 ? H5T_STD_U16LE : H5T_STD_I32LE; }

// Prompt/completion samples beside the tokens (convert_sft).
struct Samples {
  std::vector<int64_t> offsets;
  std::vector<uint8_t> mask;
};

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t text_bytes,
                      const Tokenizer& tokenizer, int64_t files, const Samples* samples = nullptr) {
  auto lock = h5::lock();
  std::string tmp = path + ".tmp";
  {
    h5::Handle file = h5::file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    DT_INPUT_CHECK(file.valid(), "cannot create '" << tmp << "'");
    auto write_1d = [&](const char* name, hid_t file_type, hid_t mem_type, size_t n, const void* data) {
      DT_CHECK(h5::write_1d(file.get(), name, file_type, mem_type, n, data),
               "writing " << name << " to " << tmp << ": " << h5::last_error());
    };
    write_1d("tokens", token_type(tokenizer.vocab()), H5T_NATIVE_INT32, tokens.size(), tokens.data());
    if (samples) {
      write_1d("sample_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, samples->offsets.size(), samples->offsets.data());
      write_1d("loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, samples->mask.size(), samples->mask.data());
    }
    if (!tokenizer.model().empty())
      write_1d("tokenizer_model", H5T_STD_U8LE, H5T_NATIVE_UINT8, tokenizer.model().size(), tokenizer.model().data());
    h5::write_attr_string(file.get(), "tokenizer", tokenizer.name());
    h5::write_attr_scalar_i64(file.get(), "vocab", tokenizer.vocab());
    h5::write_attr_scalar_i64(file.get(), "text_bytes", text_bytes);
    h5::write_attr_scalar_i64(file.get(), "sources", files);
  }
  fs::rename(tmp, path);
}

// --tokenizer: one of `kinds` (bytes, or bpe: a model trained later on the text) or a model's own
// tokenizer, a file or a folder.
Tokenizer given_tokenizer(const std::string& option, const std::string& kinds) {
  if (option == kBytesTokenizer || (option == "bpe" && kinds.find("bpe") != std::string::npos)) return Tokenizer();
  DT_INPUT_CHECK(fs::exists(option), "--tokenizer must be " << kinds
                                                            << " or a model's own tokenizer (a SentencePiece "
                                                               "tokenizer.model, GPT-2's vocab.json with merges.txt "
                                                               "beside it, or a folder holding them), got '"
                                                            << option << "', which does not exist");
  return Tokenizer::from_file(option);
}

}  // namespace

TextConvertSummary convert_text(const std::vector<std::string>& inputs, const std::string& out_dir,
                                const TextConvertOptions& opt) {
  DT_INPUT_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1, "--val-fraction must be in [0, 1)");
  DT_INPUT_CHECK(opt.block_bytes > 0, "--block-bytes must be positive");
  const Tokenizer given = given_tokenizer(opt.tokenizer, "bytes, bpe");  // before the text is read
  DT_INPUT_CHECK(opt.tokenizer == "bpe" || opt.vocab_size == 0,
                 "--vocab-size is for --tokenizer bpe (bytes have a vocabulary of 256)");
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    DT_INPUT_CHECK(fs::exists(in), "text input '" << in << "' does not exist");
    if (fs::is_directory(in)) {
      // Links inside a directory are skipped: they duplicate files (fortunes' *.u8 links).
      for (const auto& e : fs::recursive_directory_iterator(in))
        if (e.is_regular_file() && !e.is_symlink()) files.push_back(e.path());
    } else {
      files.push_back(in);
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<uint8_t> all;
  int64_t used = 0;
  for (const fs::path& f : files) {
    std::ifstream is(f, std::ios::binary);
    DT_INPUT_CHECK(is, "cannot read '" << f.string() << "'");
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(is)), std::istreambuf_iterator<char>());
    // Binary files (a NUL byte: fortunes' *.dat indexes) are not text.
    if (std::find(bytes.begin(), bytes.end(), uint8_t{0}) != bytes.end()) continue;
    all.insert(all.end(), bytes.begin(), bytes.end());
    ++used;
  }
  DT_INPUT_CHECK(!all.empty(), "the text inputs hold no bytes");
  // Whole blocks go to one side, drawn from a seeded RNG, so the split is reproducible.
  std::vector<uint8_t> train, val;
  Rng rng(opt.seed);
  for (size_t off = 0; off < all.size(); off += static_cast<size_t>(opt.block_bytes)) {
    size_t end = std::min(all.size(), off + static_cast<size_t>(opt.block_bytes));
    auto& side = rng.uniform() < opt.val_fraction ? val : train;
    side.insert(side.end(), all.begin() + static_cast<std::ptrdiff_t>(off),
                all.begin() + static_cast<std::ptrdiff_t>(end));
  }
  if (opt.val_fraction > 0 && val.empty() && train.size() > 1) {  // tiny inputs: hold out the tail
    size_t cut = train.size() - std::max<size_t>(1, static_cast<size_t>(train.size() * opt.val_fraction));
    val.assign(train.begin() + static_cast<std::ptrdiff_t>(cut), train.end());
    train.resize(cut);
  }
  const std::string_view train_text(reinterpret_cast<const char*>(train.data()), train.size());
  const std::string_view val_text(reinterpret_cast<const char*>(val.data()), val.size());
  const Tokenizer tokenizer =
      opt.tokenizer == "bpe"
          ? Tokenizer::train_bpe(train_text, opt.vocab_size, opt.threads > 0 ? opt.threads : affinity_cores())
          : given;
  TextConvertSummary sum;
  sum.files = used;
  sum.tokenizer = tokenizer.name();
  sum.vocab = tokenizer.vocab();
  sum.train_bytes = static_cast<int64_t>(train.size());
  sum.val_bytes = static_cast<int64_t>(val.size());
  fs::create_directories(out_dir);
  const std::vector<int32_t> train_tokens = tokenizer.encode(train_text);
  const std::vector<int32_t> val_tokens = tokenizer.encode(val_text);
  sum.train_tokens = static_cast<int64_t>(train_tokens.size());
  sum.val_tokens = static_cast<int64_t>(val_tokens.size());
  write_token_file((fs::path(out_dir) / "train.h5").string(), train_tokens, sum.train_bytes, tokenizer, used);
  write_token_file((fs::path(out_dir) / "val.h5").string(), val_tokens, sum.val_bytes, tokenizer, used);
  return sum;
}

namespace {

// One record of prompt/completion data as text segments, each trained or not.
std::vector<std::pair<std::string, bool>> sft_segments(const std::string& line, const std::string& where) {
  namespace pt = boost::property_tree;
  const pt::ptree record = parse_json(line, where);
  const auto prompt = record.get_child_optional("prompt"), completion = record.get_child_optional("completion");
  const auto messages = record.get_child_optional("messages");
  DT_INPUT_CHECK((prompt && completion && !messages) || (messages && !prompt && !completion),
                 where << " must hold \"prompt\" and \"completion\", or \"messages\"");
  if (prompt) {
    DT_INPUT_CHECK(prompt->empty() && completion->empty() && !completion->data().empty(),
                   where << ": \"prompt\" and \"completion\" must be strings, the completion not empty");
    return {{prompt->data(), false}, {completion->data(), true}};
  }
  std::vector<std::pair<std::string, bool>> out;
  bool any = false;
  for (const auto& [key, turn] : *messages) {
    const auto role = turn.get_optional<std::string>("role"), content = turn.get_optional<std::string>("content");
    DT_INPUT_CHECK(key.empty() && role && content && (*role == "system" || *role == "user" || *role == "assistant"),
                   where << ": each message needs a role (system, user or assistant) and a content");
    const bool trained = *role == "assistant";
    out.push_back({"<|" + *role + "|>\n", false});
    out.push_back({*content + "\n", trained});
    any |= trained && !content->empty();
  }
  DT_INPUT_CHECK(any, where << ": no assistant turn with content to train on");
  return out;
}

}  // namespace

SftConvertSummary convert_sft(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const SftConvertOptions& opt) {
  DT_INPUT_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1, "--val-fraction must be in [0, 1)");
  DT_INPUT_CHECK(!inputs.empty(), "no input files");
  const Tokenizer tok = given_tokenizer(opt.tokenizer, "bytes");
  struct Split {
    std::vector<int32_t> tokens;
    Samples samples{{0}, {}};
    int64_t bytes = 0;
  } train, val;
  SftConvertSummary sum;
  Rng rng(opt.seed);
  for (const std::string& input : inputs) {
    std::ifstream in(input);
    DT_INPUT_CHECK(in, "'" << input << "' cannot be opened");
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines
      const auto segments = sft_segments(line, "'" + input + "' line " + std::to_string(n));
      Split& to = rng.uniform() < opt.val_fraction ? val : train;
      for (const auto& [text, trained] : segments) {
        const std::vector<int32_t> ids = tok.encode(text);
        to.tokens.insert(to.tokens.end(), ids.begin(), ids.end());
        to.samples.mask.insert(to.samples.mask.end(), ids.size(), trained ? 1 : 0);
        to.bytes += static_cast<int64_t>(text.size());
        if (&to == &train && trained) sum.completion_tokens += static_cast<int64_t>(ids.size());
      }
      to.samples.offsets.push_back(static_cast<int64_t>(to.tokens.size()));
      ++sum.records;
    }
  }
  sum.train_samples = static_cast<int64_t>(train.samples.offsets.size()) - 1;
  sum.val_samples = static_cast<int64_t>(val.samples.offsets.size()) - 1;
  DT_INPUT_CHECK(sum.train_samples > 0 && (opt.val_fraction == 0 || sum.val_samples > 0),
                 "the " << sum.records << " record(s) of the inputs leave " << sum.train_samples << " training and "
                        << sum.val_samples << " validation samples; both need one");
  if (sum.val_samples == 0) val = train;  // --val-fraction 0: validate on the training samples
  sum.train_tokens = static_cast<int64_t>(train.tokens.size());
  sum.vocab = tok.vocab();
  sum.tokenizer = tok.name();
  fs::create_directories(out_dir);
  write_token_file((fs::path(out_dir) / "train.h5").string(), train.tokens, train.bytes, tok,
                   static_cast<int64_t>(inputs.size()), &train.samples);
  write_token_file((fs::path(out_dir) / "val.h5").string(), val.tokens, val.bytes, tok,
                   static_cast<int64_t>(inputs.size()), &val.samples);
  return sum;
}

TokenStream load_tokens(const std::string& path) {
  DT_INPUT_CHECK(fs::exists(path), "token file '" << path << "' does not exist (make it with dtrain convert text)");
  auto lock = h5::lock();
  h5::Handle file = h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  DT_INPUT_CHECK(file.valid(), "'" << path << "' is not an HDF5 file");
  TokenStream s;
  std::string tokenizer;
  DT_INPUT_CHECK(h5::read_attr_string(file.get(), "tokenizer", tokenizer),
                 "'" << path << "' has no tokenizer attribute: not a token file from dtrain convert text");
  std::string model;
  if (tokenizer != kBytesTokenizer) {
    const std::vector<uint8_t> bytes = h5::read_1d<uint8_t>(file.get(), "tokenizer_model", H5T_NATIVE_UINT8, path);
    model.assign(bytes.begin(), bytes.end());
  }
  s.tokenizer = Tokenizer::from_model(tokenizer, model, path);
  s.vocab = s.tokenizer.vocab();
  std::vector<int64_t> vocab;
  DT_INPUT_CHECK(!h5::read_attr_i64(file.get(), "vocab", vocab) || (vocab.size() == 1 && vocab[0] == s.vocab),
                 "'" << path << "': attribute vocab disagrees with its " << tokenizer << " tokenizer's " << s.vocab);
  s.tokens = h5::read_1d<int32_t>(file.get(), "tokens", H5T_NATIVE_INT32, path);
  for (size_t i = 0; i < s.tokens.size(); ++i)
    DT_INPUT_CHECK(s.tokens[i] >= 0 && s.tokens[i] < s.vocab, "'" << path << "': token " << i << " is " << s.tokens[i]
                                                                  << ", outside the vocabulary [0, " << s.vocab << ")");
  std::vector<int64_t> text_bytes;
  s.text_bytes = h5::read_attr_i64(file.get(), "text_bytes", text_bytes) && text_bytes.size() == 1
                     ? text_bytes[0]
                     : s.bytes_of(0, static_cast<int64_t>(s.tokens.size()));
  DT_INPUT_CHECK(s.text_bytes >= 0, "'" << path << "': attribute text_bytes is " << s.text_bytes);
  if (H5Lexists(file.get(), "sample_offsets", H5P_DEFAULT) > 0) {  // prompt/completion samples
    s.sample_offsets = h5::read_1d<int64_t>(file.get(), "sample_offsets", H5T_NATIVE_INT64, path);
    s.loss_mask = h5::read_1d<uint8_t>(file.get(), "loss_mask", H5T_NATIVE_UINT8, path);
    const auto n = static_cast<int64_t>(s.tokens.size());
    DT_INPUT_CHECK(s.sample_offsets.size() >= 2 && s.sample_offsets.front() == 0 && s.sample_offsets.back() == n &&
                       std::is_sorted(s.sample_offsets.begin(), s.sample_offsets.end()),
                   "'" << path << "': sample_offsets must rise from 0 to the " << n << " tokens");
    DT_INPUT_CHECK(static_cast<int64_t>(s.loss_mask.size()) == n &&
                       std::all_of(s.loss_mask.begin(), s.loss_mask.end(), [](uint8_t m) { return m <= 1; }),
                   "'" << path << "': loss_mask must hold a 0 or 1 per token (" << n << ")");
  }
  return s;
}

int64_t TokenStream::bytes_of(int64_t first, int64_t count) const {
  DT_CHECK(first >= 0 && count >= 0 && first + count <= static_cast<int64_t>(tokens.size()),
           "tokens [" << first << ", " << first + count << ") of " << tokens.size());
  int64_t bytes = 0;
  for (int64_t i = first; i < first + count; ++i)
    bytes += static_cast<int64_t>(tokenizer.piece_text(tokens[static_cast<size_t>(i)]).size());
  return bytes;
}

namespace {
TokenBatch windows_at(const TokenStream& s, int64_t batch, int64_t t, const std::vector<int64_t>& offsets) {
  TokenBatch b{Tensor::empty({batch, t}, DType::I32), Tensor::empty({batch, t}, DType::I32)};
  int32_t* ids = b.ids.data<int32_t>();
  int32_t* tg = b.targets.data<int32_t>();
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < t; ++j) {
      ids[i * t + j] = s.tokens[static_cast<size_t>(offsets[static_cast<size_t>(i)] + j)];
      tg[i * t + j] = s.tokens[static_cast<size_t>(offsets[static_cast<size_t>(i)] + j + 1)];
    }
  return b;
}
}  // namespace

TokenBatch sample_windows(const TokenStream& s, const std::vector<int64_t>& samples, int64_t t, int64_t* trained) {
  const auto batch = static_cast<int64_t>(samples.size());
  TokenBatch b{Tensor::zeros({batch, t}, DType::I32), Tensor::empty({batch, t}, DType::I32)};
  int32_t* ids = b.ids.data<int32_t>();
  int32_t* tg = b.targets.data<int32_t>();
  std::fill(tg, tg + batch * t, -1);
  int64_t count = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t k = samples[static_cast<size_t>(i)];
    DT_CHECK(k >= 0 && k < s.sample_count(), "sample " << k << " of " << s.sample_count());
    const int64_t first = s.sample_offsets[static_cast<size_t>(k)], end = s.sample_offsets[static_cast<size_t>(k) + 1];
    const int64_t len = std::min(end - first, t + 1);
    for (int64_t j = 0; j < len; ++j) {
      const auto at = static_cast<size_t>(first + j);
      if (j < t) ids[i * t + j] = s.tokens[at];
      if (j > 0 && s.loss_mask[at]) {
        tg[i * t + j - 1] = s.tokens[at];
        ++count;
      }
    }
  }
  if (trained) *trained = count;
  return b;
}

int64_t window_count(const TokenStream& s, int64_t t) {
  int64_t n = static_cast<int64_t>(s.tokens.size());
  return n > t ? (n - 1) / t : 0;
}

TokenBatch random_windows(const TokenStream& s, int64_t batch, int64_t t, Rng& rng) {
  int64_t n = static_cast<int64_t>(s.tokens.size());
  DT_INPUT_CHECK(n > t, "the token stream (" << n << " tokens) is shorter than a window of " << t + 1);
  std::vector<int64_t> off(static_cast<size_t>(batch));
  for (auto& o : off) o = static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - t)));
  return windows_at(s, batch, t, off);
}

TokenBatch sequential_windows(const TokenStream& s, int64_t batch, int64_t t, int64_t first_window, int64_t* count) {
  int64_t windows = window_count(s, t);
  if (count) *count = windows;
  DT_CHECK(first_window + batch <= windows,
           "windows " << first_window << ".." << first_window + batch << " of " << windows);
  std::vector<int64_t> off(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) off[static_cast<size_t>(i)] = (first_window + i) * t;
  return windows_at(s, batch, t, off);
}

}  // namespace dtrain::data

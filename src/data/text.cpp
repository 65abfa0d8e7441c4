// Byte-level text conversion to HDF5 token files and the windows a language model trains on.
#include "dtrain/data/text.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dtrain/core/error.h"
#include "dtrain/data/hdf5_util.h"

namespace dtrain::data {

namespace fs = std::filesystem;

namespace {

void write_token_file(const std::string& path, const std::vector<uint8_t>& bytes, int64_t files) {
  auto lock = h5::lock();
  std::string tmp = path + ".tmp";
  {
    h5::Handle file = h5::file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    DT_INPUT_CHECK(file.valid(), "cannot create '" << tmp << "'");
    hsize_t n = bytes.size();
    h5::Handle space = h5::space(H5Screate_simple(1, &n, nullptr));
    h5::Handle ds = h5::dataset(
        H5Dcreate2(file.get(), "tokens", H5T_NATIVE_UINT8, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    DT_CHECK(ds.valid(), "creating dataset tokens in " << tmp << ": " << h5::last_error());
    DT_CHECK(H5Dwrite(ds.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()) >= 0,
             "writing tokens to " << tmp << ": " << h5::last_error());
    h5::write_attr_string(file.get(), "tokenizer", "bytes");
    h5::write_attr_scalar_i64(file.get(), "vocab", 256);
    h5::write_attr_scalar_i64(file.get(), "sources", files);
  }
  fs::rename(tmp, path);
}

}  // namespace

TextConvertSummary convert_text(const std::vector<std::string>& inputs, const std::string& out_dir,
                                const TextConvertOptions& opt) {
  DT_INPUT_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1, "--val-fraction must be in [0, 1)");
  DT_INPUT_CHECK(opt.block_bytes > 0, "--block-bytes must be positive");
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
  fs::create_directories(out_dir);
  write_token_file((fs::path(out_dir) / "train.h5").string(), train, used);
  write_token_file((fs::path(out_dir) / "val.h5").string(), val, used);
  return {used, static_cast<int64_t>(train.size()), static_cast<int64_t>(val.size())};
}

TokenStream load_tokens(const std::string& path) {
  DT_INPUT_CHECK(fs::exists(path), "token file '" << path << "' does not exist (make it with dtrain convert text)");
  auto lock = h5::lock();
  h5::Handle file = h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  DT_INPUT_CHECK(file.valid(), "'" << path << "' is not an HDF5 file");
  TokenStream s;
  DT_INPUT_CHECK(h5::read_attr_string(file.get(), "tokenizer", s.tokenizer),
                 "'" << path << "' has no tokenizer attribute: not a token file from dtrain convert text");
  DT_INPUT_CHECK(s.tokenizer == "bytes",
                 "'" << path << "' uses tokenizer '" << s.tokenizer << "'; only bytes is known");
  h5::Handle ds = h5::dataset(H5Dopen2(file.get(), "tokens", H5P_DEFAULT));
  DT_INPUT_CHECK(ds.valid(), "'" << path << "' has no dataset 'tokens'");
  const std::vector<int64_t> shape = h5::read_shape(ds.get(), 1, path, "tokens");
  DT_INPUT_CHECK(shape.size() == 1, "'" << path << "': tokens must be 1-D");
  const hsize_t n = static_cast<hsize_t>(shape[0]);
  std::vector<uint8_t> bytes(n);
  DT_INPUT_CHECK(n == 0 || H5Dread(ds.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()) >= 0,
                 "cannot read the tokens of '" << path << "': " << h5::last_error());
  s.tokens.assign(bytes.begin(), bytes.end());
  s.vocab = 256;
  return s;
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

// Fuzz target: `dtrain convert text`. Each part of the input is one text file of the input
// directory; the split options are picked by the input's length. convert_text must reject the
// inputs or write train.h5 and val.h5 that load_tokens reads back with the counts it reported,
// every byte of the text files without a NUL byte in one of them, and windows drawn from them.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/text.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  if (parts.size() > 4) return -1;
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  int64_t text_bytes = 0, text_files = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    fuzz::write_file(dir / "in" / ("part" + std::to_string(i) + ".txt"), parts[i].bytes);
    bool binary = false;
    for (uint8_t b : parts[i].bytes) binary = binary || b == 0;
    if (!binary) {
      text_bytes += static_cast<int64_t>(parts[i].bytes.size());
      ++text_files;
    }
  }
  data::TextConvertOptions opt;
  opt.val_fraction = (size % 4) * 0.3;
  opt.block_bytes = 1 + static_cast<int64_t>(size % 97);
  opt.seed = size;
  data::TextConvertSummary sum;
  try {
    sum = data::convert_text({(dir / "in").string()}, (dir / "out").string(), opt);
  } catch (const InputError& e) {
    fuzz::rejected(e);
    if (text_bytes > 0) fuzz::fail("convert_text refused " + std::to_string(text_bytes) + " bytes of text");
    return 0;
  }
  if (sum.files != text_files || sum.train_tokens + sum.val_tokens != text_bytes)
    fuzz::fail("convert_text reports " + std::to_string(sum.files) + " files and " +
               std::to_string(sum.train_tokens + sum.val_tokens) + " tokens for " + std::to_string(text_files) +
               " text files of " + std::to_string(text_bytes) + " bytes");
  const data::TokenStream train = data::load_tokens((dir / "out" / "train.h5").string());
  const data::TokenStream val = data::load_tokens((dir / "out" / "val.h5").string());
  if (static_cast<int64_t>(train.tokens.size()) != sum.train_tokens ||
      static_cast<int64_t>(val.tokens.size()) != sum.val_tokens)
    fuzz::fail("the token files hold other counts than convert_text reported");
  const int64_t t = 1 + static_cast<int64_t>(size % 7);
  if (data::window_count(train, t) > 0) {
    Rng rng(size);
    data::TokenBatch b = data::random_windows(train, 2, t, rng);
    data::TokenBatch q = data::sequential_windows(train, 1, t, data::window_count(train, t) - 1);
    if (b.ids.numel() != 2 * t || q.targets.numel() != t) fuzz::fail("windows of the wrong size");
  }
  fuzz::expect_no_open_hdf5_objects("convert_text and load_tokens");
  return 0;
}

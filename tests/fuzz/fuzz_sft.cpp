// Fuzz target: `dtrain convert sft`. Each part of the input is one JSON-lines file of records
// ({"prompt", "completion"} or {"messages": [...]}); the validation share is picked by the input's
// length. convert_sft must reject the input with an InputError or write train.h5 and val.h5 that
// load_tokens reads back as samples, with the counts it reported and one loss-mask byte a token,
// and windows of samples drawn from them.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/text.h"
#include "dtrain/kernels/engine.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  if (parts.size() > 3) return -1;
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  std::vector<std::string> inputs;
  for (size_t i = 0; i < parts.size(); ++i) {
    inputs.push_back((dir / ("part" + std::to_string(i) + ".jsonl")).string());
    fuzz::write_file(inputs.back(), parts[i].bytes);
  }
  data::SftConvertOptions opt;
  opt.val_fraction = (size % 3) * 0.25;
  opt.seed = size;
  data::SftConvertSummary sum;
  try {
    sum = data::convert_sft(inputs, (dir / "out").string(), opt);
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  const data::TokenStream train = data::load_tokens((dir / "out" / "train.h5").string());
  const data::TokenStream val = data::load_tokens((dir / "out" / "val.h5").string());
  if (train.sample_count() != sum.train_samples || static_cast<int64_t>(train.tokens.size()) != sum.train_tokens)
    fuzz::fail("the training file holds other counts than convert_sft reported");
  if (train.loss_mask.size() != train.tokens.size() || val.loss_mask.size() != val.tokens.size())
    fuzz::fail("a loss mask of another length than its tokens");
  if (train.sample_count() == 0) return 0;
  const int64_t t = 1 + static_cast<int64_t>(size % 9);
  int64_t scored = 0;
  const data::TokenBatch b = data::sample_windows(train, {0, train.sample_count() - 1}, t, &scored);
  if (b.ids.numel() != 2 * t || b.targets.numel() != 2 * t) fuzz::fail("sample windows of the wrong size");
  for (int64_t i = 0; i < b.targets.numel(); ++i) {
    const int32_t target = b.targets.data<int32_t>()[i];
    if (target != kIgnoreLabel && (target < 0 || target >= train.vocab)) fuzz::fail("a target outside the vocabulary");
  }
  fuzz::expect_no_open_hdf5_objects("convert_sft and load_tokens");
  return 0;
}

// Fuzz target: load_tokens, the language model's token-file reader (train.h5 / val.h5 of
// `dtrain convert text`). fuzz_tokens: the input is the file. fuzz_tokens_h5: the input is a recipe
// of the file built by HDF5's writer (fuzz_h5.h). A stream it accepts must hold tokens inside its
// vocabulary and give the windows the GPT task draws from it (and, for prompt/completion samples,
// each sample's window).
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/text.h"
#include "fuzz_util.h"
#ifdef DTRAIN_FUZZ_H5_RECIPE
#include "fuzz_h5.h"
#endif

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path file = fuzz::fresh_scratch() / "train.h5";
#ifdef DTRAIN_FUZZ_H5_RECIPE
  static const fuzz::H5Vocabulary vocabulary{{{"tokens", H5T_STD_U8LE, 1},
                                              {"tokenizer_model", H5T_STD_U8LE, 1},
                                              {"sample_offsets", H5T_STD_I64LE, 1},
                                              {"loss_mask", H5T_STD_U8LE, 1}},
                                             {{"tokenizer", H5T_C_S1, 0},
                                              {"vocab", H5T_STD_I64LE, 0},
                                              {"sources", H5T_STD_I64LE, 0},
                                              {"text_bytes", H5T_STD_I64LE, 0}},
                                             {"bytes", "bpe", "sentencepiece-bpe"}};
  FuzzedDataProvider in(data, size);
  fuzz::write_h5_recipe(in, file, vocabulary, 4);
#else
  fuzz::write_file(file, {data, size});
#endif
  try {
    const data::TokenStream s = data::load_tokens(file.string());
    for (int32_t tok : s.tokens)
      if (tok < 0 || tok >= s.vocab) fuzz::fail("token " + std::to_string(tok) + " outside the vocabulary");
    const int64_t t = 1 + static_cast<int64_t>(size % 5);
    if (s.has_samples()) {  // prompt/completion samples: each reads as a window
      int64_t trained = 0;
      for (int64_t k = 0; k < s.sample_count(); ++k) data::sample_windows(s, {k}, t, &trained);
    }
    if (data::window_count(s, t) > 0) {
      Rng rng(size);
      data::random_windows(s, 2, t, rng);
      data::sequential_windows(s, 1, t, 0);
    }
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  fuzz::expect_no_open_hdf5_objects("load_tokens");
  return 0;
}

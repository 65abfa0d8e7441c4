// Fuzz target: a pretrained SentencePiece model (a Llama's tokenizer.model) as
// `dtrain convert text --tokenizer FILE` and `convert sft` read it. The input is the model, then
// the part "text". The tokenizer must reject the model with an InputError, or encode the text to
// ids inside its vocabulary, decode them without failing, and load again from its serialized
// model to the same encoding.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/tokenizer.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  std::string text;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].tag != "text") return -1;
    text.assign(parts[i].bytes.begin(), parts[i].bytes.end());
  }
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  fuzz::write_file(dir / "tokenizer.model", parts[0].bytes);
  data::Tokenizer tok;
  try {
    tok = data::Tokenizer::from_file((dir / "tokenizer.model").string());
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  if (tok.vocab() <= 0) fuzz::fail("a loaded model of vocabulary " + std::to_string(tok.vocab()));
  const std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab()) fuzz::fail("an id outside the vocabulary: " + std::to_string(id));
  (void)tok.decode(ids);
  const data::Tokenizer again = data::Tokenizer::from_model(tok.name(), tok.model(), "fuzz");
  if (again.encode(text) != ids) fuzz::fail("the serialized model encodes otherwise");
  return 0;
}

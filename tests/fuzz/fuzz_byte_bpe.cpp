// Fuzz target: GPT-2's byte-level BPE (vocab.json, merges.txt). The input is vocab.json, then the
// parts "merges" (merges.txt) and "text". The tokenizer must reject the files with an InputError
// or encode the text to ids inside its vocabulary that decode to exactly the text's bytes, and the
// serialized model must load back to the same encoding.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/tokenizer.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  std::string vocab(parts[0].bytes.begin(), parts[0].bytes.end()), merges, text;
  for (size_t i = 1; i < parts.size(); ++i) {
    std::string bytes(parts[i].bytes.begin(), parts[i].bytes.end());
    if (parts[i].tag == "merges")
      merges = std::move(bytes);
    else if (parts[i].tag == "text")
      text = std::move(bytes);
    else
      return -1;
  }
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  fuzz::write_file(dir / "vocab.json", parts[0].bytes);
  fuzz::write_file(dir / "merges.txt",
                   std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(merges.data()), merges.size()));
  data::Tokenizer tok;
  try {
    tok = data::Tokenizer::from_file((dir / "vocab.json").string());
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  const std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab()) fuzz::fail("an id outside the vocabulary: " + std::to_string(id));
  if (tok.decode(ids) != text) fuzz::fail("the ids do not decode to the text");
  const data::Tokenizer again = data::Tokenizer::from_model(tok.name(), tok.model(), "fuzz");
  if (again.encode(text) != ids) fuzz::fail("the serialized model encodes otherwise");
  return 0;
}

// Fuzz target: the safetensors reader of `--init-from` (train::list_safetensors, read_safetensor).
// The input is one file, model.safetensors; with further parts it is a folder: a part tagged
// "index" is model.safetensors.index.json and a part tagged "<name>.safetensors" that file. Every
// tensor it lists must read as f32 of its shape (or be refused for its dtype).
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/train/import.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path dir = fuzz::fresh_scratch() / "model";
  fuzz::fs::create_directories(dir);
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  std::string where = (dir / "model.safetensors").string();
  for (const fuzz::Part& p : parts) {
    if (p.tag.empty()) {
      fuzz::write_file(dir / "model.safetensors", p.bytes);
    } else if (p.tag == "index") {
      fuzz::write_file(dir / "model.safetensors.index.json", p.bytes);
      where = dir.string();
    } else if (p.tag.size() < 64 && p.tag.ends_with(".safetensors") &&
               p.tag.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_.") == std::string::npos) {
      fuzz::write_file(dir / p.tag, p.bytes);
    }
  }
  try {
    for (const auto& [name, entry] : train::list_safetensors(where)) {
      try {
        const Tensor t = train::read_safetensor(name, entry);
        if (t.shape() != entry.shape) fuzz::fail("tensor '" + name + "' read as " + t.str());
      } catch (const InputError& e) {
        if (entry.dtype == "F32" || entry.dtype == "BF16" || entry.dtype == "F16") throw;
        fuzz::rejected(e);  // a dtype --init-from does not take
      }
    }
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  return 0;
}

// Fuzz target: `dtrain convert idx`. The input's first part is the idx image file, the part tagged
// "labels" the idx label file (either may be gzip). read_idx must reject the pair or read a set
// that write_shards converts and the shards give back sample for sample.
#include "dtrain/core/error.h"
#include "dtrain/data/convert.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  if (parts.size() != 2 || parts[1].tag != "labels") return -1;
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  fuzz::write_file(dir / "images-idx3-ubyte", parts[0].bytes);
  fuzz::write_file(dir / "labels-idx1-ubyte", parts[1].bytes);
  data::ImageSet set;
  try {
    set = data::read_idx((dir / "images-idx3-ubyte").string(), (dir / "labels-idx1-ubyte").string());
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  // What the converter accepted, the shards must keep; only the writer's own refusals (an empty
  // set) are clean.
  try {
    fuzz::expect_shards_round_trip(set, dir / "shards", size);
  } catch (const InputError& e) {
    if (set.size() > 0) fuzz::fail(std::string("converting a set read_idx accepted failed: ") + e.what());
  }
  return 0;
}

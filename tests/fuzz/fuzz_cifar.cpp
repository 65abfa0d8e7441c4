// Fuzz target: `dtrain convert cifar10`. Each part of the input is one binary batch file, read in
// order; read_cifar10 must reject them or read a set that write_shards converts and the shards give
// back sample for sample.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/data/convert.h"
#include "fuzz_util.h"

using namespace dtrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  if (parts.size() > 4) return -1;
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  std::vector<std::string> files;
  for (size_t i = 0; i < parts.size(); ++i) {
    files.push_back((dir / ("data_batch_" + std::to_string(i + 1) + ".bin")).string());
    fuzz::write_file(files.back(), parts[i].bytes);
  }
  data::ImageSet set;
  try {
    set = data::read_cifar10(files);
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  try {
    fuzz::expect_shards_round_trip(set, dir / "shards", size);
  } catch (const InputError& e) {
    fuzz::fail(std::string("converting a set read_cifar10 accepted failed: ") + e.what());
  }
  return 0;
}

// Fuzz target: `dtrain train --config FILE` with the input as FILE. parse_train_config reads it as
// the CLI does (the model first, then every option under that model's defaults); a configuration it
// accepts must print as INI (config_ini, --print-config) that reads back into the same configuration.
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/train/config.h"
#include "fuzz_util.h"

using namespace dtrain;

namespace {

std::string parse_and_print(const std::string& file) {
  std::string a0 = "train", a1 = "--config", a2 = file;
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  train::TrainConfig c;
  if (!train::parse_train_config(3, argv, c)) fuzz::fail("parse_train_config printed --help");
  return train::config_ini(c);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path dir = fuzz::fresh_scratch();
  fuzz::write_file(dir / "run.ini", {data, size});
  std::string ini;
  try {
    ini = parse_and_print((dir / "run.ini").string());
  } catch (const InputError& e) {
    fuzz::rejected(e);
    return 0;
  }
  fuzz::write_file(dir / "again.ini", {reinterpret_cast<const uint8_t*>(ini.data()), ini.size()});
  std::string again;
  try {
    again = parse_and_print((dir / "again.ini").string());
  } catch (const InputError& e) {
    fuzz::fail(std::string("config_ini's output is refused: ") + e.what() + "\n" + ini);
  }
  if (again != ini) fuzz::fail("config_ini's output reads back as another configuration:\n" + ini + "---\n" + again);
  return 0;
}

#include "dtrain/train/options.h"

#include <fstream>
#include <iostream>

#include "dtrain/core/error.h"

namespace po = boost::program_options;

namespace dtrain::train {

bool parse_options(int argc, char** argv, const po::options_description& opts, const std::string& usage,
                   po::variables_map& vm, bool with_config, bool handle_help) {
  po::options_description general("General");
  general.add_options()("help,h", "print this help and exit");
  if (with_config)
    general.add_options()("config", po::value<std::string>(),
                          "INI file of options (key = value); command-line options win");
  po::options_description all;
  all.add(general).add(opts);
  try {
    po::store(po::command_line_parser(argc, argv).options(all).run(), vm);
    if (vm.count("help") && handle_help) {
      std::cout << usage << "\n\n" << all << "\n";
      return false;
    }
    if (with_config && vm.count("config")) {
      std::string file = vm["config"].as<std::string>();
      std::ifstream in(file);
      DT_INPUT_CHECK(in, "config file '" << file << "' cannot be opened");
      try {
        po::store(po::parse_config_file(in, opts, false), vm);
      } catch (const po::error& e) {
        throw InputError("config file '" + file + "': " + e.what());
      }
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError(e.what());
  }
  return true;
}

}  // namespace dtrain::train

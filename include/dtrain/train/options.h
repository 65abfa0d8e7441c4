#pragma once
// Command-line parsing shared by every dtrain subcommand: Boost.Program_options, an optional
// --config INI file whose keys are the long option names (the command line wins), --help, and
// every Boost error turned into one InputError that names the option (or the file).
#include <boost/program_options.hpp>
#include <string>

namespace dtrain::train {

// Parses argv (argv[0] is the subcommand) into `vm` and notifies the bound variables. With
// `with_config`, --config FILE is accepted and its keys are checked against `opts`. Returns false
// after printing `usage` and the options for --help (without `handle_help`, --help is left to a
// later pass).
bool parse_options(int argc, char** argv, const boost::program_options::options_description& opts,
                   const std::string& usage, boost::program_options::variables_map& vm, bool with_config = false,
                   bool handle_help = true);

}  // namespace dtrain::train

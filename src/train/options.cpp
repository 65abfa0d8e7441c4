#include "dtrain/train/options.h"

#include <fstream>
#include <iostream>
#include <map>

#include "dtrain/core/error.h"

namespace po = boost::program_options;

namespace dtrain::train {

namespace {

// Boost's message of an option error. Boost 1.74's what() replaces each placeholder of the message
// ("%canonical_option%", "%value%") until none is left, so a name or value holding its own
// placeholder never finishes: `x%canonical_option% = 1` in a config file grew the message until
// memory ran out. Such an error's placeholders are replaced once here; any other keeps Boost's what().
std::string message_of(const po::error_with_option_name& e) {
  class OnePass : public po::error_with_option_name {
   public:
    explicit OnePass(const po::error_with_option_name& err) : po::error_with_option_name(err) {}
    bool loops() const {
      for (const auto& [key, value] : m_substitutions)
        if (value.find('%') != std::string::npos) return true;
      return get_canonical_option_name().find('%') != std::string::npos;
    }

   protected:
    void substitute_placeholders(const std::string& error_template) const override {
      std::map<std::string, std::string> subs = m_substitutions;
      subs["canonical_option"] = get_canonical_option_name();
      subs["prefix"] = get_canonical_option_prefix();
      std::string t = error_template;
      for (const auto& [key, from_to] : m_substitution_defaults)  // Boost's own text: no user input
        if (const size_t at = t.find(from_to.first); subs[key].empty() && at != std::string::npos)
          t.replace(at, from_to.first.size(), from_to.second);
      m_message.clear();
      for (size_t i = 0; i < t.size();) {
        const size_t end = t[i] == '%' ? t.find('%', i + 1) : std::string::npos;
        const auto it = end == std::string::npos ? subs.end() : subs.find(t.substr(i + 1, end - i - 1));
        if (it != subs.end()) {
          m_message += it->second;
          i = end + 1;
        } else {
          m_message += t[i++];
        }
      }
    }
  };
  const OnePass one_pass(e);
  return one_pass.loops() ? one_pass.what() : e.what();
}

std::string message_of(const po::error& e) {
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  return named ? message_of(*named) : e.what();
}

}  // namespace

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
        throw InputError("config file '" + file + "': " + message_of(e));
      }
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError(message_of(e));
  }
  return true;
}

}  // namespace dtrain::train

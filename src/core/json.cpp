#include "dtrain/core/json.h"

#include <boost/property_tree/json_parser.hpp>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain {

boost::property_tree::ptree parse_json(const std::string& text, const std::string& where) {
  boost::property_tree::ptree tree;
  try {
    std::istringstream in(text);
    boost::property_tree::read_json(in, tree);
  } catch (const boost::property_tree::json_parser_error& e) {
    DT_INPUT_CHECK(false, where << " is not JSON: " << e.message() << " (line " << e.line() << ")");
  }
  return tree;
}

}  // namespace dtrain

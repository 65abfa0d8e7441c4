#include "dtrain/core/json.h"

#include <algorithm>
#include <boost/property_tree/json_parser.hpp>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain {

// Counted: every object, array and string (keys too) and every scalar, whose first character
// follows a separator ('[', ',', ':') or starts the text.
JsonShape json_shape(std::string_view json) {
  JsonShape shape;
  int depth = 0;
  bool in_string = false, escaped = false, after_separator = true;
  for (const char c : json) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    const bool separator = c == '[' || c == ',' || c == ':';
    if (c == '{' || c == '[') {
      shape.nesting = std::max(shape.nesting, ++depth);
      ++shape.values;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == '"') {
      in_string = true;
      ++shape.values;
    } else if (!separator && after_separator) {
      ++shape.values;  // a number, true, false or null
    }
    after_separator = separator;
    if (shape.nesting > kMaxJsonNesting || shape.values > kMaxJsonValues) break;
  }
  return shape;
}

boost::property_tree::ptree parse_json(const std::string& text, const std::string& where) {
  const JsonShape shape = json_shape(text);
  DT_INPUT_CHECK(shape.nesting <= kMaxJsonNesting,
                 where << " nests objects and arrays deeper than " << kMaxJsonNesting << " levels");
  DT_INPUT_CHECK(shape.values <= kMaxJsonValues, where << " holds more than " << kMaxJsonValues << " JSON values");
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

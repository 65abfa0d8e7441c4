// The one JSON reader's bounds: nesting and value counts by one pass over the text (strings and
// their escapes skipped), and texts past them refused before Boost's recursive parser sees them.
#include <gtest/gtest.h>

#include <string>

#include "dtrain/core/error.h"
#include "dtrain/core/json.h"

using namespace dtrain;

namespace {
std::string nested_arrays(int depth) {
  return std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']');
}

std::string error_of(const std::string& text) {
  try {
    parse_json(text, "'t.json'");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Json, ShapeCountsNestingAndValuesOutsideStrings) {
  EXPECT_EQ(json_shape("{}").nesting, 1);
  EXPECT_EQ(json_shape(R"({"a": [1, 2.5e3, true, null, "x"]})").values, 8);  // {, "a", [, 4 scalars, "x"
  EXPECT_EQ(json_shape(R"({"a": "[[[{\"[\\"})").nesting, 1);                 // brackets in a string, escapes
  EXPECT_EQ(json_shape(R"({"a": "[[[{\"[\\"})").values, 3);
  EXPECT_EQ(json_shape(" 42 ").values, 1);
  EXPECT_EQ(json_shape(nested_arrays(10)).nesting, 10);
  EXPECT_EQ(json_shape(nested_arrays(100000)).nesting, kMaxJsonNesting + 1);  // the count stops there
}

TEST(Json, DeepOrLargeTextsAreRefusedBeforeParsing) {
  EXPECT_EQ(error_of(nested_arrays(kMaxJsonNesting)), "");
  const std::string deep = error_of(nested_arrays(100000));  // Boost's parser would overflow the stack
  EXPECT_NE(deep.find("'t.json' nests objects and arrays deeper than 64 levels"), std::string::npos) << deep;
  std::string many = "[";
  for (int64_t i = 0; i <= kMaxJsonValues; ++i) many += "0,";
  many += "0]";
  const std::string large = error_of(many);
  EXPECT_NE(large.find("'t.json' holds more than"), std::string::npos) << large;
  EXPECT_NE(error_of("{\"a\": [").find("'t.json' is not JSON"), std::string::npos);
}

#pragma once
// The one way dtrain reads a JSON text (safetensors headers, shard indexes, tokenizer vocabularies,
// fine-tuning records, model files): Boost's property tree, behind a bound on the text's shape (its
// parser recurses once per level, and holds a node per value), a parse error becoming one InputError.
#include <boost/property_tree/ptree.hpp>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtrain {

inline constexpr int kMaxJsonNesting = 64;                    // objects and arrays inside each other
inline constexpr int64_t kMaxJsonValues = int64_t{16} << 20;  // values (keys counted too) in one text

// The deepest nesting of objects and arrays in `json` (counted up to kMaxJsonNesting + 1) and its
// values, keys included (counted up to kMaxJsonValues + 1), by one pass over the text.
struct JsonShape {
  int nesting = 0;
  int64_t values = 0;
};
JsonShape json_shape(std::string_view json);

// `where` names the text in the error (a file, "'a.jsonl' line 3"), e.g. "'vocab.json'". A text
// deeper or larger than the bounds above is refused before it is parsed.
boost::property_tree::ptree parse_json(const std::string& text, const std::string& where);

}  // namespace dtrain

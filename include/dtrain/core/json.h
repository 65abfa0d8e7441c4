#pragma once
// The one way dtrain reads a JSON text (safetensors headers, shard indexes, tokenizer vocabularies,
// fine-tuning records): Boost's property tree, a parse error becoming one InputError.
#include <boost/property_tree/ptree.hpp>
#include <string>

namespace dtrain {

// `where` names the text in the error (a file, "'a.jsonl' line 3"), e.g. "'vocab.json'".
boost::property_tree::ptree parse_json(const std::string& text, const std::string& where);

}  // namespace dtrain

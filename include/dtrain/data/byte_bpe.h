#pragma once
// GPT-2's byte-level BPE, read from the two files a GPT-2 model ships (vocab.json: piece -> id;
// merges.txt: the merges in rank order). No Debian library reads these, so this is dtrain's own:
//   1. the text is cut into pre-tokens by GPT-2's pattern (contractions, letters, digits, other
//      symbols, each with at most one leading space; runs of white space), matched by PCRE2 with
//      Unicode classes. Bytes that are not UTF-8 match nothing: each run of them is a pre-token;
//   2. each pre-token's bytes become GPT-2's printable stand-ins (one code point per byte) and the
//      adjacent pair of lowest merge rank is merged, every occurrence left to right, until no pair
//      has a rank;
//   3. the resulting pieces are looked up in the vocabulary.
// Every byte has its piece, so any byte string encodes, and decoding gives it back exactly.
// Special tokens in the text (GPT-2's <|endoftext|>) are text like any other, as GPT-2's own
// encoder treats them.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dtrain::data {

class ByteLevelBpe {
 public:
  // `vocab_json` and `merges` are the files' contents; InputError naming `vocab_where` or
  // `merges_where` (and the line) for a file that does not parse, ids that are not 0..n-1 each
  // once, a byte without its piece, or a merge whose parts or result the vocabulary lacks.
  ByteLevelBpe(const std::string& vocab_json, const std::string& merges, const std::string& vocab_where,
               const std::string& merges_where);

  std::vector<int32_t> encode(std::string_view text) const;
  // Per id, the bytes it stands for.
  const std::vector<std::string>& pieces() const { return pieces_; }

 private:
  void merge_pairs(std::vector<int32_t>& word) const;  // step 2 on one pre-token's byte pieces

  struct Merge {
    int32_t rank, merged;
  };
  std::array<int32_t, 256> byte_piece_{};
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> its rank and result
  std::vector<std::string> pieces_;
  struct Pattern;  // GPT-2's pre-tokenising pattern, compiled
  std::shared_ptr<const Pattern> pattern_;
};

}  // namespace dtrain::data

#include "dtrain/data/byte_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <limits>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/json.h"

namespace dtrain::data {

namespace {

namespace pt = boost::property_tree;

// GPT-2's pre-tokenising pattern, as its encoder applies it with Unicode classes.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {  // GPT-2's stand-ins and its vocabularies' pieces stay below U+10000
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's printable stand-in of each byte: printable Latin-1 bytes stand for themselves, the other
// 68 (controls, space, NBSP, soft hyphen) for U+0100 onwards, in byte order.
std::array<uint32_t, 256> byte_stand_ins() {
  std::array<uint32_t, 256> cp{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cp[b] = printable ? b : next++;
  }
  return cp;
}

// The bytes a vocabulary piece stands for: each code point mapped back through the stand-ins; a
// code point that stands for no byte (a piece added by hand) keeps its own UTF-8 bytes.
std::string piece_bytes(const std::string& piece, const std::unordered_map<uint32_t, char>& byte_of) {
  std::string bytes;
  for (size_t i = 0; i < piece.size();) {
    const auto lead = static_cast<unsigned char>(piece[i]);
    const size_t len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    uint32_t cp = len == 1 ? lead : lead & (0x3F >> (len - 1));
    for (size_t k = 1; k < len && i + k < piece.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(piece[i + k]) & 0x3F);
    const auto it = byte_of.find(cp);
    if (it != byte_of.end())
      bytes += it->second;
    else
      bytes.append(piece, i, len);
    i += len;
  }
  return bytes;
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

struct ByteLevelBpe::Pattern {
  pcre2_code* code = nullptr;
  ~Pattern() { pcre2_code_free(code); }
};

ByteLevelBpe::ByteLevelBpe(const std::string& vocab_json, const std::string& merges, const std::string& vocab_where,
                           const std::string& merges_where) {
  const pt::ptree vocab = parse_json(vocab_json, "'" + vocab_where + "'");
  std::unordered_map<std::string, int32_t> id_of;
  std::vector<std::string> piece_of(vocab.size());
  for (const auto& [piece, value] : vocab) {
    const auto id = value.get_value_optional<int64_t>();
    DT_INPUT_CHECK(id && *id >= 0 && *id < static_cast<int64_t>(vocab.size()) && value.empty(),
                   "'" << vocab_where << "': piece '" << piece << "' has id '" << value.data() << "'; ids must be 0 to "
                       << vocab.size() - 1 << ", each once");
    DT_INPUT_CHECK(piece_of[static_cast<size_t>(*id)].empty() && !piece.empty(),
                   "'" << vocab_where << "': id " << *id << " is given twice (or to an empty piece)");
    piece_of[static_cast<size_t>(*id)] = piece;
    id_of.emplace(piece, static_cast<int32_t>(*id));
  }
  DT_INPUT_CHECK(!vocab.empty(), "'" << vocab_where << "' holds no pieces");
  const std::array<uint32_t, 256> stand_in = byte_stand_ins();
  std::unordered_map<uint32_t, char> byte_of;
  for (int b = 0; b < 256; ++b) {
    std::string piece;
    append_utf8(piece, stand_in[static_cast<size_t>(b)]);
    const auto it = id_of.find(piece);
    DT_INPUT_CHECK(it != id_of.end(), "'" << vocab_where << "' has no piece for byte " << b << " ('" << piece
                                          << "'): not a byte-level BPE");
    byte_piece_[static_cast<size_t>(b)] = it->second;
    byte_of.emplace(stand_in[static_cast<size_t>(b)], static_cast<char>(b));
  }
  for (const std::string& piece : piece_of) pieces_.push_back(piece_bytes(piece, byte_of));

  std::istringstream lines(merges);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (number == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    DT_INPUT_CHECK(space != std::string::npos && space > 0 && line.find(' ', space + 1) == std::string::npos &&
                       space + 1 < line.size(),
                   "'" << merges_where << "' line " << number << " is '" << line << "', not two pieces");
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    for (const std::string& piece : {left, right, left + right})
      DT_INPUT_CHECK(id_of.count(piece), "'" << merges_where << "' line " << number << " ('" << line << "'): '" << piece
                                             << "' is not in '" << vocab_where << "'");
    const bool fresh = merges_
                           .emplace(pair_key(id_of[left], id_of[right]),
                                    Merge{static_cast<int32_t>(merges_.size()), id_of[left + right]})
                           .second;
    DT_INPUT_CHECK(fresh, "'" << merges_where << "' line " << number << " repeats the merge '" << line << "'");
  }

  int error = 0;
  PCRE2_SIZE at = 0;
  auto pattern = std::make_shared<Pattern>();
  pattern->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                                PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &at, nullptr);
  DT_CHECK(pattern->code, "GPT-2's pre-tokenising pattern does not compile (PCRE2 error " << error << ")");
  pcre2_jit_compile(pattern->code, PCRE2_JIT_COMPLETE);  // where PCRE2 has no JIT, its interpreter matches
  pattern_ = std::move(pattern);
}

void ByteLevelBpe::merge_pairs(std::vector<int32_t>& word) const {
  std::vector<int32_t> merged;
  while (word.size() > 1) {
    const Merge* best = nullptr;
    uint64_t best_pair = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const auto it = merges_.find(pair_key(word[i], word[i + 1]));
      if (it != merges_.end() && (!best || it->second.rank < best->rank)) {
        best = &it->second;
        best_pair = it->first;
      }
    }
    if (!best) return;
    merged.clear();
    for (size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && pair_key(word[i], word[i + 1]) == best_pair) {
        merged.push_back(best->merged);
        ++i;
      } else {
        merged.push_back(word[i]);
      }
    }
    word.swap(merged);
  }
}

std::vector<int32_t> ByteLevelBpe::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  std::unordered_map<std::string_view, std::vector<int32_t>> done;  // pre-tokens repeat: each merged once
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
      pcre2_match_data_create_from_pattern(pattern_->code, nullptr), &pcre2_match_data_free);
  DT_CHECK(match, "PCRE2 could not allocate its match data");
  const auto add = [&](size_t begin, size_t end) {
    const std::string_view piece = text.substr(begin, end - begin);
    auto [it, fresh] = done.try_emplace(piece);
    if (fresh) {
      for (char c : piece) it->second.push_back(byte_piece_[static_cast<unsigned char>(c)]);
      merge_pairs(it->second);
    }
    ids.insert(ids.end(), it->second.begin(), it->second.end());
  };
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  for (size_t at = 0; at < text.size();) {
    const int rc = pcre2_match(pattern_->code, subject, text.size(), at, 0, match.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) {  // only bytes that are not UTF-8 remain
      add(at, text.size());
      break;
    }
    DT_CHECK(rc > 0, "PCRE2 could not match GPT-2's pattern (error " << rc << ") at byte " << at);
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match.get());
    if (span[0] > at) add(at, span[0]);  // bytes that are not UTF-8, skipped by the match
    add(span[0], span[1]);
    at = span[1];
  }
  return ids;
}

}  // namespace dtrain::data

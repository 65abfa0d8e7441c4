#pragma once
// Shared by the libFuzzer targets of this folder: a scratch directory per process, the split of one
// fuzz input into the several files a reader may open, and the checks every target makes after a
// reader ran.
//
// An input holding several files is the first file's bytes, then for each further file the line
// "\nDTRAIN-FUZZ-PART <tag>\n" and its bytes. The tag names the file's role ("stage1", "rank0",
// "labels"; a target says which it knows); a target reads a lone input as its first file.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::data {
struct ImageSet;
class ShardedHdf5Dataset;
}

namespace dtrain::fuzz {

namespace fs = std::filesystem;

inline constexpr std::string_view kPartSeparator = "\nDTRAIN-FUZZ-PART ";

struct Part {
  std::string tag;  // "" for the first part
  std::span<const uint8_t> bytes;
};
std::vector<Part> split_parts(const uint8_t* data, size_t size);
// The inverse, for the seed maker: parts[0] is the first file, the others carry their tags.
std::string join_parts(const std::vector<std::pair<std::string, std::string>>& parts);

// This process's scratch directory (under $TMPDIR, else /dev/shm, else /tmp), emptied by
// fresh_scratch() before each input and removed at exit.
const fs::path& scratch();
fs::path fresh_scratch();
void write_file(const fs::path& path, std::span<const uint8_t> bytes);
std::string read_file(const fs::path& path);

// Aborts (a finding for libFuzzer) when HDF5 objects are still open after a reader returned or
// threw: a reader that leaks an identifier keeps its file open for the life of the process.
void expect_no_open_hdf5_objects(const char* after);

// The converters' oracle: writes `set` as shards into `dir` (shard size, chunk and compression
// picked by `variant`), opens them with ShardedHdf5Dataset and aborts unless every sample and label
// reads back as it was given.
void expect_shards_round_trip(const data::ImageSet& set, const fs::path& dir, size_t variant);

// The readers' oracle: reads `rows` of `ds` and aborts on a label outside [0, classes) (a bad label
// must be refused when the dataset opens, not reach the model).
void read_checking_labels(data::ShardedHdf5Dataset& ds, const std::vector<int64_t>& rows);

// A clean rejection (an InputError): printed when DTRAIN_FUZZ_VERBOSE is set, to see what a
// corpus input is refused for; otherwise nothing.
void rejected(const std::exception& e);

// Aborts with `what`: an oracle of a target failed (a round trip that does not give back its input).
[[noreturn]] void fail(const std::string& what);

}  // namespace dtrain::fuzz

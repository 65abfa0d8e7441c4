#include "dtrain/train/trace.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain::train {

ChromeTrace::ChromeTrace(std::string path, int rank, int64_t max_steps)
    : path_(std::move(path)), rank_(rank), max_steps_(max_steps) {
  if (!path_.empty()) spans_.reserve(static_cast<size_t>(4 * std::min<int64_t>(max_steps_, 100000)));
}

void ChromeTrace::span(const char* name, double begin_s, double end_s, int64_t step) {
  if (!active()) return;
  if (origin_s_ < 0) origin_s_ = begin_s;
  spans_.push_back({name, begin_s, end_s, step});
}

void ChromeTrace::write(comm::Communicator& comm) {
  if (path_.empty()) return;
  std::string part = path_ + ".rank" + std::to_string(rank_);
  // Each step is agreed over the ranks (agree_on_inputs): a part one rank cannot write, or rank 0
  // cannot find (no shared file system), fails every rank naming it instead of a hang.
  comm::agree_on_inputs(comm, [&] {
    std::ofstream f(part);
    DT_INPUT_CHECK(f, "option --trace: cannot write '" << part << "'");
    // Microseconds from this rank's first traced step ("X": a complete event with a duration).
    f << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank_ << ", \"args\": {\"name\": \"rank " << rank_
      << "\"}}";
    char line[256];
    for (const Span& s : spans_) {
      std::snprintf(line, sizeof line,
                    ",\n{\"name\": \"%s\", \"cat\": \"step\", \"ph\": \"X\", \"pid\": %d, \"tid\": 0, \"ts\": %.1f, "
                    "\"dur\": %.1f, \"args\": {\"step\": %lld}}",
                    s.name, rank_, 1e6 * (s.begin_s - origin_s_), 1e6 * (s.end_s - s.begin_s),
                    static_cast<long long>(s.step));
      f << line;
    }
  });
  comm::agree_on_inputs(comm, [&] {
    if (rank_ != 0) return;
    std::ofstream out(path_);
    DT_INPUT_CHECK(out, "option --trace: cannot write '" << path_ << "'");
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    for (int r = 0; r < comm.size(); ++r) {
      std::string p = path_ + ".rank" + std::to_string(r);
      std::ifstream in(p);
      DT_INPUT_CHECK(in,
                     "option --trace: rank " << r << "'s part '" << p << "' is missing (not a shared file system?)");
      if (r > 0) out << ",\n";
      out << in.rdbuf();
      in.close();
      std::filesystem::remove(p);
    }
    out << "\n]}\n";
  });
}

}  // namespace dtrain::train

#pragma once
// A Chrome trace (the JSON "traceEvents" format Perfetto and chrome://tracing open) of each rank's
// step: data wait, forward+backward, communication wait, optimizer. One process per rank. Times
// come from the steady clock, which ranks on one node share; across nodes the rows are aligned at
// the first traced step.
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"

namespace dtrain::train {

class ChromeTrace {
 public:
  // Empty `path`: disabled, every call is a no-op. At most `max_steps` steps are recorded.
  ChromeTrace(std::string path, int rank, int64_t max_steps);
  bool active() const { return !path_.empty() && steps_ < max_steps_; }
  // A span on this rank's row; times in seconds of now_s().
  void span(const char* name, double begin_s, double end_s, int64_t step);
  void end_step() { ++steps_; }
  // Every rank writes PATH.rank<N>; after a barrier rank 0 merges them into PATH (a shared file
  // system, as for checkpoints) and removes the parts. Collective.
  void write(comm::Communicator& comm);

 private:
  struct Span {
    const char* name;
    double begin_s, end_s;
    int64_t step;
  };
  std::string path_;
  int rank_;
  int64_t max_steps_, steps_ = 0;
  double origin_s_ = -1;
  std::vector<Span> spans_;
};

}  // namespace dtrain::train

#pragma once
// The desync check: ranks compare their collective sequences (flight records) with a neighbour's
// on each communicator, over the control channel, so a rank that skipped, added or changed a
// collective is named before the mismatch hangs the job. The comparison runs on the control
// thread: the trainer only asks for it every K steps, and a wait that stalls asks for it too
// (the classic desync, a skipped collective, deadlocks within the step it happened in, so only a
// check that works while every rank is blocked can name it before the timeout).
#include <cstdint>
#include <string>
#include <vector>

#include "control/flight_recorder.h"

namespace dtrain::comm::detail {

// One rank's sequence on one communicator as another rank sees it: its latest sequence number,
// its phase (what it has finished: every phase below), and records from some point on.
struct SequenceView {
  int rank = 0;        // in the communicator
  int world_rank = 0;  // in MPI_COMM_WORLD, for the message
  int64_t latest = 0;
  int64_t phase = 0;
  std::vector<CollectiveRecord> records;  // ascending, contiguous
};

// The first difference between two ranks' sequences on communicator `comm`, described for a
// DesyncError; "" when none is visible. Differences: a record both have that differs in call or
// phase; a record one rank issued in a phase the other is already past. `verified`: the records up
// to it were found equal before (for "at" against "at or before").
std::string first_sequence_difference(const std::string& comm, int comm_size, const SequenceView& a,
                                      const SequenceView& b, int64_t verified);

// A desync found here or reported by a peer (the first one wins); thrown by every wait and check.
void note_desync(const std::string& message, bool from_peer);
bool desync_noted();
std::string desync_message();
void throw_if_desync();
// The control thread sends a noted desync to the peers once: takes it if not yet sent.
bool take_desync_to_send(std::string& message);

// Requests a comparison on every channel (the control thread does it).
void request_sequence_check();
int64_t sequence_check_requests();

// Inside a wait loop (call it every ~100 ms): throws a noted desync; asks for a sequence check
// once the wait has lasted 1/8 of its limit (at least 1 s, at most 30 s), then at each doubling.
class StallWatch {
 public:
  explicit StallWatch(double limit_s);
  void tick(double waited_s);

 private:
  double next_s_;
};

}  // namespace dtrain::comm::detail

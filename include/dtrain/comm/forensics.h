#pragma once
// Hang forensics and the desync check (docs/comm.md, "Hang forensics"). Every communicator keeps a
// flight recorder of its last collectives. On a timeout that aborts the job, every rank that can
// still act writes <run dir>/hang-rank<r>.txt: the reason, every flight recorder, and a backtrace
// of each of its threads. The desync check compares the ranks' collective sequences.
#include <cstdint>
#include <string>

namespace dtrain::comm {

class Communicator;

// Where the hang forensics go (default: the current directory). The trainer sets its run's folder.
void set_run_dir(const std::string& dir);
std::string run_dir();

// The trainer's position, which tags the collectives issued from here on on the communicators that
// track it (Communicator::track_step_phases): the body of `step` (>= 1: data, forward, backward,
// exchange, update) or, with after_body, what follows it; step 0 is outside the steps (set-up). A
// rank past a phase must have issued all of its collectives: the desync check names one that did
// not. Collectives on tracked communicators must come from the thread that sets the phase
// (another thread's would be tagged by timing).
void set_step_phase(int64_t step, bool after_body);

// A trainer's span: `comm` tracks the step phases (and its splits from then on) while this lives;
// the phase starts at 0, the set-up.
class StepPhaseScope {
 public:
  explicit StepPhaseScope(Communicator& comm);
  ~StepPhaseScope();
  StepPhaseScope(const StepPhaseScope&) = delete;
  StepPhaseScope& operator=(const StepPhaseScope&) = delete;

 private:
  Communicator& comm_;
};

// Throws DesyncError (communicator.h) if this or another rank found that the ranks' collective
// sequences differ; then asks the control thread to compare every communicator's sequence with a
// neighbour rank's (no cost to this thread: a difference found is thrown by the next call, or by
// the next wait on any Work). Waits that stall ask for the same comparison.
void check_collective_sequences();

}  // namespace dtrain::comm

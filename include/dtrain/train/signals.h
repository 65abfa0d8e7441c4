#pragma once
// Preemption: a scheduler (SLURM --signal, scancel, PBS qdel, a spot-instance notice) sends SIGTERM
// or SIGUSR1 to one or all ranks. The handler only records the signal; the trainer asks every rank
// at its next step boundary (one small allreduce) so all ranks stop at the same step, write one
// checkpoint and exit with kPreemptedExitCode, which the job scripts turn into a requeue.
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/error.h"

namespace dtrain::train {

// Exit status of `dtrain train` after a preemption checkpoint (cluster/ scripts requeue on it).
inline constexpr int kPreemptedExitCode = kExitPreempted;

// Installs handlers for `signals` (e.g. {SIGTERM, SIGUSR1}) while alive; restores the previous
// handlers when destroyed. Guards nest: `dtrain train` holds one around the whole command, so a
// signal during set-up is acted on at the first step and one after the last step is harmless
// (instead of the default action, death by the signal); the trainers hold their own for library
// callers. The outermost guard forgets earlier signals; an inner one keeps them.
class PreemptionGuard {
 public:
  explicit PreemptionGuard(const std::vector<int>& signals);
  ~PreemptionGuard();
  PreemptionGuard(const PreemptionGuard&) = delete;
  PreemptionGuard& operator=(const PreemptionGuard&) = delete;

  // The first signal received since construction on this rank, or 0.
  static int received();
  // Forgets a received signal (tests).
  static void clear();

 private:
  std::vector<int> signals_;
  std::vector<void*> previous_;  // struct sigaction*, kept opaque to keep <csignal> out of the header
};

// The largest signal number any rank of `comm` received (0: none): one 4-byte Max allreduce, so
// every rank stops after the same step. Null `comm`: this rank's own. Collective.
int agree_on_preemption(comm::Communicator* comm);

// "TERM,USR1" -> {SIGTERM, SIGUSR1}; "none" or "" -> {}. Throws InputError naming `option`.
std::vector<int> parse_signal_list(const std::string& list, const std::string& option);
// SIGTERM -> "SIGTERM".
std::string signal_name(int sig);

}  // namespace dtrain::train

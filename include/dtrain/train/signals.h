#pragma once
// Preemption: a scheduler (SLURM --signal, scancel, PBS qdel, a spot-instance notice) sends SIGTERM
// or SIGUSR1 to one or all ranks. The handler only records the signal; the trainer asks every rank
// at its next step boundary (one small allreduce) so all ranks stop at the same step, write one
// checkpoint and exit with kPreemptedExitCode, which the job scripts turn into a requeue.
#include <string>
#include <vector>

namespace dtrain::train {

// Exit status of `dtrain train` after a preemption checkpoint (cluster/ scripts requeue on it).
inline constexpr int kPreemptedExitCode = 42;

// Installs handlers for `signals` (e.g. {SIGTERM, SIGUSR1}) while alive; restores the previous
// handlers when destroyed. One instance at a time per process.
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

// "TERM,USR1" -> {SIGTERM, SIGUSR1}; "none" or "" -> {}. Throws InputError naming `option`.
std::vector<int> parse_signal_list(const std::string& list, const std::string& option);
// SIGTERM -> "SIGTERM".
std::string signal_name(int sig);

}  // namespace dtrain::train

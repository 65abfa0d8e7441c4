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

// Blocks the preemption signals (those parse_signal_list names) in the calling thread and every
// thread started from it afterwards, and starts one thread that takes them: the handler, or the
// default action where no guard is alive, runs there. Call it first thing in main, before MPI and
// the engines start threads. Why: with the handler on whichever thread the kernel chose (mostly the
// main thread, inside a oneDNN kernel or an MPI call), preempt_mpirun.sh died in 4 of 12 runs of heap
// corruption in the next step's oneDNN matmul (AVX2 EPYC, Open MPI 4.1.4); with this, 0 of 24. Which
// library call an interrupting signal upsets was not found; no computing thread is interrupted now.
void take_preemption_signals_on_own_thread();

// The largest signal number any rank of `comm` received (0: none): one 4-byte Max allreduce, so
// every rank stops after the same step. Null `comm`: this rank's own. Collective.
int agree_on_preemption(comm::Communicator* comm);

// "TERM,USR1" -> {SIGTERM, SIGUSR1}; "none" or "" -> {}. Throws InputError naming `option`.
std::vector<int> parse_signal_list(const std::string& list, const std::string& option);
// SIGTERM -> "SIGTERM".
std::string signal_name(int sig);

}  // namespace dtrain::train

#include "control/phase_deadline.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dtrain/comm/runtime.h"
#include "dtrain/core/env.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm::detail {

PhaseDeadline::PhaseDeadline(std::string phase, Ending ending)
    : PhaseDeadline(std::move(phase), env::get_double("DTRAIN_COMM_TIMEOUT"), ending) {}

PhaseDeadline::PhaseDeadline(std::string phase, double seconds, Ending ending) {
  // 0 (or less) is no deadline; so is one past any job's life, which the clock could not hold.
  if (seconds > 0 && std::isfinite(seconds) && seconds < 1e9)
    watcher_ = std::thread([this, phase = std::move(phase), seconds, ending] { watch(phase, seconds, ending); });
}

PhaseDeadline::~PhaseDeadline() {
  if (!watcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
  }
  cv_.notify_one();
  watcher_.join();
}

void PhaseDeadline::watch(std::string phase, double seconds, Ending ending) {
  std::unique_lock<std::mutex> lock(mu_);
  WaitClock clock;  // a stop of the whole job (SIGSTOP, scontrol suspend) does not count
  while (clock.waited() < seconds)
    if (cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return finished_; })) return;
  lock.unlock();  // the phase's owner must not block on this if ending the job takes a while
  const std::string message = phase + " did not finish within " + std::to_string(static_cast<long>(seconds)) +
                              " s (DTRAIN_COMM_TIMEOUT): a rank that never started, or a node that is gone?";
  if (ending == Ending::abort_job) Runtime::abort(1, message);  // staggered by rank, as every abort
  // Before MPI_Init returns this process knows only its host.
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::fprintf(stderr, "dtrain: fatal (on %s): %s\n", host, message.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace dtrain::comm::detail

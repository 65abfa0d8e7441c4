#pragma once
#include <sys/resource.h>
#include <time.h>

#include <chrono>

namespace dtrain {

inline double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// Seconds a wait has lasted, on a clock that leaves out the times the process was stopped. A wait
// reads it at every poll (polls come at most a second apart); a gap between two reads longer than
// kStopGapS is the process stopped (SIGSTOP, `scontrol suspend`) or the machine suspended, not the
// wait, and is not counted: a job continued after a suspension keeps the deadlines it had.
class WaitClock {
 public:
  static constexpr double kStopGapS = 3.0;

  WaitClock() : last_(now_s()) {}
  double waited() {
    const double now = now_s(), gap = now - last_;
    last_ = now;
    (gap < kStopGapS ? waited_ : stopped_) += gap;
    return waited_;
  }
  double stopped() const { return stopped_; }  // seconds left out, as of the last read

 private:
  double last_, waited_ = 0, stopped_ = 0;
};

// CPU seconds used by the whole process (all threads): a throughput measure that background load
// on a shared machine disturbs much less than wall time.
inline double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The most resident memory this process has held so far, in MiB (getrusage's ru_maxrss).
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

}  // namespace dtrain

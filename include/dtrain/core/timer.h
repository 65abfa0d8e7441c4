#pragma once
#include <sys/resource.h>
#include <time.h>

#include <chrono>

namespace dtrain {

inline double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

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

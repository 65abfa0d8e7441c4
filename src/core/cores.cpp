#include "dtrain/core/cores.h"

#include <sched.h>
#include <unistd.h>

namespace dtrain {

int online_cores() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return online_cores();
  int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

}  // namespace dtrain

// Topology: what one rank knows about where it runs, and the one-screen table rank 0 prints.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "bootstrap/topology_internal.h"
#include "dtrain/comm/runtime.h"

namespace dtrain::comm {

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "SINGLE";
    case MPI_THREAD_FUNNELED:
      return "FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MULTIPLE";
    default:
      return "?";
  }
}

std::string Topology::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << size << " node " << node_index << "/" << node_count << " (local " << local_rank << "/"
     << local_size << ") host " << host << " cuda " << cuda_device << " threads " << threads_per_rank << " bound "
     << bound_cores << "/" << node_cores << " cores, launcher " << launcher << ", MPI thread level "
     << thread_level_name(mpi_thread_level);
  return os.str();
}

std::string Topology::binding_warning(int threads) const {
  if (threads <= bound_cores) return "";
  std::ostringstream os;
  os << "rank " << rank << " on " << host << " runs " << threads << " threads but is bound to " << bound_cores
     << " core" << (bound_cores == 1 ? "" : "s") << "; launch with --bind-to none or --map-by slot:PE=" << threads
     << " (Open MPI), or --cpus-per-task (SLURM)";
  return os.str();
}

namespace detail {

// Which launcher started us, from its environment (for logging only: ranks come from MPI).
std::string detect_launcher() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  std::string l;
  if (has("SLURM_JOB_ID") && has("SLURM_PROCID"))
    l = "SLURM (srun, job " + std::string(std::getenv("SLURM_JOB_ID")) + ")";
  else if (has("OMPI_COMM_WORLD_SIZE"))
    l = "Open MPI (mpirun)";
  else if (has("PMIX_RANK"))
    l = "PMIx";
  else if (has("PMI_RANK") || has("PMI_FD"))
    l = "PMI (Hydra/MPICH)";
  else
    l = "singleton";
  if (has("PBS_JOBID")) l += ", PBS job " + std::string(std::getenv("PBS_JOBID"));
  if (has("SLURM_JOB_ID") && l.rfind("SLURM", 0) != 0) l += ", SLURM job " + std::string(std::getenv("SLURM_JOB_ID"));
  return l;
}

std::string format_topology_table(const Topology& me, const std::vector<TopologyRow>& rows, bool threaded) {
  std::ostringstream os;
  os << "dtrain: " << me.size << " rank" << (me.size == 1 ? "" : "s") << " on " << me.node_count << " node"
     << (me.node_count == 1 ? "" : "s") << "; launcher " << me.launcher << "; " << me.mpi_library << "; thread level "
     << thread_level_name(me.mpi_thread_level) << (threaded ? " (comm threads)" : " (inline comm)")
     << "; CUDA-aware MPI " << (me.cuda_aware_mpi ? "yes" : "no") << "\n";
  std::vector<std::string> warnings;
  for (const TopologyRow& r : rows)
    if (r.threads > r.bound)
      warnings.push_back("rank " + std::to_string(r.rank) + ": " + std::to_string(r.threads) + " threads on " +
                         std::to_string(r.bound) + " bound core(s)");
  char line[160];
  if (rows.size() <= 32) {
    std::snprintf(line, sizeof line, "%6s  %-20s %5s %6s %5s %8s %12s\n", "rank", "host", "node", "local", "cuda",
                  "threads", "bound/cores");
    os << line;
    for (const TopologyRow& r : rows) {
      std::snprintf(line, sizeof line, "%6d  %-20.20s %5d %3d/%-2d %5d %8d %7d/%-4d\n", r.rank, r.host, r.node_index,
                    r.local_rank, r.local_size, r.cuda_device, r.threads, r.bound, r.node_cores);
      os << line;
    }
  } else {
    // Past a screen: one line per node.
    std::snprintf(line, sizeof line, "%5s  %-20s %6s %-12s %8s %10s\n", "node", "host", "ranks", "first..last",
                  "threads", "cuda devs");
    os << line;
    size_t i = 0;
    while (i < rows.size()) {
      size_t j = i;
      int maxdev = -1;
      while (j < rows.size() && rows[j].node_index == rows[i].node_index &&
             std::strcmp(rows[j].host, rows[i].host) == 0) {
        maxdev = std::max(maxdev, rows[j].cuda_device);
        ++j;
      }
      std::string span = std::to_string(rows[i].rank) + ".." + std::to_string(rows[j - 1].rank);
      std::snprintf(line, sizeof line, "%5d  %-20.20s %6zu %-12s %8d %10d\n", rows[i].node_index, rows[i].host, j - i,
                    span.c_str(), rows[i].threads, maxdev + 1);
      os << line;
      i = j;
    }
  }
  for (size_t k = 0; k < warnings.size() && k < 4; ++k)
    os << "warning: " << warnings[k] << " (use --bind-to none or --map-by slot:PE=N)\n";
  if (warnings.size() > 4) os << "warning: ... and " << warnings.size() - 4 << " more ranks with too few cores\n";
  return os.str();
}

}  // namespace detail
}  // namespace dtrain::comm

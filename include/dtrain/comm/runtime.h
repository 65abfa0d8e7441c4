#pragma once
// The rank-aware runtime: MPI bootstrap, topology discovery (world/node-local ranks, nodes, hosts,
// launcher, CPU threads, CUDA device binding) and the world communicator. One per process.
#include <mpi.h>

#include <memory>
#include <string>

namespace dtrain::comm {

struct Topology {
  int rank = 0, size = 1;                    // MPI_COMM_WORLD
  int local_rank = 0, local_size = 1;        // ranks sharing this node (MPI_COMM_TYPE_SHARED)
  int node_count = 1, node_index = 0;        // nodes are numbered by their lowest world rank
  std::string host;                          // MPI_Get_processor_name
  std::string launcher;                      // "Open MPI (mpirun)", "SLURM (srun)", ... for logging only
  int threads_per_rank = 1;                  // node cores / ranks on the node, at least 1
  int cuda_device = -1;                      // local_rank % device count; -1 without CUDA or GPU
  int mpi_thread_level = MPI_THREAD_SINGLE;  // as granted by MPI_Init_thread

  int node_cores = 1;   // online CPUs of the node
  int bound_cores = 1;  // CPUs in this rank's affinity mask
  int cuda_device_count = 0;
  bool cuda_aware_mpi = false;  // MPI accepts device pointers
  std::string mpi_library;      // first line of MPI_Get_library_version

  // "rank 3/4 node 0 (local 3/4) host node07 cuda -1 threads 1 bound 2 cores"
  std::string describe() const;
  // The compute threads of a `--threads` option: `requested` when > 0, else this rank's share of
  // the node's cores (threads_per_rank).
  int compute_threads(int requested) const { return requested > 0 ? requested : threads_per_rank; }
  // Non-empty when `threads` compute threads would outnumber the cores this rank is bound to.
  std::string binding_warning(int threads) const;
};

const char* thread_level_name(int level);  // "MULTIPLE", ...

class Communicator;

class Runtime {
 public:
  // MPI_Init_thread asking for MPI_THREAD_MULTIPLE (works with what is granted); returns the
  // existing runtime when called again. argc/argv may be null. Adopts an MPI someone else
  // initialised (and then leaves finalising it to them).
  static Runtime& init(int* argc, char*** argv);
  static bool initialized();
  static Runtime& get();  // throws when init() was not called

  const Topology& topology() const { return topo_; }
  Communicator& world();  // MPI backend over (a duplicate of) MPI_COMM_WORLD

  // Collective over the world. Rank 0 gets a one-screen table of every rank's view; the other
  // ranks get "". Past 32 ranks the table shows one line per node.
  std::string topology_table() const;

  // Whether every rank of the world calls this within `seconds` (a non-blocking barrier on a
  // communicator of its own, so it never meets another collective): the ranks that found the same
  // error may then say it once. False on a rank whose error the others did not find (they are in
  // some collective, or gone): that rank reports alone and ends the job. Once per process.
  static bool all_ranks_arrive_within(double seconds);

  // Stops the communicators' threads, frees MPI objects and calls MPI_Finalize. Idempotent.
  static void finalize();
  // Prints "dtrain: fatal (rank r on host): message" once per process, then MPI_Abort so every
  // rank of the job exits non-zero. Usable before init and after finalize.
  [[noreturn]] static void abort(int code, const std::string& message);

  // True when communicators run their blocking MPI calls on a background thread (needs
  // MPI_THREAD_MULTIPLE); otherwise collectives run on the caller's thread without timeouts.
  bool threaded_progress() const { return threaded_; }

  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

 private:
  Runtime() = default;
  void bootstrap(int* argc, char*** argv);

  Topology topo_;
  bool owns_mpi_ = false;
  bool threaded_ = false;
  MPI_Comm internal_ = MPI_COMM_NULL;  // the runtime's own duplicate of the world (table gather)
  MPI_Comm ending_ = MPI_COMM_NULL;    // another, for all_ranks_arrive_within only
  std::unique_ptr<Communicator> world_;
};

}  // namespace dtrain::comm

// Bootstrap: MPI_Init_thread, error handlers, topology discovery, device binding, the world
// communicator, finalize and abort.
#include "dtrain/comm/runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#if defined(DTRAIN_COMM_WITH_CUDART)
#include <cuda_runtime_api.h>
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DTRAIN_WITH_LSAN 1
#include <sanitizer/lsan_interface.h>
#endif
#endif

#include "backends/mpi_communicator.h"
#include "backends/mpi_types.h"
#include "bootstrap/topology_internal.h"
#include "control/control_channel.h"
#include "control/phase_deadline.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/core/cores.h"
#include "dtrain/core/env.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm {

namespace {
// LeakSanitizer (scripts/sanitize.sh's ASan build). Open MPI 4.1 keeps some of what MPI_Init
// allocates unfreed, also in components it loads, queries and unloads during MPI_Init, and it
// unloads the rest in MPI_Finalize: leaks whose code is gone cannot be matched to a suppression
// and would read as dtrain's. So what MPI_Init allocates on this thread is not tracked, and the
// leak check runs just before MPI_Finalize, with every library still loaded (it then exits on a leak,
// and the check at exit is skipped).
void lsan_disable() {
#if defined(DTRAIN_WITH_LSAN)
  __lsan_disable();
#endif
}
void lsan_enable() {
#if defined(DTRAIN_WITH_LSAN)
  __lsan_enable();
#endif
}
void lsan_check_now() {
#if defined(DTRAIN_WITH_LSAN)
  __lsan_do_leak_check();
#endif
}

std::mutex g_mu;
std::unique_ptr<Runtime> g_runtime;
std::atomic<bool> g_ready{false};
std::atomic<int> g_world_rank{0};
bool g_finalized = false;

// The test hook DTRAIN_TEST_START_DELAY=RANK:SECONDS: the launcher's rank RANK sleeps before MPI_Init,
// a rank that never arrives for the start-up deadline.
void delay_start_for_test() {
  const std::string hook = env::get("DTRAIN_TEST_START_DELAY");
  if (hook.empty()) return;
  const char* rank = nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if ((rank = std::getenv(name))) break;
  const auto colon = hook.find(':');
  if (rank && colon != std::string::npos && hook.substr(0, colon) == rank)
    std::this_thread::sleep_for(std::chrono::duration<double>(std::stod(hook.substr(colon + 1))));
}
}  // namespace

Runtime& Runtime::init(int* argc, char*** argv) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_runtime) return *g_runtime;
  DT_CHECK(!g_finalized, "Runtime::init after Runtime::finalize: MPI cannot be initialised twice");
  std::unique_ptr<Runtime> rt(new Runtime);
  rt->bootstrap(argc, argv);
  g_runtime = std::move(rt);
  g_ready.store(true);
  return *g_runtime;
}

bool Runtime::initialized() { return g_ready.load(); }

Runtime& Runtime::get() {
  DT_CHECK(g_ready.load(), "the dtrain runtime is not initialised: call dtrain::comm::Runtime::init() first");
  return *g_runtime;
}

Runtime::~Runtime() = default;

Communicator& Runtime::world() {
  DT_CHECK(world_ != nullptr, "the world communicator is gone (after Runtime::finalize)");
  return *world_;
}

void Runtime::bootstrap(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  int provided = MPI_THREAD_SINGLE;
  if (!inited) {
    delay_start_for_test();
    lsan_disable();
    int rc = 0;
    {
      detail::PhaseDeadline deadline("MPI start-up (MPI_Init)", detail::PhaseDeadline::Ending::exit_process);
      rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    }
    lsan_enable();
    if (rc != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, text, &len);
      DT_CHECK(false, "MPI_Init_thread failed: " << std::string(text, static_cast<size_t>(len)));
    }
    owns_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  topo_.mpi_thread_level = provided;
  detail::PhaseDeadline deadline("MPI start-up (topology, communicators)");
  // Errors come back as return codes, which DT_MPI_CHECK turns into typed errors.
  DT_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN));

  Topology& t = topo_;
  DT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &t.rank));
  DT_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &t.size));
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_len = 0;
  DT_MPI_CHECK(MPI_Get_processor_name(host, &host_len));
  t.host.assign(host, static_cast<size_t>(host_len));
  set_error_context(t.rank, t.host);
  g_world_rank.store(t.rank);

  DT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &internal_));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(internal_, MPI_ERRORS_RETURN));
  DT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &ending_));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(ending_, MPI_ERRORS_RETURN));

  // Node-local ranks: the ranks that share memory with us. Keyed by world rank, so local rank 0
  // is the lowest world rank of the node, and nodes are numbered in order of that rank.
  MPI_Comm node = MPI_COMM_NULL;
  DT_MPI_CHECK(MPI_Comm_split_type(internal_, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &node));
  DT_MPI_CHECK(MPI_Comm_rank(node, &t.local_rank));
  DT_MPI_CHECK(MPI_Comm_size(node, &t.local_size));
  int leader = t.rank;
  DT_MPI_CHECK(MPI_Bcast(&leader, 1, MPI_INT, 0, node));
  MPI_Comm_free(&node);
  std::vector<int> leaders(static_cast<size_t>(t.size));
  DT_MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, internal_));
  t.node_count = 0;
  t.node_index = 0;
  for (int r = 0; r < t.size; ++r) {
    if (leaders[static_cast<size_t>(r)] != r) continue;
    ++t.node_count;
    if (r < leader) ++t.node_index;
  }

  t.node_cores = online_cores();
  t.bound_cores = affinity_cores();
  t.threads_per_rank = std::max(1, t.node_cores / t.local_size);
  t.launcher = detail::detect_launcher();
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int lib_len = 0;
  MPI_Get_library_version(lib, &lib_len);
  t.mpi_library.assign(lib, static_cast<size_t>(lib_len));
  if (auto p = t.mpi_library.find_first_of("\n,"); p != std::string::npos) t.mpi_library.resize(p);

#if defined(DTRAIN_COMM_WITH_CUDART)
  // One device per local rank. No device (or no driver) is not an error: the CPU engine runs.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    devices = 0;
    cudaGetLastError();
  }
  t.cuda_device_count = devices;
  if (devices > 0) {
    t.cuda_device = t.local_rank % devices;
    cudaError_t e = cudaSetDevice(t.cuda_device);
    DT_CHECK(e == cudaSuccess, "cudaSetDevice(" << t.cuda_device << ") failed: " << cudaGetErrorString(e));
  }
#endif
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  t.cuda_aware_mpi = MPIX_Query_cuda_support() == 1;
#endif

  detail::create_user_ops();
  threaded_ = provided == MPI_THREAD_MULTIPLE;
  if (threaded_) detail::control_service_start();
  MPI_Comm world = MPI_COMM_NULL;
  DT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN));
  auto mpi_world = std::make_unique<detail::MpiCommunicator>(world, "world", threaded_);
  if (threaded_) detail::control_service_set_world(mpi_world->channel());  // the desync check's channel
  world_ = std::move(mpi_world);
  if (!threaded_ && t.rank == 0)
    std::fprintf(stderr,
                 "dtrain: warning: MPI granted thread level %s, not MULTIPLE: communication runs on the caller's "
                 "thread, without overlap and without timeouts on collectives\n",
                 thread_level_name(provided));
}

std::string Runtime::topology_table() const {
  detail::TopologyRow row{};
  row.rank = topo_.rank;
  row.node_index = topo_.node_index;
  row.local_rank = topo_.local_rank;
  row.local_size = topo_.local_size;
  row.cuda_device = topo_.cuda_device;
  row.threads = topo_.threads_per_rank;
  row.bound = topo_.bound_cores;
  row.node_cores = topo_.node_cores;
  std::snprintf(row.host, sizeof row.host, "%s", topo_.host.c_str());
  std::vector<detail::TopologyRow> rows(topo_.rank == 0 ? static_cast<size_t>(topo_.size) : 0);
  detail::PhaseDeadline deadline("the topology table's gather");
  DT_MPI_CHECK(MPI_Gather(&row, sizeof row, MPI_BYTE, rows.data(), sizeof row, MPI_BYTE, 0, internal_));
  if (topo_.rank != 0) return "";
  return detail::format_topology_table(topo_, rows, threaded_);
}

bool Runtime::all_ranks_arrive_within(double seconds) {
  Runtime& rt = get();
  if (rt.topo_.size == 1) return true;
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(rt.ending_, &req) != MPI_SUCCESS) return false;
  WaitClock clock;  // a stop of the whole job (SIGSTOP, scontrol suspend) does not count
  for (;;) {
    int done = 0;
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    if (clock.waited() >= seconds) return false;  // the request is left: the job ends
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void Runtime::finalize() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_runtime) return;
  g_ready.store(false);
  Runtime& rt = *g_runtime;
  {
    // MPI_Finalize itself is left outside: it waits for every rank, and some commands keep rank 0
    // working while the others have finished (convert, export).
    detail::PhaseDeadline deadline("shutdown (draining the communicators, freeing their windows)");
    // Communicators first (they drain their queues), then the control thread that serves them.
    detail::shutdown_all_mpi_communicators();
    detail::control_service_stop();
    rt.world_.reset();
  }
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) {
    detail::free_user_ops();
    if (rt.internal_ != MPI_COMM_NULL) MPI_Comm_free(&rt.internal_);
    if (rt.ending_ != MPI_COMM_NULL) MPI_Comm_free(&rt.ending_);
    if (rt.owns_mpi_) {
      lsan_check_now();
      MPI_Finalize();
    }
  }
  g_runtime.reset();
  g_finalized = true;
}

void Runtime::abort(int code, const std::string& message) {
  // Ranks that fail together (the same bad input everywhere) abort in turn, lowest rank first.
  detail::abort_job(code, message, std::min(2.0, 0.25 * g_world_rank.load()));
}

namespace detail {
void abort_job(int code, const std::string& message, double delay_s) {
  // Open MPI 4.1's mpirun can hang when several ranks call MPI_Abort at once while another has
  // finalised (seen with one rank leaving early). So one rank aborts first and the others wait a
  // little: usually they are killed before they print, which also leaves one message.
  static std::atomic<bool> entered{false};
  if (code == 0) code = 1;
  if (entered.exchange(true)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // another thread is aborting
  }
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  bool mpi_live = inited && !fin;
  if (mpi_live && delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
  std::string ctx = error_context();
  std::fprintf(stderr, "dtrain: fatal%s: %s\n", ctx.empty() ? "" : (" (" + ctx + ")").c_str(), message.c_str());
  std::fflush(stderr);
  if (mpi_live) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}
}  // namespace detail

}  // namespace dtrain::comm

#pragma once
// Communicator: the collectives and point-to-point calls a rank makes, all asynchronous. Each call
// returns a Work handle; the tensor must stay untouched until the Work completes. Backends: MPI
// (host buffers, device buffers when MPI is CUDA-aware) and NCCL (device buffers, nccl.h).
//
// Every wait has a timeout (DTRAIN_COMM_TIMEOUT, default 300 s, 0 = none). On expiry the waiting
// rank asks its peers, on a side channel, which collective each one last entered, and reports the
// collective, its sequence number and the ranks that did not arrive; then the job aborts (or, with
// TimeoutAction::Throw, a CommTimeoutError is thrown). Each communicator keeps a flight recorder of
// its last collectives for the hang forensics and the desync check (forensics.h).
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"

namespace dtrain::comm {
namespace detail {
class FlightRecorder;
struct CollectiveCall;
}  // namespace detail

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);                // "sum"
ReduceOp reduce_op_from_name(const std::string& name);  // throws InputError naming the value

enum class TimeoutAction { Abort, Throw };

// How the MPI backend moves an allreduce of f32 host buffers (other dtypes, ops on device memory
// and the NCCL backend always take the library's own): mpi = MPI_Allreduce; shm = the ranks of one
// node through a shared-memory window; hier = shm within each node, MPI between the ranks of the
// same local rank on every node, shm again; auto = the faster of these for the message size and
// the layout (a table measured by `dtrain bench allreduce`, docs/comm.md). An algorithm the layout
// cannot run (shm over several nodes, hier over nodes of unequal rank counts) falls back to mpi.
enum class AllreduceAlgorithm { Auto, Mpi, Shm, Hier };
const char* allreduce_algorithm_name(AllreduceAlgorithm a);                 // "auto"
AllreduceAlgorithm allreduce_algorithm_from_name(const std::string& name);  // throws InputError

// What a peer answered when a wait timed out.
struct PeerStatus {
  int rank = -1;
  std::string host;  // MPI_Get_processor_name of that rank
  bool responded = false;
  int64_t entered = 0;    // sequence number of the last collective it entered (0: none yet)
  int64_t completed = 0;  // ... and of the last one it finished
  std::string current;    // e.g. "allreduce #17 f32[1024] sum"
};

class CommTimeoutError : public Error {
 public:
  CommTimeoutError(const std::string& message, std::vector<int> missing_ranks, const char* file, int line);
  // The ranks that did not arrive (for point-to-point: the peer).
  const std::vector<int>& missing_ranks() const { return missing_; }

 private:
  std::vector<int> missing_;
};

// The ranks' collective sequences differ: a rank skipped, added or changed a collective (the
// message names the communicator, the first differing collective and the ranks). Thrown on every
// rank by the next wait or check; collectives may be stuck in flight, so the job must end.
class DesyncError : public Error {
 public:
  DesyncError(const std::string& message, const char* file, int line);
};

// An operation in flight. Not thread-safe: one thread waits on a given Work.
class Work {
 public:
  virtual ~Work();
  // Non-blocking: true once complete. Throws the operation's error if it failed.
  virtual bool test() = 0;
  // Blocks until complete; timeout_s < 0 takes the communicator's timeout, 0 waits without limit.
  // Throws the operation's error if it failed; on timeout, see the file comment.
  virtual void wait(double timeout_s = -1) = 0;
  virtual bool completed() const = 0;
  virtual std::string error() const = 0;          // "" while pending or when it succeeded
  virtual std::string description() const = 0;    // "allreduce #17 f32[1024] sum on 'world'"
  virtual int64_t sequence() const { return 0; }  // collective sequence number; 0 for others
  // Completion on the device: makes the GPU stream `stream` (a cudaStream_t) wait for this
  // operation without blocking the host, where the backend can (NCCL: an event the stream waits
  // on). False where it cannot (MPI), and the caller waits on the host. Either way a later test()
  // or wait() still reports the operation's error or timeout.
  virtual bool order_stream(void* /*stream*/) { return false; }
};

// A Work that is already complete (nothing to communicate).
std::shared_ptr<Work> make_completed_work(std::string description);

// Calls on one communicator come from one thread at a time, in the same order on every rank (as
// with MPI collectives); use split() for a second stream of collectives.
class Communicator {
 public:
  static constexpr int kNoColor = -1;  // split(): this rank joins no new communicator

  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  virtual const char* backend() const = 0;  // "mpi", "nccl"
  // Whether buffers on `device` may be passed to this backend.
  virtual bool supports(Device device) const = 0;
  // Whether this backend moves buffers on `device` through host staging: each call copies its
  // device buffers into host memory (after the work the engine queued so far), communicates those,
  // and copies the results back when the Work completes (in test() or wait(), on the waiting
  // thread, before it queues more work). The MPI backend stages every device buffer: it is the
  // path for ranks that share a GPU (NCCL refuses them), builds without NCCL, and the simulated
  // device (Device::sim) that runs this same path on CPU ranks.
  virtual bool stages(Device /*device*/) const { return false; }

  // In place: every rank ends with op over all ranks' t. Avg divides the sum by size() (integer
  // types truncate). bf16/f16 are summed pairwise in fp32 and rounded once per step.
  std::shared_ptr<Work> allreduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
  std::shared_ptr<Work> broadcast(Tensor& t, int root);
  // out holds size() blocks of in.numel() elements, block r from rank r. In place where `in` is
  // this rank's block of `out` (the same memory).
  std::shared_ptr<Work> allgather(const Tensor& in, Tensor& out);
  // in holds size() blocks of out.numel() elements; rank r gets op over all ranks' block r.
  std::shared_ptr<Work> reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum);
  // Block r' of `in` (send_counts[r'] elements, blocks in rank order) goes to rank r', and block r'
  // of `out` (recv_counts[r'] elements) comes from rank r'; what r sends r' is what r' expects from r.
  // The MPI backend only.
  std::shared_ptr<Work> alltoallv(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                  const std::vector<int64_t>& recv_counts);
  std::shared_ptr<Work> send(const Tensor& t, int peer, int tag);
  std::shared_ptr<Work> recv(Tensor& t, int peer, int tag);  // t.nbytes() must match the send
  void barrier();                                            // with the timeout, like every wait
  // Collective: ranks with the same color form a new communicator, ordered by key then rank.
  // Returns nullptr on ranks passing kNoColor.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name = "");

  void set_timeout(double seconds) { timeout_s_ = seconds; }  // 0: no timeout
  double timeout() const { return timeout_s_; }
  void set_timeout_action(TimeoutAction a) { timeout_action_ = a; }
  TimeoutAction timeout_action() const { return timeout_action_; }
  int64_t collectives_issued() const { return collectives_issued_; }
  // Bytes this rank's collectives put on the wire so far, as a ring moves them (see wire_bytes in
  // communicator.cpp): what stages of sharding and compressors are compared by.
  int64_t wire_bytes_sent() const { return wire_bytes_; }
  // Inherited by split() communicators; the default comes from DTRAIN_ALLREDUCE.
  void set_allreduce_algorithm(AllreduceAlgorithm a) { allreduce_algorithm_ = a; }
  AllreduceAlgorithm allreduce_algorithm() const { return allreduce_algorithm_; }
  // What an allreduce of `t` by `op` runs as (never Auto). Collective on its first call that needs
  // the node layout: call it on every rank alike, as an allreduce.
  virtual AllreduceAlgorithm allreduce_plan(const Tensor& /*t*/, ReduceOp /*op*/) { return AllreduceAlgorithm::Mpi; }
  // Whether this communicator's collectives carry the trainer's step phase (forensics.h), which
  // lets the desync check name a rank that skipped one; split() passes it on. For the ranks that
  // run one trainer loop together: its world, while the trainer lives.
  void track_step_phases(bool on);

 protected:
  Communicator(int rank, int size, std::string name);

  virtual std::shared_ptr<Work> do_allreduce(Tensor& t, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_broadcast(Tensor& t, int root) = 0;
  virtual std::shared_ptr<Work> do_allgather(const Tensor& in, Tensor& out) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_alltoallv(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                             const std::vector<int64_t>& recv_counts);
  virtual std::shared_ptr<Work> do_send(const Tensor& t, int peer, int tag) = 0;
  virtual std::shared_ptr<Work> do_recv(Tensor& t, int peer, int tag) = 0;
  virtual std::shared_ptr<Work> do_barrier() = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) = 0;

  int64_t next_sequence() { return ++collectives_issued_; }
  // The collectives issued here, for the backend's control channel (start and end times).
  const std::shared_ptr<detail::FlightRecorder>& recorder() const { return recorder_; }
  double timeout_s_;
  TimeoutAction timeout_action_ = TimeoutAction::Abort;
  AllreduceAlgorithm allreduce_algorithm_;

 private:
  void check_buffer(const Tensor& t, const char* what, const char* call) const;
  Tensor host_side(const Tensor& t, bool with_contents) const;  // t, or its host copy where stages(t)
  // Runs the backend's call and records it (or skips it for the DTRAIN_TEST_SKIP_COLLECTIVE hook).
  std::shared_ptr<Work> issue(const detail::CollectiveCall& call, const std::function<std::shared_ptr<Work>()>& run);
  int64_t wire_bytes(const detail::CollectiveCall& call) const;

  int rank_, size_;
  std::string name_;
  int64_t collectives_issued_ = 0;
  int64_t wire_bytes_ = 0;
  std::shared_ptr<detail::FlightRecorder> recorder_;
};

// MPI backend over a duplicate of `comm` (collective over comm). Requires Runtime::init().
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name = "");
// The MPI communicator behind an MPI-backend Communicator; MPI_COMM_NULL for other backends.
MPI_Comm mpi_comm_of(const Communicator& c);

// The MPI datatype and op the MPI backend uses for a dtype (bf16/f16 travel as 16-bit words and
// reduce with dtrain's user-defined fp32-accumulating ops; Avg maps to the sum op). For code that
// calls MPI directly on the same buffers, e.g. a baseline. Requires Runtime::init().
MPI_Datatype mpi_datatype_of(DType t);
MPI_Op mpi_op_of(ReduceOp op, DType t);

// Runs `fn` on every rank of `comm` and makes the ranks agree on its outcome: an InputError or a
// DivergenceError thrown on some ranks only (a file one rank opens, a GPU count one host lacks, one
// rank's non-finite loss) becomes the same error, of the same kind, on every rank, with the message
// of the lowest failing rank, instead of ranks that return while the others wait for them in their
// next collective. Collective: every rank must call it.
void agree_on_inputs(Communicator& comm, const std::function<void()>& fn);

// Rank `root`'s `text` on every rank of `comm` (host memory; collective).
std::string broadcast_text(Communicator& comm, const std::string& text, int root = 0);

// The ranks of `c` grouped by node (collective over c): `node` holds the ranks of this rank's node,
// `cross` the ranks of this rank's local rank on every node (ordered by node). `uniform`: every node
// holds as many ranks of c. Nodes follow DTRAIN_TEST_RANKS_PER_NODE where that test hook is set.
struct NodeSplit {
  std::unique_ptr<Communicator> node, cross;
  bool uniform = true;
};
NodeSplit split_by_node(Communicator& c);

// One block of memory per node, shared by the node's ranks of a communicator (an MPI-3 shared
// window over split_by_node's node communicator; the node's local rank 0 holds it). Collective over
// `c` to make and to free. Writers synchronise through node().barrier().
class NodeSharedMemory {
 public:
  NodeSharedMemory(Communicator& c, size_t bytes, const std::string& name);
  ~NodeSharedMemory();
  NodeSharedMemory(const NodeSharedMemory&) = delete;
  NodeSharedMemory& operator=(const NodeSharedMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  Communicator& node() const { return *split_.node; }  // this rank's node: local rank and size

 private:
  NodeSplit split_;
  MPI_Win window_ = MPI_WIN_NULL;
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// nccl-tests' bandwidths for one collective of `bytes` per rank that took `seconds`:
// algBw = bytes / time; busBw = algBw * factor, factor 2(n-1)/n for allreduce,
// (n-1)/n for allgather and reduce_scatter (bytes = the full gathered size), 1 for broadcast.
double alg_bandwidth(double bytes, double seconds);  // bytes/s
double bus_bandwidth_factor(const std::string& collective, int ranks);

}  // namespace dtrain::comm

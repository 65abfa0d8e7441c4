#include "dtrain/comm/communicator.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <exception>
#include <numeric>

#include "algorithms/node_allreduce.h"
#include "control/flight_recorder.h"
#include "control/phase_deadline.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/env.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

ReduceOp reduce_op_from_name(const std::string& name) {
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min})
    if (name == reduce_op_name(op)) return op;
  DT_INPUT_CHECK(false, "unknown reduce op '" << name << "' (expected sum, avg, max or min)");
  __builtin_unreachable();
}

const char* allreduce_algorithm_name(AllreduceAlgorithm a) {
  switch (a) {
    case AllreduceAlgorithm::Auto:
      return "auto";
    case AllreduceAlgorithm::Mpi:
      return "mpi";
    case AllreduceAlgorithm::Shm:
      return "shm";
    case AllreduceAlgorithm::Hier:
      return "hier";
  }
  return "?";
}

AllreduceAlgorithm allreduce_algorithm_from_name(const std::string& name) {
  for (AllreduceAlgorithm a :
       {AllreduceAlgorithm::Auto, AllreduceAlgorithm::Mpi, AllreduceAlgorithm::Shm, AllreduceAlgorithm::Hier})
    if (name == allreduce_algorithm_name(a)) return a;
  DT_INPUT_CHECK(false, "unknown allreduce algorithm '" << name << "' (expected auto, mpi, shm or hier)");
  __builtin_unreachable();
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

namespace detail {
void throw_mpi_error(const char* call, int code, const char* file, int line) {
  // Name the function, not the whole argument list: "MPI_Bcast: MPI_ERR_ROOT: invalid root".
  std::string name(call);
  if (auto p = name.find('('); p != std::string::npos) name.resize(p);
  throw Error("mpi", name + " failed: " + mpi_error_string(code), file, line);
}
}  // namespace detail

CommTimeoutError::CommTimeoutError(const std::string& message, std::vector<int> missing_ranks, const char* file,
                                   int line)
    : Error("comm timeout", message, file, line), missing_(std::move(missing_ranks)) {}

Work::~Work() = default;

namespace {
class CompletedWork final : public Work {
 public:
  explicit CompletedWork(std::string d) : desc_(std::move(d)) {}
  bool test() override { return true; }
  void wait(double) override {}
  bool completed() const override { return true; }
  std::string error() const override { return ""; }
  std::string description() const override { return desc_; }

 private:
  std::string desc_;
};
}  // namespace

std::shared_ptr<Work> make_completed_work(std::string description) {
  return std::make_shared<CompletedWork>(std::move(description));
}

Communicator::Communicator(int rank, int size, std::string name)
    : timeout_s_(env::get_double("DTRAIN_COMM_TIMEOUT")),
      allreduce_algorithm_(allreduce_algorithm_from_name(env::get("DTRAIN_ALLREDUCE"))),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      recorder_(detail::make_flight_recorder(name_, rank_, size_)) {}

Communicator::~Communicator() = default;

void Communicator::check_buffer(const Tensor& t, const char* what, const char* call) const {
  DT_CHECK(t.defined(), call << ": " << what << " is an undefined tensor");
  DT_CHECK(supports(t.device()), call << ": the " << backend() << " backend on '" << name_ << "' cannot use " << what
                                      << " " << t.str() << " (device " << t.device().str() << ")");
  DT_CHECK(t.numel() <= INT_MAX, call << ": " << what << " " << t.str() << " has more than INT_MAX elements; "
                                      << "split it into buckets");
}

namespace {
// The DTRAIN_TEST_SKIP_COLLECTIVE hook ("RANK:COMM:STEP"): world rank RANK does not issue its first
// collective on communicator COMM in the body of step STEP, as if its code took another branch.
bool skipped_for_test(const std::string& comm, int64_t phase) {
  static const std::string hook = env::get("DTRAIN_TEST_SKIP_COLLECTIVE");
  static std::atomic<bool> done{false};
  if (hook.empty() || done.load() || !Runtime::initialized()) return false;
  const auto a = hook.find(':'), b = hook.rfind(':');
  if (a == b || std::stoi(hook.substr(0, a)) != Runtime::get().topology().rank ||
      hook.substr(a + 1, b - a - 1) != comm || phase != 1 + 2 * std::stoll(hook.substr(b + 1)))
    return false;
  return !done.exchange(true);
}
}  // namespace

// What a ring algorithm moves out of each rank for this call (nccl-tests' bus bytes): an allreduce
// 2 (n-1)/n of its buffer, a reduce-scatter (n-1)/n of its input, an allgather (n-1) blocks, a
// broadcast its buffer once. Counted on the wire's dtype, so bf16 transfers count half of f32's.
int64_t Communicator::wire_bytes(const detail::CollectiveCall& call) const {
  const int64_t n = size_;
  if (n <= 1) return 0;
  const int64_t bytes = call.count * static_cast<int64_t>(dtype_size(call.dtype));
  switch (call.kind) {
    case detail::CollectiveKind::Allreduce:
      return 2 * (n - 1) * bytes / n;
    case detail::CollectiveKind::ReduceScatter:
      return (n - 1) * bytes / n;
    case detail::CollectiveKind::Allgather:
      return (n - 1) * bytes;
    case detail::CollectiveKind::Broadcast:
      return bytes;
    default:
      return 0;
  }
}

std::shared_ptr<Work> Communicator::issue(const detail::CollectiveCall& call,
                                          const std::function<std::shared_ptr<Work>()>& run) {
  if (call.kind != detail::CollectiveKind::Split && skipped_for_test(name_, detail::current_phase()))
    return make_completed_work(std::string(detail::collective_kind_name(call.kind)) + " skipped on '" + name_ +
                               "' (DTRAIN_TEST_SKIP_COLLECTIVE)");
  const double t = detail::wall_s();
  const int64_t before = collectives_issued_;
  wire_bytes_ += wire_bytes(call);
  std::shared_ptr<Work> w = run();
  // A backend takes one sequence number per collective (NCCL's split takes none on itself).
  if (collectives_issued_ == before + 1) recorder_->issued(collectives_issued_, call, recorder_->phase_now(), t);
  return w;
}

// ---- host staging of device buffers (see Communicator::stages) ------------------------------------

namespace {
// A device buffer's host copy, made after the work its engine queued so far (copy_any orders it).
Tensor host_stage(const Tensor& t, bool with_contents) {
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  if (with_contents) copy_any(t, h);
  return h;
}

// The staged call's Work: completes with the host call, then copies the results back to the device.
class HostStagedWork final : public Work {
 public:
  using CopyBack = std::vector<std::pair<Tensor, Tensor>>;  // (host, device)
  HostStagedWork(std::shared_ptr<Work> inner, CopyBack back) : inner_(std::move(inner)), back_(std::move(back)) {}
  bool test() override {
    if (!inner_->test()) return false;
    copy_back();
    return true;
  }
  void wait(double timeout_s) override {
    inner_->wait(timeout_s);
    copy_back();
  }
  bool completed() const override { return inner_->completed() && back_.empty(); }
  std::string error() const override { return inner_->error(); }
  std::string description() const override { return inner_->description() + " (host-staged)"; }
  int64_t sequence() const override { return inner_->sequence(); }

 private:
  void copy_back() {
    for (auto& [host, device] : back_) copy_any(host, device);
    back_.clear();
  }
  std::shared_ptr<Work> inner_;
  CopyBack back_;
};

// What a staged call copies back: `host` into `device`, unless they are the one tensor (an output
// already on the host beside a staged input).
HostStagedWork::CopyBack results_back(const Tensor& host, const Tensor& device) {
  if (host.storage_id() == device.storage_id()) return {};
  return {{host, device}};
}
}  // namespace

// A tensor the host call can take: `t` itself on the host, else its staged host copy.
Tensor Communicator::host_side(const Tensor& t, bool with_contents) const {
  return stages(t.device()) ? host_stage(t, with_contents) : t;
}

std::shared_ptr<Work> Communicator::allreduce(Tensor& t, ReduceOp op) {
  check_buffer(t, "t", "allreduce");
  if (stages(t.device())) {
    Tensor h = host_stage(t, true);
    return std::make_shared<HostStagedWork>(allreduce(h, op), HostStagedWork::CopyBack{{h, t}});
  }
  return issue({detail::CollectiveKind::Allreduce, t.dtype(), t.numel(), static_cast<int32_t>(op)},
               [&] { return do_allreduce(t, op); });
}

std::shared_ptr<Work> Communicator::broadcast(Tensor& t, int root) {
  check_buffer(t, "t", "broadcast");
  DT_CHECK(root >= 0 && root < size_,
           "broadcast: root " << root << " is not a rank of '" << name_ << "' (size " << size_ << ")");
  if (stages(t.device())) {
    Tensor h = host_stage(t, rank_ == root);
    return std::make_shared<HostStagedWork>(broadcast(h, root), HostStagedWork::CopyBack{{h, t}});
  }
  return issue({detail::CollectiveKind::Broadcast, t.dtype(), t.numel(), root}, [&] { return do_broadcast(t, root); });
}

std::shared_ptr<Work> Communicator::allgather(const Tensor& in, Tensor& out) {
  check_buffer(in, "in", "allgather");
  check_buffer(out, "out", "allgather");
  DT_CHECK(in.dtype() == out.dtype(), "allgather: in " << in.str() << " and out " << out.str() << " differ in dtype");
  DT_CHECK(out.numel() == in.numel() * size_, "allgather: out " << out.str() << " must hold size() * in.numel() = "
                                                                << size_ << " * " << in.numel() << " elements");
  if (stages(in.device()) || stages(out.device())) {
    const Tensor hin = host_side(in, true);
    Tensor hout = host_side(out, false);
    return std::make_shared<HostStagedWork>(allgather(hin, hout), results_back(hout, out));
  }
  return issue({detail::CollectiveKind::Allgather, in.dtype(), in.numel(), 0}, [&] { return do_allgather(in, out); });
}

std::shared_ptr<Work> Communicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  check_buffer(in, "in", "reduce_scatter");
  check_buffer(out, "out", "reduce_scatter");
  DT_CHECK(in.dtype() == out.dtype(),
           "reduce_scatter: in " << in.str() << " and out " << out.str() << " differ in dtype");
  DT_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: in " << in.str() << " must hold size() * out.numel() = "
                                                                    << size_ << " * " << out.numel() << " elements");
  if (stages(in.device()) || stages(out.device())) {
    const Tensor hin = host_side(in, true);
    Tensor hout = host_side(out, false);
    return std::make_shared<HostStagedWork>(reduce_scatter(hin, hout, op), results_back(hout, out));
  }
  return issue({detail::CollectiveKind::ReduceScatter, in.dtype(), in.numel(), static_cast<int32_t>(op)},
               [&] { return do_reduce_scatter(in, out, op); });
}

std::shared_ptr<Work> Communicator::alltoallv(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                              const std::vector<int64_t>& recv_counts) {
  check_buffer(in, "in", "alltoallv");
  check_buffer(out, "out", "alltoallv");
  DT_CHECK(in.dtype() == out.dtype(), "alltoallv: in " << in.str() << " and out " << out.str() << " differ in dtype");
  const auto total = [](const std::vector<int64_t>& counts) {
    return std::accumulate(counts.begin(), counts.end(), int64_t{0});
  };
  DT_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_,
           "alltoallv: " << send_counts.size() << " send and " << recv_counts.size() << " receive counts for " << size_
                         << " ranks of '" << name_ << "'");
  DT_CHECK(total(send_counts) <= in.numel() && total(recv_counts) <= out.numel(),
           "alltoallv: in " << in.str() << " or out " << out.str() << " is smaller than its counts");
  if (stages(in.device()) || stages(out.device())) {
    const Tensor hin = host_side(in, true);
    Tensor hout = host_side(out, false);
    return std::make_shared<HostStagedWork>(alltoallv(hin, send_counts, hout, recv_counts), results_back(hout, out));
  }
  return issue({detail::CollectiveKind::Alltoall, in.dtype(), 0, 0},
               [&] { return do_alltoallv(in, send_counts, out, recv_counts); });
}

std::shared_ptr<Work> Communicator::do_alltoallv(const Tensor&, const std::vector<int64_t>&, Tensor&,
                                                 const std::vector<int64_t>&) {
  DT_CHECK(false, "alltoallv: the " << backend() << " backend on '" << name_ << "' does not offer it");
  return nullptr;
}

std::shared_ptr<Work> Communicator::send(const Tensor& t, int peer, int tag) {
  check_buffer(t, "t", "send");
  DT_CHECK(peer >= 0 && peer < size_ && peer != rank_,
           "send: peer " << peer << " is not another rank of '" << name_ << "' (size " << size_ << ")");
  DT_CHECK(tag >= 0 && tag < 32768, "send: tag " << tag << " is outside [0, 32767]");
  if (stages(t.device())) {
    Tensor h = host_stage(t, true);  // the Work keeps h alive until the send left it
    return std::make_shared<HostStagedWork>(send(h, peer, tag), HostStagedWork::CopyBack{});
  }
  return do_send(t, peer, tag);
}

std::shared_ptr<Work> Communicator::recv(Tensor& t, int peer, int tag) {
  check_buffer(t, "t", "recv");
  DT_CHECK(peer >= 0 && peer < size_ && peer != rank_,
           "recv: peer " << peer << " is not another rank of '" << name_ << "' (size " << size_ << ")");
  DT_CHECK(tag >= 0 && tag < 32768, "recv: tag " << tag << " is outside [0, 32767]");
  if (stages(t.device())) {
    Tensor h = host_stage(t, false);
    return std::make_shared<HostStagedWork>(recv(h, peer, tag), HostStagedWork::CopyBack{{h, t}});
  }
  return do_recv(t, peer, tag);
}

void Communicator::barrier() {
  issue({detail::CollectiveKind::Barrier, DType::U8, 0, 0}, [&] { return do_barrier(); })->wait();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  DT_CHECK(color >= 0 || color == kNoColor, "split: color " << color << " must be >= 0 or kNoColor");
  std::string n = name.empty() ? name_ + "/" + (color == kNoColor ? std::string("none") : std::to_string(color)) : name;
  std::unique_ptr<Communicator> sub;
  // Colours and keys differ between ranks by design: the record holds neither.
  issue({detail::CollectiveKind::Split, DType::U8, 0, 0}, [&] {
    sub = do_split(color, key, n);
    return make_completed_work("split");
  });
  if (sub) sub->track_step_phases(recorder_->tracks_phases());
  return sub;
}

NodeSplit split_by_node(Communicator& c) {
  NodeSplit s;
  s.node = c.split(detail::node_color(), c.rank(), c.name() + "/node");
  s.cross = c.split(s.node->rank(), c.rank(), c.name() + "/cross");
  Tensor sizes = Tensor::empty({2}, DType::I32);  // max of L and of -L: equal when uniform
  sizes.data<int32_t>()[0] = s.node->size();
  sizes.data<int32_t>()[1] = -s.node->size();
  c.allreduce(sizes, ReduceOp::Max)->wait();
  s.uniform = sizes.data<int32_t>()[0] == -sizes.data<int32_t>()[1];
  return s;
}
NodeSharedMemory::NodeSharedMemory(Communicator& c, size_t bytes, const std::string& name)
    : split_(split_by_node(c)), bytes_(bytes) {
  const MPI_Comm node = mpi_comm_of(*split_.node);
  DT_CHECK(node != MPI_COMM_NULL, "node-shared memory for " << name << " needs MPI communicators");
  void* base = nullptr;
  const MPI_Aint mine = split_.node->rank() == 0 ? static_cast<MPI_Aint>(std::max<size_t>(bytes, 1)) : 0;
  detail::PhaseDeadline deadline("creating the node-shared window of " + name);
  DT_MPI_CHECK(MPI_Win_allocate_shared(mine, 1, MPI_INFO_NULL, node, &base, &window_));
  MPI_Aint size = 0;
  int unit = 0;
  DT_MPI_CHECK(MPI_Win_shared_query(window_, 0, &size, &unit, &base));
  data_ = static_cast<uint8_t*>(base);
}

NodeSharedMemory::~NodeSharedMemory() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // MPI_Win_free waits for the node's other ranks: while an error unwinds this rank alone they may
  // never come, so the window is left to MPI's end.
  if (finalized || window_ == MPI_WIN_NULL || std::uncaught_exceptions() > 0) return;
  detail::PhaseDeadline deadline("freeing a node-shared window");
  MPI_Win_free(&window_);
}

void Communicator::track_step_phases(bool on) { recorder_->track_phases(on); }

double alg_bandwidth(double bytes, double seconds) { return seconds > 0 ? bytes / seconds : 0.0; }

double bus_bandwidth_factor(const std::string& collective, int ranks) {
  double n = ranks;
  if (ranks <= 1) return 1.0;
  if (collective == "allreduce") return 2.0 * (n - 1) / n;
  if (collective == "allgather" || collective == "reduce_scatter") return (n - 1) / n;
  return 1.0;  // broadcast, reduce, send/recv
}

void agree_on_inputs(Communicator& comm, const std::function<void()>& fn) {
  // The failure's kind travels with its message: 0 none, 1 InputError, 2 DivergenceError.
  std::string error;
  int64_t kind = 0;
  try {
    fn();
  } catch (const InputError& e) {
    error = e.what();
    kind = 1;
  } catch (const DivergenceError& e) {
    error = e.what();
    kind = 2;
  }
  auto rethrow = [](int64_t k, const std::string& what) {
    if (k == 2) throw DivergenceError(what);
    throw InputError(what);
  };
  if (comm.size() == 1) {
    if (kind != 0) rethrow(kind, error);
    return;
  }
  Tensor first = Tensor::empty({1}, DType::I32);
  first.data<int32_t>()[0] = kind == 0 ? comm.size() : comm.rank();
  comm.allreduce(first, ReduceOp::Min)->wait();
  int root = first.data<int32_t>()[0];
  if (root == comm.size()) return;
  Tensor head = Tensor::empty({1}, DType::I64);  // the failure's kind
  head.data<int64_t>()[0] = kind;
  comm.broadcast(head, root)->wait();
  rethrow(head.data<int64_t>()[0], broadcast_text(comm, error, root));
}

std::string broadcast_text(Communicator& comm, const std::string& text, int root) {
  if (comm.size() == 1) return text;
  Tensor len = Tensor::empty({1}, DType::I64);
  len.data<int64_t>()[0] = static_cast<int64_t>(text.size());
  comm.broadcast(len, root)->wait();
  const int64_t n = len.data<int64_t>()[0];
  Tensor bytes = Tensor::zeros({std::max<int64_t>(n, 1)}, DType::U8);
  if (comm.rank() == root) std::memcpy(bytes.raw(), text.data(), text.size());
  comm.broadcast(bytes, root)->wait();
  return std::string(static_cast<const char*>(bytes.raw()), static_cast<size_t>(n));
}

}  // namespace dtrain::comm

#include "backends/mpi_communicator.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <set>
#include <sstream>

#include "backends/mpi_types.h"
#include "control/phase_deadline.h"
#include "control/sequence_check.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm {
namespace detail {
namespace {

// Leaked on purpose: communicators may be destroyed from other static destructors at exit (the
// runtime's), after a plain static set would already be gone.
std::mutex& live_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::set<MpiCommunicator*>& live() {
  static auto* s = new std::set<MpiCommunicator*>;
  return *s;
}
std::atomic<uint64_t> communicators_made{0};

int comm_rank(MPI_Comm c) {
  int r = 0;
  DT_MPI_CHECK(MPI_Comm_rank(c, &r));
  return r;
}
int comm_size(MPI_Comm c) {
  int s = 0;
  DT_MPI_CHECK(MPI_Comm_size(c, &s));
  return s;
}
bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}
// "f32[1024]"
std::string buf_str(const Tensor& t) { return std::string(dtype_name(t.dtype())) + shape_str(t.shape()); }

}  // namespace

// ---- MpiWork ---------------------------------------------------------------------------------

MpiWork::MpiWork(Kind kind, std::string desc, int64_t seq, int peer, std::shared_ptr<ControlChannel> channel,
                 double timeout_s, TimeoutAction action)
    : kind_(kind),
      desc_(std::move(desc)),
      seq_(seq),
      peer_(peer),
      channel_(std::move(channel)),
      timeout_s_(timeout_s),
      action_(action) {}

MpiWork::~MpiWork() {
  // A point-to-point Work dropped while in flight: MPI finishes it on its own; the buffer it
  // still uses may then be freed early, which is the caller's error, as with a raw MPI_Request.
  if (kind_ != Kind::Collective && request != MPI_REQUEST_NULL && !mpi_finalized()) MPI_Request_free(&request);
}

void MpiWork::complete(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    err_ = err;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void MpiWork::run_body() {
  std::exception_ptr err;
  try {
    body();
  } catch (...) {
    err = std::current_exception();
  }
  body = nullptr;  // drops the tensors it captured
  complete(err);
}

bool MpiWork::poll() {
  if (done_.load(std::memory_order_acquire)) return true;
  std::unique_lock<std::mutex> lock(req_mu_, std::try_to_lock);
  if (!lock.owns_lock() || request == MPI_REQUEST_NULL) return done_.load(std::memory_order_acquire);
  int flag = 0;
  MPI_Status st;
  int rc = MPI_Test(&request, &flag, &st);
  if (rc != MPI_SUCCESS) {
    try {
      detail::throw_mpi_error(kind_ == Kind::Send ? "MPI_Isend" : "MPI_Irecv", rc, __FILE__, __LINE__);
    } catch (...) {
      complete(std::current_exception());
    }
    return true;
  }
  if (!flag) return false;
  std::exception_ptr err;
  if (kind_ == Kind::Recv) {
    int count = 0;
    MPI_Get_count(&st, mpi_datatype(buffer.dtype()), &count);
    if (count != buffer.numel()) {
      try {
        DT_CHECK(false, desc_ << ": received " << count << " elements, expected " << buffer.numel()
                              << " (the sender's tensor differs in size)");
      } catch (...) {
        err = std::current_exception();
      }
    }
  }
  buffer = Tensor();
  complete(err);
  return true;
}

void MpiWork::rethrow_if_failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (err_) std::rethrow_exception(err_);
}

std::string MpiWork::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!err_) return "";
  try {
    std::rethrow_exception(err_);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

bool MpiWork::test() {
  bool done = kind_ == Kind::Collective ? completed() : poll();
  if (done) rethrow_if_failed();
  return done;
}

void MpiWork::wait(double timeout_s) {
  const double limit = timeout_s < 0 ? timeout_s_ : timeout_s;
  WaitClock clock;  // a stop of the whole job (SIGSTOP, scontrol suspend) does not count
  StallWatch stall(limit);  // a desync found by any rank ends the wait; a long one asks for a check
  const auto ran_out = [&] { return limit > 0 && clock.waited() >= limit; };
  if (kind_ == Kind::Collective) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_.load(std::memory_order_acquire)) {
      if (ran_out()) {
        lock.unlock();
        on_timeout(limit, clock.waited());
      }
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (!done_.load(std::memory_order_acquire)) stall.tick(clock.waited());
    }
  } else {
    // Periodic testing: the waiter drives the transfer (the worker also polls when idle).
    // Spin briefly (latency), then back off to 50 us sleeps (a long pipeline bubble should not
    // burn a core).
    for (int polls = 0; !poll(); ++polls) {
      if (ran_out()) on_timeout(limit, clock.waited());
      if (polls >= 2000) stall.tick(clock.waited());
      if (polls < 2000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  rethrow_if_failed();
}

void MpiWork::on_timeout(double limit_s, double waited_s) {
  bool can_query = control_service_running();
  double grace = std::clamp(limit_s / 4, 0.5, 3.0);
  std::vector<PeerStatus> peers = can_query ? channel_->query(grace) : std::vector<PeerStatus>{};
  std::string what = desc_;
  int64_t target = seq_;
  if (kind_ == Kind::Collective) {
    PeerStatus self = channel_->self_status();
    if (self.completed + 1 < seq_) {
      // Work queued behind an older collective that is itself stuck: report on that one.
      target = self.completed + 1;
      what += " (queued behind collective #" + std::to_string(target) + ", " + self.current + ")";
    }
  }
  std::vector<int> missing;
  std::string report = format_timeout_report(what, channel_->size(), target, kind_ == Kind::Collective ? -1 : peer_,
                                             waited_s, grace, peers, can_query, &missing);
  if (action_ == TimeoutAction::Abort) {
    report += channel_->hang_forensics(report, kind_ == Kind::Collective ? target : 0, peers, grace);
    // Every waiting rank times out at about the same moment; the lowest one that answered aborts
    // first (see abort_job).
    int before_me = 0;
    for (const PeerStatus& p : peers)
      if (p.rank < channel_->rank() && p.responded) ++before_me;
    abort_job(1, "comm timeout: " + report + "\naborting the job", std::min(2.0, 0.25 * before_me));
  }
  if (kind_ != Kind::Collective) {
    // A timed-out point-to-point call is cancelled, so the communicator stays usable.
    std::lock_guard<std::mutex> lock(req_mu_);
    if (request != MPI_REQUEST_NULL) {
      MPI_Cancel(&request);
      int flag = 0;
      double until = now_s() + 1.0;
      while (!flag && now_s() < until && MPI_Test(&request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS) {
      }
      if (!flag && request != MPI_REQUEST_NULL) MPI_Request_free(&request);
      request = MPI_REQUEST_NULL;
    }
    try {
      throw CommTimeoutError(report + " (cancelled)", missing, __FILE__, __LINE__);
    } catch (...) {
      complete(std::current_exception());
    }
  }
  throw CommTimeoutError(report, missing, __FILE__, __LINE__);
}

// ---- MpiCommunicator -------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, bool threaded)
    : Communicator(comm_rank(comm), comm_size(comm), std::move(name)),
      comm_(comm),
      threaded_(threaded),
      creation_index_(communicators_made++) {
  channel_ = std::make_shared<ControlChannel>(comm_, this->name(), recorder());
  if (threaded_) {
    control_service_add(channel_);
    worker_ = std::thread([this] { worker_loop(); });
  }
  std::lock_guard<std::mutex> lock(live_mu());
  live().insert(this);
}

MpiCommunicator::~MpiCommunicator() { shutdown(); }

void MpiCommunicator::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!queue_.empty()) {
      std::shared_ptr<MpiWork> w = std::move(queue_.front());
      queue_.pop_front();
      running_op_ = true;
      lock.unlock();
      channel_->note_entered(w->sequence(), w->description());
      w->run_body();
      channel_->note_completed(w->sequence());
      lock.lock();
      running_op_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
      continue;
    }
    if (stop_) return;
    std::erase_if(p2p_, [](const std::weak_ptr<MpiWork>& p) {
      auto w = p.lock();
      return !w || w->completed();
    });
    if (p2p_.empty()) {
      cv_.wait(lock, [this] { return !queue_.empty() || stop_ || !p2p_.empty(); });
      continue;
    }
    // Point-to-point transfers in flight and nothing queued: drive them, e.g. a rendezvous send
    // whose receiver posted late, while the caller computes.
    std::vector<std::weak_ptr<MpiWork>> pending = p2p_;
    lock.unlock();
    for (auto& p : pending)
      if (auto w = p.lock()) w->poll();
    lock.lock();
    cv_.wait_for(lock, std::chrono::microseconds(200), [this] { return !queue_.empty() || stop_; });
  }
}

std::shared_ptr<MpiWork> MpiCommunicator::collective(const std::string& what, std::function<void()> body) {
  DT_CHECK(!shut_, what << " on '" << name() << "' after the communicator was shut down");
  int64_t seq = next_sequence();
  std::string desc = what.substr(0, what.find(' ')) + " #" + std::to_string(seq) +
                     (what.find(' ') == std::string::npos ? "" : what.substr(what.find(' '))) + " on '" + name() + "'";
  auto w = std::make_shared<MpiWork>(MpiWork::Kind::Collective, desc, seq, -1, channel_, timeout_s_, timeout_action_);
  w->body = std::move(body);
  if (!threaded_) {
    channel_->note_entered(seq, desc);
    w->run_body();
    channel_->note_completed(seq);
    return w;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(w);
  }
  cv_.notify_one();
  return w;
}

// Least message (bytes per rank) from which auto leaves MPI_Allreduce, by layout; measured with
// `dtrain bench allreduce --allreduce mpi|shm|hier` (docs/comm.md).
constexpr int64_t kAutoShmFromBytes = 64 << 10;
constexpr int64_t kAutoHierFromBytes = 1 << 20;

NodeAllreduce& MpiCommunicator::node_layout() {
  if (!node_) {
    auto made = std::make_shared<std::unique_ptr<NodeAllreduce>>();
    MPI_Comm c = comm_;
    // Twice the communicator's timeout: a barrier that waits as long as the collective's waiter
    // would race it, and when it won (seen under TSan with a rank gone), a bare "did not reach the
    // barrier" error replaced the timeout report that names the missing ranks.
    double timeout = 2 * timeout_s_;
    collective("node_layout", [c, timeout, made] { *made = std::make_unique<NodeAllreduce>(c, timeout); })->wait();
    node_ = std::move(*made);
  }
  return *node_;
}

bool MpiCommunicator::window_may_take(int64_t bytes) const {
  const AllreduceAlgorithm want = allreduce_algorithm();
  if (want == AllreduceAlgorithm::Mpi || size() == 1) return false;
  return want != AllreduceAlgorithm::Auto || bytes >= kAutoShmFromBytes;
}

AllreduceAlgorithm MpiCommunicator::allreduce_plan(const Tensor& t, ReduceOp /*op: all four run on f32*/) {
  const AllreduceAlgorithm want = allreduce_algorithm();
  if (t.dtype() != DType::F32 || !window_may_take(static_cast<int64_t>(t.nbytes()))) return AllreduceAlgorithm::Mpi;
  const NodeAllreduce& layout = node_layout();
  const bool one_node = layout.node_count() == 1;
  const bool hier_fits = !one_node && layout.uniform() && layout.local_size() > 1;
  switch (want) {
    case AllreduceAlgorithm::Shm:
      return one_node ? AllreduceAlgorithm::Shm : AllreduceAlgorithm::Mpi;
    case AllreduceAlgorithm::Hier:
      return one_node ? AllreduceAlgorithm::Shm : hier_fits ? AllreduceAlgorithm::Hier : AllreduceAlgorithm::Mpi;
    default:
      if (one_node) return AllreduceAlgorithm::Shm;
      return hier_fits && t.nbytes() >= kAutoHierFromBytes ? AllreduceAlgorithm::Hier : AllreduceAlgorithm::Mpi;
  }
}

std::shared_ptr<Work> MpiCommunicator::do_allreduce(Tensor& t, ReduceOp op) {
  MPI_Comm c = comm_;
  int n = size();
  const AllreduceAlgorithm algorithm = allreduce_plan(t, op);
  std::string what = "allreduce " + buf_str(t) + " " + reduce_op_name(op);
  if (algorithm != AllreduceAlgorithm::Mpi) {
    NodeAllreduce* layout = node_.get();
    const bool across_nodes = algorithm == AllreduceAlgorithm::Hier;
    auto body = [t, op, n, layout, across_nodes] {
      layout->allreduce(static_cast<float*>(t.raw()), t.numel(), op, across_nodes, n);
    };
    return collective(what + " " + allreduce_algorithm_name(algorithm), std::move(body));
  }
  auto body = [t, op, c, n] {
    DT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.raw(), static_cast<int>(t.numel()), mpi_datatype(t.dtype()),
                               mpi_op(op, t.dtype()), c));
    if (op == ReduceOp::Avg) divide_by(t.raw(), t.numel(), t.dtype(), n);
  };
  return collective(what, std::move(body));
}

std::shared_ptr<Work> MpiCommunicator::do_broadcast(Tensor& t, int root) {
  MPI_Comm c = comm_;
  auto body = [t, root, c] {
    DT_MPI_CHECK(MPI_Bcast(t.raw(), static_cast<int>(t.numel()), mpi_datatype(t.dtype()), root, c));
  };
  return collective("broadcast " + buf_str(t) + " root " + std::to_string(root), std::move(body));
}

bool MpiCommunicator::on_node_window(int64_t bytes) {
  return window_may_take(bytes) && node_layout().node_count() == 1;
}

std::shared_ptr<Work> MpiCommunicator::do_allgather(const Tensor& in, Tensor& out) {
  if (on_node_window(static_cast<int64_t>(out.nbytes()))) {
    NodeAllreduce* layout = node_.get();
    auto body = [in, out, layout] { layout->allgather(in.raw(), out.raw(), static_cast<int64_t>(in.nbytes())); };
    return collective("allgather " + buf_str(in) + " shm", std::move(body));
  }
  MPI_Comm c = comm_;
  const bool in_place = in.raw() == static_cast<char*>(out.raw()) + rank() * in.nbytes();
  auto body = [in, out, c, in_place] {
    MPI_Datatype dt = mpi_datatype(in.dtype());
    int n = static_cast<int>(in.numel());
    DT_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : in.raw(), n, dt, out.raw(), n, dt, c));
  };
  return collective("allgather " + buf_str(in), std::move(body));
}

std::shared_ptr<Work> MpiCommunicator::do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  int n = size();
  if (in.dtype() == DType::F32 && on_node_window(static_cast<int64_t>(in.nbytes()))) {
    NodeAllreduce* layout = node_.get();
    auto body = [in, out, op, n, layout] {
      layout->reduce_scatter(static_cast<const float*>(in.raw()), static_cast<float*>(out.raw()), out.numel(), op, n);
    };
    return collective("reduce_scatter " + buf_str(in) + " " + reduce_op_name(op) + " shm", std::move(body));
  }
  MPI_Comm c = comm_;
  auto body = [in, out, op, c, n] {
    DT_MPI_CHECK(MPI_Reduce_scatter_block(in.raw(), out.raw(), static_cast<int>(out.numel()), mpi_datatype(in.dtype()),
                                          mpi_op(op, in.dtype()), c));
    if (op == ReduceOp::Avg) divide_by(out.raw(), out.numel(), out.dtype(), n);
  };
  return collective("reduce_scatter " + buf_str(in) + " " + reduce_op_name(op), std::move(body));
}

std::shared_ptr<Work> MpiCommunicator::do_alltoallv(const Tensor& in, const std::vector<int64_t>& send_counts,
                                                    Tensor& out, const std::vector<int64_t>& recv_counts) {
  MPI_Comm c = comm_;
  // MPI counts and displacements are ints: the displacements of the last block must fit too.
  const auto as_ints = [this](const std::vector<int64_t>& counts, std::vector<int>& ints, std::vector<int>& displs) {
    int64_t at = 0;
    for (int64_t n : counts) {
      DT_CHECK(at + n <= INT_MAX, "alltoallv on '" << name() << "': " << at + n << " elements exceed INT_MAX");
      ints.push_back(static_cast<int>(n));
      displs.push_back(static_cast<int>(at));
      at += n;
    }
  };
  auto plan = std::make_shared<std::array<std::vector<int>, 4>>();  // send counts, displs, recv counts, displs
  as_ints(send_counts, (*plan)[0], (*plan)[1]);
  as_ints(recv_counts, (*plan)[2], (*plan)[3]);
  auto body = [in, out, plan, c] {
    MPI_Datatype dt = mpi_datatype(in.dtype());
    auto& p = *plan;
    DT_MPI_CHECK(MPI_Alltoallv(in.raw(), p[0].data(), p[1].data(), dt, out.raw(), p[2].data(), p[3].data(), dt, c));
  };
  return collective("alltoallv " + buf_str(in), std::move(body));
}

std::shared_ptr<Work> MpiCommunicator::do_barrier() {
  MPI_Comm c = comm_;
  return collective("barrier", [c] { DT_MPI_CHECK(MPI_Barrier(c)); });
}

std::shared_ptr<MpiWork> MpiCommunicator::point_to_point(MpiWork::Kind kind, const Tensor& t, int peer, int tag) {
  DT_CHECK(!shut_, "send/recv on '" << name() << "' after the communicator was shut down");
  bool is_send = kind == MpiWork::Kind::Send;
  std::ostringstream desc;
  desc << (is_send ? "send" : "recv") << " #" << ++p2p_count_ << " " << buf_str(t) << (is_send ? " to" : " from")
       << " rank " << peer << " tag " << tag << " on '" << name() << "'";
  auto w = std::make_shared<MpiWork>(kind, desc.str(), 0, peer, channel_, timeout_s_, timeout_action_);
  w->buffer = t;
  int n = static_cast<int>(t.numel());
  MPI_Datatype dt = mpi_datatype(t.dtype());
  if (is_send)
    DT_MPI_CHECK(MPI_Isend(t.raw(), n, dt, peer, tag, comm_, &w->request));
  else
    DT_MPI_CHECK(MPI_Irecv(t.raw(), n, dt, peer, tag, comm_, &w->request));
  if (threaded_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      p2p_.push_back(w);
    }
    cv_.notify_one();
  }
  return w;
}

std::shared_ptr<Work> MpiCommunicator::do_send(const Tensor& t, int peer, int tag) {
  return point_to_point(MpiWork::Kind::Send, t, peer, tag);
}

std::shared_ptr<Work> MpiCommunicator::do_recv(Tensor& t, int peer, int tag) {
  return point_to_point(MpiWork::Kind::Recv, t, peer, tag);
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key, const std::string& name) {
  // MPI_Comm_split is a collective on comm_, so it goes through the queue like the others.
  auto result = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  MPI_Comm c = comm_;
  int mpi_color = color == kNoColor ? MPI_UNDEFINED : color;
  collective("split color " + std::to_string(color) + " key " + std::to_string(key), [c, mpi_color, key, result] {
    DT_MPI_CHECK(MPI_Comm_split(c, mpi_color, key, result.get()));
  })->wait();
  if (*result == MPI_COMM_NULL) return nullptr;
  DT_MPI_CHECK(MPI_Comm_set_errhandler(*result, MPI_ERRORS_RETURN));
  auto sub = std::make_unique<MpiCommunicator>(*result, name, threaded_);
  sub->set_allreduce_algorithm(allreduce_algorithm());
  sub->set_timeout(timeout_s_);
  sub->set_timeout_action(timeout_action_);
  return sub;
}

void MpiCommunicator::shutdown() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (shut_) return;
    shut_ = true;
    if (threaded_ && !desync_noted()) {  // after a desync they may never match: the job ends anyway
      // Let queued collectives finish (peers are issuing the same ones), within the timeout.
      auto done = [this] { return queue_.empty() && !running_op_; };
      if (timeout_s_ > 0)
        idle_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_), done);
      else
        idle_cv_.wait(lock, done);
    }
    stop_ = true;
  }
  cv_.notify_all();
  bool stuck = false;
  if (worker_.joinable()) {
    std::lock_guard<std::mutex> lock(mu_);
    stuck = running_op_ || !queue_.empty();
  }
  if (worker_.joinable()) {
    if (stuck)
      worker_.detach();  // blocked inside MPI for good; the job is going down anyway
    else
      worker_.join();
  }
  control_service_remove(channel_.get());
  if (!stuck) {
    node_.reset();  // MPI_Win_free synchronises the node: every rank frees in creation order
    channel_->release();
    if (!mpi_finalized()) MPI_Comm_free(&comm_);
  }
  std::lock_guard<std::mutex> lock(live_mu());
  live().erase(this);
}

void shutdown_all_mpi_communicators() {
  std::vector<MpiCommunicator*> all;
  {
    std::lock_guard<std::mutex> lock(live_mu());
    all.assign(live().begin(), live().end());
  }
  // Newest first, in the same order on every rank (a window's free waits for the whole node).
  std::sort(all.begin(), all.end(), [](const MpiCommunicator* a, const MpiCommunicator* b) {
    return a->creation_index() > b->creation_index();
  });
  for (MpiCommunicator* c : all) c->shutdown();
}

}  // namespace detail

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name) {
  DT_CHECK(Runtime::initialized(), "make_mpi_communicator: call dtrain::comm::Runtime::init() first");
  MPI_Comm dup = MPI_COMM_NULL;
  {  // collective: a rank that died or never came would wait it forever
    detail::PhaseDeadline deadline("creating communicator '" + name + "' (MPI_Comm_dup)");
    DT_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  }
  DT_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  return std::make_unique<detail::MpiCommunicator>(dup, name.empty() ? std::string("comm") : name,
                                                   Runtime::get().threaded_progress());
}

MPI_Datatype mpi_datatype_of(DType t) { return detail::mpi_datatype(t); }
MPI_Op mpi_op_of(ReduceOp op, DType t) { return detail::mpi_op(op, t); }

MPI_Comm mpi_comm_of(const Communicator& c) {
  auto* m = dynamic_cast<const detail::MpiCommunicator*>(&c);
  return m ? m->mpi_comm() : MPI_COMM_NULL;
}

}  // namespace dtrain::comm

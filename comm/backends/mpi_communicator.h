#pragma once
// MPI backend. Collectives are queued, in the order the caller issues them, to one worker thread
// per communicator that makes the blocking MPI call (MPI_Allreduce, MPI_Bcast, ...). Measured on
// Open MPI 4.1 (see docs/comm.md): the blocking collectives run the tuned algorithms, about 1.8x
// faster at 64 MiB than MPI_Iallreduce (libnbc), and a thread inside MPI gives the overlap that
// MPI_Iallreduce only gets when the caller keeps calling MPI_Test. Point-to-point calls are posted
// at once (MPI_Isend/MPI_Irecv, so pipeline stages cannot deadlock behind a queued collective) and
// polled by the waiter, and by the worker when it is idle. Without MPI_THREAD_MULTIPLE every call
// runs on the caller's thread.
#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/node_allreduce.h"
#include "control/control_channel.h"
#include "dtrain/comm/communicator.h"

namespace dtrain::comm::detail {

class MpiWork final : public Work {
 public:
  enum class Kind { Collective, Send, Recv };
  MpiWork(Kind kind, std::string desc, int64_t seq, int peer, std::shared_ptr<ControlChannel> channel, double timeout_s,
          TimeoutAction action);
  ~MpiWork() override;

  bool test() override;
  void wait(double timeout_s = -1) override;
  bool completed() const override { return done_.load(std::memory_order_acquire); }
  std::string error() const override;
  std::string description() const override { return desc_; }
  int64_t sequence() const override { return seq_; }

  // --- used by the backend
  Kind kind() const { return kind_; }
  std::function<void()> body;  // collectives: the blocking MPI call and any post-processing
  Tensor buffer;               // point-to-point: kept alive while in flight
  MPI_Request request = MPI_REQUEST_NULL;
  void run_body();  // runs body, records any exception, completes
  bool poll();      // point-to-point: one MPI_Test (skipped if another thread is testing)

 private:
  void complete(std::exception_ptr err);
  void rethrow_if_failed() const;
  [[noreturn]] void on_timeout(double limit_s, double waited_s);

  Kind kind_;
  std::string desc_;
  int64_t seq_;
  int peer_;
  std::shared_ptr<ControlChannel> channel_;
  double timeout_s_;
  TimeoutAction action_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr err_;
  std::mutex req_mu_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`, a private duplicate.
  MpiCommunicator(MPI_Comm comm, std::string name, bool threaded);
  ~MpiCommunicator() override;

  const char* backend() const override { return "mpi"; }
  bool supports(Device) const override { return true; }  // device buffers through host staging
  bool stages(Device device) const override { return !device.is_cpu(); }
  AllreduceAlgorithm allreduce_plan(const Tensor& t, ReduceOp op) override;
  MPI_Comm mpi_comm() const { return comm_; }
  uint64_t creation_index() const { return creation_index_; }
  const std::shared_ptr<ControlChannel>& channel() const { return channel_; }
  // Finishes the queued work, stops the worker, frees the MPI objects. Idempotent.
  void shutdown();

 protected:
  std::shared_ptr<Work> do_allreduce(Tensor& t, ReduceOp op) override;
  std::shared_ptr<Work> do_broadcast(Tensor& t, int root) override;
  std::shared_ptr<Work> do_allgather(const Tensor& in, Tensor& out) override;
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  std::shared_ptr<Work> do_alltoallv(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                     const std::vector<int64_t>& recv_counts) override;
  std::shared_ptr<Work> do_send(const Tensor& t, int peer, int tag) override;
  std::shared_ptr<Work> do_recv(Tensor& t, int peer, int tag) override;
  std::shared_ptr<Work> do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;

 private:
  std::shared_ptr<MpiWork> collective(const std::string& what, std::function<void()> body);
  std::shared_ptr<MpiWork> point_to_point(MpiWork::Kind kind, const Tensor& t, int peer, int tag);
  void worker_loop();
  NodeAllreduce& node_layout();  // made by a collective on first use
  // Whether a reduce-scatter or allgather of `bytes` runs through the node's shared-memory window:
  // on one node, where the allreduce algorithm would take it (not mpi; auto from its threshold).
  bool on_node_window(int64_t bytes);
  // Whether the algorithm lets `bytes` leave MPI at all (not mpi, several ranks, auto from its
  // threshold): what allreduce_plan and on_node_window both ask first.
  bool window_may_take(int64_t bytes) const;

  MPI_Comm comm_;
  std::shared_ptr<ControlChannel> channel_;
  bool threaded_ = false;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::shared_ptr<MpiWork>> queue_;
  std::vector<std::weak_ptr<MpiWork>> p2p_;  // posted, not yet seen complete
  bool running_op_ = false;
  bool stop_ = false;
  bool shut_ = false;
  int64_t p2p_count_ = 0;
  std::unique_ptr<NodeAllreduce> node_;  // the node layout and shared window of shm / hier
  uint64_t creation_index_;              // the same on every rank of an SPMD program: orders shutdown
};

// Called by Runtime::finalize: shuts down every MPI communicator still alive.
void shutdown_all_mpi_communicators();

}  // namespace dtrain::comm::detail

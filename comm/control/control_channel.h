#pragma once
// The side channel that makes a timeout say who is missing. Each communicator owns one: a private
// duplicate of its MPI communicator on which the runtime's control thread answers "which
// collective did you last enter?" from peers. A waiter that times out asks every peer, waits a
// short grace period, and reports the ranks that never answered (exited, finalised, hung outside
// MPI progress) and those that answered with an older sequence number (late, or stuck elsewhere).
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"

namespace dtrain::comm::detail {

class ControlChannel {
 public:
  // Duplicates `comm` and gathers every rank's host name (collective over it).
  ControlChannel(MPI_Comm comm, std::string comm_name);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& comm_name() const { return name_; }

  void note_entered(int64_t seq, const std::string& what);
  void note_completed(int64_t seq);
  PeerStatus self_status() const;

  // Asks every other rank for its status; waits at most grace_s for the answers. Index = rank.
  std::vector<PeerStatus> query(double grace_s);
  // Answers the queries that arrived; called by the control thread (thread-safe).
  void serve();
  // Frees the duplicate; afterwards serve() and query() do nothing. Idempotent.
  void release();

 private:
  MPI_Comm ctrl_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::string name_;
  std::vector<std::string> hosts_;  // index = rank
  mutable std::mutex state_mu_;
  int64_t entered_ = 0, completed_ = 0;
  std::string current_ = "idle";
  std::mutex serve_mu_;  // one server at a time, and no release() during a serve()
  struct PendingReply;
  std::vector<std::unique_ptr<PendingReply>> replies_;  // answers still being sent
  std::vector<std::unique_ptr<char[]>> abandoned_;      // buffers of requests we gave up on
  std::atomic<int> next_tag_{100};
};

// The control thread: polls every registered channel every few milliseconds.
void control_service_start();
void control_service_stop();
void control_service_add(const std::shared_ptr<ControlChannel>& ch);
void control_service_remove(const ControlChannel* ch);
bool control_service_running();

// Prints the message and ends the job with MPI_Abort after delay_s (see runtime.cpp for why).
[[noreturn]] void abort_job(int code, const std::string& message, double delay_s);

// Builds the timeout report. `seq` > 0 for a collective (missing = ranks whose entered < seq or
// that did not answer); for point-to-point pass seq 0 and the peer. The missing ranks are named
// with their nodes ("2, 3 on node n2 (all of its ranks)"), so a lost node reads as one.
std::string format_timeout_report(const std::string& what, int comm_size, int64_t seq, int p2p_peer, double waited_s,
                                  double grace_s, const std::vector<PeerStatus>& peers, bool can_query,
                                  std::vector<int>* missing);

}  // namespace dtrain::comm::detail

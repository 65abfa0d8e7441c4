#pragma once
// The side channel that makes a timeout say who is missing. Each communicator owns one: a private
// duplicate of its MPI communicator on which the runtime's control thread answers "which
// collective did you last enter?" from peers. A waiter that times out asks every peer, waits a
// short grace period, and reports the ranks that never answered (exited, finalised, hung outside
// MPI progress) and those that answered with an older sequence number (late, or stuck elsewhere).
// The same channel carries the desync check (two ranks' flight records compared, on the control
// thread) and the requests to write hang forensics.
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "control/flight_recorder.h"
#include "dtrain/comm/communicator.h"

namespace dtrain::comm::detail {

// What a query asks: the peer's status; its status once it has written its hang forensics; or
// (the desync check) its flight records.
enum class QueryKind : int32_t { Status = 0, Dump = 1, Sequence = 2 };

class ControlChannel {
 public:
  // Duplicates `comm` and gathers every rank's host name and world rank (collective over it).
  // `recorder`: the communicator's, given the start and end of each collective.
  ControlChannel(MPI_Comm comm, std::string comm_name, std::shared_ptr<FlightRecorder> recorder);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& comm_name() const { return name_; }

  void note_entered(int64_t seq, const std::string& what);
  void note_completed(int64_t seq);
  PeerStatus self_status() const;

  // Asks every other rank (or those in `ranks`) for its status; waits at most grace_s for the
  // answers. Index = rank.
  std::vector<PeerStatus> query(double grace_s, QueryKind kind = QueryKind::Status, const std::vector<int>& ranks = {});
  // Answers the queries that arrived and takes a desync another rank found; called by the control
  // thread (thread-safe).
  void serve();
  // The desync check, on the world's channel and the control thread: when a check was requested,
  // asks for each communicator of this rank the next member's flight records (by the
  // communicator's id: no traffic on short-lived channels, whose ids MPI reuses) and compares them
  // with this rank's (a difference is noted, see sequence_check.h).
  void poll_sequence_checks();
  // Tells every other rank of a desync found here (on the world's channel).
  void send_desync(const std::string& message);
  // After a timeout that will abort the job (`report` says which): where the ranks' sequences
  // part (the first collective some ranks did not enter, and those ranks), this rank's hang
  // forensics file, and the peers' (asked here; each answers once its file is written). Returns
  // lines for the report.
  std::string hang_forensics(const std::string& report, int64_t seq, const std::vector<PeerStatus>& peers,
                             double grace_s);
  // Frees the duplicate; afterwards serve() and query() do nothing. Idempotent.
  void release();

 private:
  struct Query;
  struct SequenceQuery;
  int fresh_tag();
  void answer(int source, const Query& q);                      // under serve_mu_
  void post_check(const std::shared_ptr<FlightRecorder>& rec);  // under serve_mu_
  bool finish_check(SequenceQuery& q);                          // under serve_mu_
  void post(int dest, int tag, std::vector<char> bytes);        // under serve_mu_
  std::string rank_name(int r) const;                           // "2" or "2 (world rank 5)"

  MPI_Comm ctrl_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::string name_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::vector<std::string> hosts_;  // index = rank
  std::vector<int> world_ranks_;    // index = rank
  mutable std::mutex state_mu_;
  int64_t entered_ = 0, completed_ = 0;
  std::string current_ = "idle";
  std::mutex serve_mu_;  // one server at a time, and no release() during a serve()
  struct Outgoing;
  std::vector<std::unique_ptr<Outgoing>> outgoing_;  // answers and messages still being sent
  std::vector<std::unique_ptr<char[]>> abandoned_;   // buffers of requests we gave up on
  std::atomic<int> next_tag_{100};
  // The desync check (the world's channel, control thread): the queries in flight, the requests
  // done, and per communicator id the sequence number up to which the records were found equal.
  std::vector<std::unique_ptr<SequenceQuery>> checks_;
  int64_t checks_done_ = 0;
  std::map<uint64_t, int64_t> verified_;
};

// The control thread: polls every registered channel every few milliseconds (answers, desync
// checks, and a desync found here sent to the peers).
void control_service_start();
void control_service_stop();
void control_service_add(const std::shared_ptr<ControlChannel>& ch);
void control_service_remove(const ControlChannel* ch);
// The world's channel, which carries the desync check and its verdict.
void control_service_set_world(const std::shared_ptr<ControlChannel>& ch);
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

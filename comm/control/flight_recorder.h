#pragma once
// The flight recorder: per communicator, the last N collectives this rank issued (kind, dtype,
// count, op or root, sequence number, the training phase it was issued in, and its enqueue, start
// and end times). A hang's forensics file prints it; the desync check compares two ranks' records.
// Cost per collective: one mutex and a slot of a fixed ring, no allocation.
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "dtrain/core/dtype.h"

namespace dtrain::comm::detail {

enum class CollectiveKind : uint8_t { Allreduce, Broadcast, Allgather, ReduceScatter, Barrier, Split, Alltoall };
const char* collective_kind_name(CollectiveKind k);

// What every rank of a communicator must issue at the same position of its sequence.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::Barrier;
  DType dtype = DType::U8;
  int64_t count = 0;  // elements this rank passes (allgather: its block; reduce_scatter: the whole input;
                      // alltoall: 0, as ranks pass different counts)
  int32_t arg = 0;    // ReduceOp of a reduction, the root of a broadcast, 0 otherwise
  bool operator==(const CollectiveCall&) const = default;
};

// The training phase tags the collectives of the communicators that track it (a trainer's world and
// its splits, while the trainer lives): 0 outside the steps (set-up, or not tracked), 1 + 2 * step
// for a step's body (data, forward, backward, exchange, update) and 2 + 2 * step for what follows
// it (logs, checks, checkpoints). Within a trainer phases only grow, so a rank past phase p has
// issued all of p's collectives; phase 0 claims nothing. A new trainer starts from 0 again, after
// set-up collectives on its world, so a stale view of the last trainer cannot meet its steps.
int64_t current_phase();
void set_phase(int64_t phase);
std::string phase_name(int64_t phase);  // "in step 7", "after step 7", "" for 0

struct CollectiveRecord {
  int64_t seq = 0;
  CollectiveCall call;
  int64_t phase = 0;
  uint64_t chain = 0;                           // hash of every (call, phase) up to and including this one
  double enqueued = 0, started = 0, ended = 0;  // seconds since the epoch; 0: not (yet)
  bool same_call(const CollectiveRecord& o) const { return call == o.call && phase == o.phase; }
};
// "allreduce #12 f32 x 1024 avg in step 7"
std::string describe(const CollectiveRecord& r);
double wall_s();  // seconds since the epoch (comparable across nodes, unlike the steady clock)

class FlightRecorder {
 public:
  FlightRecorder(std::string comm_name, int rank, int size, size_t capacity);
  const std::string& comm_name() const { return name_; }
  // Whether this communicator's collectives carry the training phase, and the phase to record or
  // to claim now (0 when not tracked).
  void track_phases(bool on) { phased_.store(on); }
  bool tracks_phases() const { return phased_.load(); }
  int64_t phase_now() const { return tracks_phases() ? current_phase() : 0; }
  // The members (world ranks, index = rank), set by the control channel once it has gathered them.
  // With the name and how many communicators of that name and members this process made before,
  // they give an id every member computes alike, by which ranks ask each other about it.
  void set_members(std::vector<int> world_ranks);
  uint64_t id() const;  // 0 until set_members
  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_rank_of(int r) const;

  // The caller's thread, after the backend took sequence number `seq`; `t` when it was called.
  void issued(int64_t seq, const CollectiveCall& call, int64_t phase, double t);
  // The thread that runs the collective (MPI: the worker; NCCL: launch and completion).
  void started(int64_t seq);
  void ended(int64_t seq);

  int64_t latest() const;  // the highest sequence number issued (0: none)
  // The records in [from, to] still kept, oldest first.
  std::vector<CollectiveRecord> records(int64_t from, int64_t to) const;
  // Every record kept, with a header line naming the communicator and what is in flight.
  void write(std::ostream& os) const;

 private:
  CollectiveRecord* slot(int64_t seq);  // under mu_; null when seq's record is gone

  std::string name_;
  int rank_, size_;
  std::atomic<bool> phased_{false};
  mutable std::mutex mu_;
  std::vector<CollectiveRecord> ring_;
  std::vector<int> members_;
  uint64_t id_ = 0;
  int64_t latest_ = 0;
  uint64_t chain_ = 0;
};

// A recorder registered for the hang forensics (which print every live one). Capacity:
// DTRAIN_FLIGHT_RECORDER.
std::shared_ptr<FlightRecorder> make_flight_recorder(const std::string& comm_name, int rank, int size);
std::vector<std::shared_ptr<FlightRecorder>> live_flight_recorders();
std::shared_ptr<FlightRecorder> find_flight_recorder(uint64_t id);  // null when none has this id

}  // namespace dtrain::comm::detail

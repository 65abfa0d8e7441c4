#include "control/sequence_check.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/forensics.h"

namespace dtrain::comm {

DesyncError::DesyncError(const std::string& message, const char* file, int line)
    : Error("comm desync", message, file, line) {}

void set_step_phase(int64_t step, bool after_body) {
  detail::set_phase(step > 0 ? 1 + 2 * step + (after_body ? 1 : 0) : 0);
}

StepPhaseScope::StepPhaseScope(Communicator& comm) : comm_(comm) {
  set_step_phase(0, false);
  comm_.track_step_phases(true);
}

StepPhaseScope::~StepPhaseScope() { comm_.track_step_phases(false); }

void check_collective_sequences() {
  detail::throw_if_desync();
  detail::request_sequence_check();
}

namespace detail {
namespace {

struct Verdict {
  std::mutex mu;
  std::string message;
  std::atomic<bool> noted{false};
  bool sent = false;
};
Verdict& verdict() {
  static auto* v = new Verdict;  // leaked: waits may run during exit
  return *v;
}
std::atomic<int64_t> g_requests{0};

const CollectiveRecord* find(const SequenceView& v, int64_t seq) {
  if (v.records.empty() || seq < v.records.front().seq) return nullptr;
  const auto i = static_cast<size_t>(seq - v.records.front().seq);
  return i < v.records.size() && v.records[i].seq == seq ? &v.records[i] : nullptr;
}

std::string who(const SequenceView& v) {
  return "rank " + std::to_string(v.rank) + " (world rank " + std::to_string(v.world_rank) + ")";
}

// `has` issued a collective in a phase that `lacks` is already past, without issuing it.
std::string missing(const std::string& head, const std::string& comm, const SequenceView& has,
                    const SequenceView& lacks) {
  const CollectiveRecord* r = find(has, lacks.latest + 1);
  if (!r || r->phase <= 0 || lacks.phase <= r->phase) return "";
  return head + "at #" + std::to_string(r->seq) + ": " + who(has) + " issued " + describe(*r) + "; " + who(lacks) +
         " is " + phase_name(lacks.phase) + " and never issued it (its last on '" + comm + "' is #" +
         std::to_string(lacks.latest) + ")";
}

}  // namespace

std::string first_sequence_difference(const std::string& comm, int comm_size, const SequenceView& a,
                                      const SequenceView& b, int64_t verified) {
  const std::string head = "collective sequences differ on '" + comm + "' (" + std::to_string(comm_size) + " ranks) ";
  if (!a.records.empty() && !b.records.empty()) {
    // The records both have, from the lowest: the first whose hash of the sequence so far differs.
    const int64_t lo = std::max(a.records.front().seq, b.records.front().seq);
    const int64_t hi = std::min(a.records.back().seq, b.records.back().seq);
    for (int64_t s = lo; s <= hi; ++s) {
      const CollectiveRecord *ra = find(a, s), *rb = find(b, s);
      if (!ra || !rb || ra->chain == rb->chain) continue;
      if (ra->same_call(*rb))  // equal here, so they differ earlier, before either record kept
        return head + "before #" + std::to_string(s) + " (earlier records are gone): " + who(a) + " and " + who(b) +
               " issued different sequences up to it";
      const bool exact = s == lo ? s - 1 <= verified : true;
      return head + "at #" + std::to_string(s) + (exact ? "" : " or before (earlier records are gone)") + ": " +
             who(a) + " issued " + describe(*ra) + ", " + who(b) + " " + describe(*rb);
    }
  }
  std::string m = missing(head, comm, a, b);
  return m.empty() ? missing(head, comm, b, a) : m;
}

void note_desync(const std::string& message, bool from_peer) {
  Verdict& v = verdict();
  std::lock_guard<std::mutex> lock(v.mu);
  if (v.noted.load()) return;
  v.message = message;
  v.sent = from_peer;  // a peer's verdict has gone to every rank already
  v.noted.store(true);
}

bool desync_noted() { return verdict().noted.load(std::memory_order_acquire); }

std::string desync_message() {
  Verdict& v = verdict();
  std::lock_guard<std::mutex> lock(v.mu);
  return v.message;
}

void throw_if_desync() {
  if (desync_noted()) throw DesyncError(desync_message(), __FILE__, __LINE__);
}

bool take_desync_to_send(std::string& message) {
  Verdict& v = verdict();
  if (!v.noted.load()) return false;
  std::lock_guard<std::mutex> lock(v.mu);
  if (v.sent) return false;
  v.sent = true;
  message = v.message;
  return true;
}

void request_sequence_check() { g_requests.fetch_add(1, std::memory_order_relaxed); }
int64_t sequence_check_requests() { return g_requests.load(std::memory_order_relaxed); }

StallWatch::StallWatch(double limit_s) : next_s_(std::clamp(limit_s > 0 ? limit_s / 8 : 30.0, 1.0, 30.0)) {}

void StallWatch::tick(double waited_s) {
  throw_if_desync();
  if (waited_s < next_s_) return;
  request_sequence_check();
  next_s_ *= 2;
}

}  // namespace detail
}  // namespace dtrain::comm

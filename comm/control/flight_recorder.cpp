#include "control/flight_recorder.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <sstream>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/env.h"

namespace dtrain::comm::detail {
namespace {

std::atomic<int64_t> g_phase{0};

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t call_hash(const CollectiveCall& c, int64_t phase) {
  uint64_t h = mix(static_cast<uint64_t>(c.kind) << 8 | static_cast<uint64_t>(c.dtype));
  h = mix(h ^ static_cast<uint64_t>(c.count));
  h = mix(h ^ static_cast<uint64_t>(static_cast<uint32_t>(c.arg)));
  return mix(h ^ static_cast<uint64_t>(phase));
}

// "14:03:07.123456" in local time.
std::string clock_str(double t) {
  const auto secs = static_cast<time_t>(t);
  tm parts{};
  localtime_r(&secs, &parts);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d.%06d", parts.tm_hour, parts.tm_min, parts.tm_sec,
                static_cast<int>((t - static_cast<double>(secs)) * 1e6));
  return buf;
}

std::mutex& registry_mu() {
  static auto* m = new std::mutex;  // leaked: recorders may go away during exit
  return *m;
}
std::vector<std::weak_ptr<FlightRecorder>>& registry() {
  static auto* r = new std::vector<std::weak_ptr<FlightRecorder>>;
  return *r;
}

}  // namespace

const char* collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::Allreduce:
      return "allreduce";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Allgather:
      return "allgather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::Barrier:
      return "barrier";
    case CollectiveKind::Split:
      return "split";
    case CollectiveKind::Alltoall:
      return "alltoall";
  }
  return "?";
}

int64_t current_phase() { return g_phase.load(std::memory_order_relaxed); }
void set_phase(int64_t phase) { g_phase.store(phase, std::memory_order_relaxed); }

std::string phase_name(int64_t phase) {
  if (phase <= 0) return "";
  return std::string((phase - 1) % 2 ? "after step " : "in step ") + std::to_string((phase - 1) / 2);
}

double wall_s() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string describe(const CollectiveRecord& r) {
  const CollectiveCall& c = r.call;
  std::ostringstream os;
  os << collective_kind_name(c.kind) << " #" << r.seq;
  if (c.kind != CollectiveKind::Barrier && c.kind != CollectiveKind::Split)
    os << " " << dtype_name(c.dtype) << " x " << c.count;
  if (c.kind == CollectiveKind::Allreduce || c.kind == CollectiveKind::ReduceScatter)
    os << " " << reduce_op_name(static_cast<ReduceOp>(c.arg));
  if (c.kind == CollectiveKind::Broadcast) os << " root " << c.arg;
  if (r.phase > 0) os << " " << phase_name(r.phase);
  return os.str();
}

FlightRecorder::FlightRecorder(std::string comm_name, int rank, int size, size_t capacity)
    : name_(std::move(comm_name)), rank_(rank), size_(size), ring_(std::max<size_t>(capacity, 1)) {}

CollectiveRecord* FlightRecorder::slot(int64_t seq) {
  CollectiveRecord& r = ring_[static_cast<size_t>(seq) % ring_.size()];
  if (r.seq > seq) return nullptr;  // the record has made room for a newer one
  if (r.seq != seq) {
    r = CollectiveRecord{};
    r.seq = seq;
  }
  return &r;
}

void FlightRecorder::issued(int64_t seq, const CollectiveCall& call, int64_t phase, double t) {
  std::lock_guard<std::mutex> lock(mu_);
  chain_ = mix(chain_ ^ call_hash(call, phase));
  latest_ = seq;
  CollectiveRecord* r = slot(seq);  // the worker may have started it already
  if (!r) return;
  r->call = call;
  r->phase = phase;
  r->enqueued = t;
  r->chain = chain_;
}

void FlightRecorder::started(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (CollectiveRecord* r = slot(seq)) r->started = wall_s();
}

void FlightRecorder::ended(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (CollectiveRecord* r = slot(seq)) r->ended = wall_s();
}

void FlightRecorder::set_members(std::vector<int> world_ranks) {
  uint64_t h = mix(std::hash<std::string>{}(name_));
  for (int w : world_ranks) h = mix(h ^ static_cast<uint64_t>(w));
  static auto* made = new std::map<uint64_t, uint64_t>;  // under registry_mu()
  uint64_t nth = 0;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    nth = (*made)[h]++;
  }
  std::lock_guard<std::mutex> lock(mu_);
  members_ = std::move(world_ranks);
  id_ = mix(h ^ (nth + 1)) | 1;  // never 0
}

uint64_t FlightRecorder::id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return id_;
}

int FlightRecorder::world_rank_of(int r) const {
  std::lock_guard<std::mutex> lock(mu_);
  return r >= 0 && static_cast<size_t>(r) < members_.size() ? members_[static_cast<size_t>(r)] : -1;
}

int64_t FlightRecorder::latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

std::vector<CollectiveRecord> FlightRecorder::records(int64_t from, int64_t to) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CollectiveRecord> out;
  const int64_t oldest = std::max<int64_t>(1, latest_ - static_cast<int64_t>(ring_.size()) + 1);
  for (int64_t s = std::max(from, oldest); s <= std::min(to, latest_); ++s) {
    const CollectiveRecord& r = ring_[static_cast<size_t>(s) % ring_.size()];
    if (r.seq == s && r.enqueued > 0) out.push_back(r);
  }
  return out;
}

void FlightRecorder::write(std::ostream& os) const {
  const std::vector<CollectiveRecord> all = records(1, latest());
  int64_t completed = 0;
  for (const CollectiveRecord& r : all)
    if (r.ended > 0) completed = r.seq;
  os << "communicator '" << name_ << "' (rank " << rank_ << " of " << size_ << "): " << latest()
     << " collectives issued, the last " << all.size() << " kept; completed through #" << completed << "\n";
  const double now = wall_s();
  for (const CollectiveRecord& r : all) {
    char times[160];
    if (r.ended > 0)
      std::snprintf(times, sizeof times, "started +%.6f s, ended +%.6f s", r.started - r.enqueued,
                    r.ended - r.enqueued);
    else if (r.started > 0)
      std::snprintf(times, sizeof times, "started +%.6f s, NOT ENDED (running for %.3f s)", r.started - r.enqueued,
                    now - r.started);
    else
      std::snprintf(times, sizeof times, "NOT STARTED (queued for %.3f s)", now - r.enqueued);
    os << "  " << describe(r) << ": enqueued " << clock_str(r.enqueued) << ", " << times << "\n";
  }
}

std::shared_ptr<FlightRecorder> make_flight_recorder(const std::string& comm_name, int rank, int size) {
  const long capacity = env::get_long("DTRAIN_FLIGHT_RECORDER");
  auto r = std::make_shared<FlightRecorder>(comm_name, rank, size, static_cast<size_t>(std::max(1L, capacity)));
  std::lock_guard<std::mutex> lock(registry_mu());
  std::erase_if(registry(), [](const std::weak_ptr<FlightRecorder>& w) { return w.expired(); });
  registry().push_back(r);
  return r;
}

std::shared_ptr<FlightRecorder> find_flight_recorder(uint64_t id) {
  for (auto& r : live_flight_recorders())
    if (r->id() == id) return r;
  return nullptr;
}

std::vector<std::shared_ptr<FlightRecorder>> live_flight_recorders() {
  std::lock_guard<std::mutex> lock(registry_mu());
  std::vector<std::shared_ptr<FlightRecorder>> out;
  for (const auto& w : registry())
    if (auto r = w.lock()) out.push_back(std::move(r));
  return out;
}

}  // namespace dtrain::comm::detail

#include "control/control_channel.h"

#include "control/phase_deadline.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <sstream>
#include <thread>

#include "control/forensics.h"
#include "control/sequence_check.h"
#include "dtrain/comm/forensics.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm::detail {
namespace {

constexpr int kQueryTag = 1;   // replies use the tag named in the query (>= 100)
constexpr int kDesyncTag = 2;  // the message of a desync another rank found

struct Reply {
  int64_t entered;
  int64_t completed;
  char current[112];
};
// The desync check's answer: the peer's latest sequence number and phase, and its records from
// `from` on (at most kWireRecords).
constexpr int kWireRecords = 64;
struct WireRecord {
  int64_t seq, count, phase;
  uint64_t chain;
  int32_t arg;
  uint8_t kind, dtype;
};
struct SequenceReply {
  int64_t latest, phase;
  int32_t n;
  WireRecord records[kWireRecords];
};

template <class T>
std::vector<char> bytes_of(const T& v) {
  const char* p = reinterpret_cast<const char*>(&v);
  return std::vector<char>(p, p + sizeof v);
}

}  // namespace

struct ControlChannel::Query {
  int32_t reply_tag;
  int32_t kind;      // QueryKind
  int64_t from;      // Sequence: the first record asked for ...
  uint64_t comm_id;  // ... of this communicator (FlightRecorder::id)
};

struct ControlChannel::Outgoing {
  std::vector<char> bytes;
  MPI_Request req = MPI_REQUEST_NULL;
};

struct ControlChannel::SequenceQuery {
  Query query{};
  SequenceReply reply{};
  MPI_Request send = MPI_REQUEST_NULL, recv = MPI_REQUEST_NULL;
  std::weak_ptr<FlightRecorder> rec;
  int peer = 0, peer_world = 0;  // the next member: its rank in the communicator and in the world
  double posted = 0;
};

ControlChannel::ControlChannel(MPI_Comm comm, std::string comm_name, std::shared_ptr<FlightRecorder> recorder)
    : name_(std::move(comm_name)), recorder_(std::move(recorder)) {
  PhaseDeadline deadline("the control channel set-up of communicator '" + name_ + "'");
  DT_MPI_CHECK(MPI_Comm_dup(comm, &ctrl_));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN));
  DT_MPI_CHECK(MPI_Comm_rank(ctrl_, &rank_));
  DT_MPI_CHECK(MPI_Comm_size(ctrl_, &size_));
  // Host names and world ranks, for reports that name the node of a missing rank.
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  DT_MPI_CHECK(MPI_Get_processor_name(mine, &len));
  std::vector<char> all(static_cast<size_t>(size_) * MPI_MAX_PROCESSOR_NAME);
  DT_MPI_CHECK(MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, ctrl_));
  for (int r = 0; r < size_; ++r) {
    const char* name = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    hosts_.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }
  int world = 0;
  DT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world));
  world_ranks_.resize(static_cast<size_t>(size_));
  DT_MPI_CHECK(MPI_Allgather(&world, 1, MPI_INT, world_ranks_.data(), 1, MPI_INT, ctrl_));
  recorder_->set_members(world_ranks_);
}

ControlChannel::~ControlChannel() { release(); }

void ControlChannel::release() {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    for (auto& o : outgoing_)
      if (o->req != MPI_REQUEST_NULL) MPI_Request_free(&o->req);
    for (auto& q : checks_) {
      if (q->recv != MPI_REQUEST_NULL) {
        MPI_Cancel(&q->recv);
        MPI_Request_free(&q->recv);
      }
      if (q->send != MPI_REQUEST_NULL) MPI_Request_free(&q->send);
      q.release();  // MPI may still own its buffers: leaked on purpose (at MPI's end)
    }
    MPI_Comm_free(&ctrl_);
  }
  outgoing_.clear();
  checks_.clear();
  ctrl_ = MPI_COMM_NULL;
}

std::string ControlChannel::rank_name(int r) const {
  const int world = static_cast<size_t>(r) < world_ranks_.size() ? world_ranks_[static_cast<size_t>(r)] : r;
  return std::to_string(r) + (world == r ? "" : " (world rank " + std::to_string(world) + ")");
}

void ControlChannel::note_entered(int64_t seq, const std::string& what) {
  recorder_->started(seq);
  std::lock_guard<std::mutex> lock(state_mu_);
  entered_ = seq;
  current_ = what;
}

void ControlChannel::note_completed(int64_t seq) {
  recorder_->ended(seq);
  std::lock_guard<std::mutex> lock(state_mu_);
  completed_ = seq;
  if (completed_ >= entered_) current_ = "idle after #" + std::to_string(seq);
}

PeerStatus ControlChannel::self_status() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  PeerStatus s;
  s.rank = rank_;
  s.responded = true;
  s.entered = entered_;
  s.completed = completed_;
  s.current = current_;
  return s;
}

void ControlChannel::post(int dest, int tag, std::vector<char> bytes) {
  auto o = std::make_unique<Outgoing>();
  o->bytes = std::move(bytes);
  if (MPI_Isend(o->bytes.data(), static_cast<int>(o->bytes.size()), MPI_BYTE, dest, tag, ctrl_, &o->req) == MPI_SUCCESS)
    outgoing_.push_back(std::move(o));
}

void ControlChannel::answer(int source, const Query& q) {
  const auto kind = static_cast<QueryKind>(q.kind);
  if (kind == QueryKind::Sequence) {
    SequenceReply r{};
    r.latest = -1;  // a communicator this rank does not have (any more, or yet)
    if (const std::shared_ptr<FlightRecorder> rec = find_flight_recorder(q.comm_id)) {
      r.phase = rec->phase_now();  // before the records (flight_recorder.h: what a phase promises)
      r.latest = rec->latest();
      for (const CollectiveRecord& c : rec->records(q.from, std::min(r.latest, q.from + kWireRecords - 1)))
        r.records[r.n++] = WireRecord{c.seq,
                                      c.call.count,
                                      c.phase,
                                      c.chain,
                                      c.call.arg,
                                      static_cast<uint8_t>(c.call.kind),
                                      static_cast<uint8_t>(c.call.dtype)};
    }
    post(source, q.reply_tag, bytes_of(r));
    return;
  }
  if (kind == QueryKind::Dump)  // written before the answer: an answer means the file is complete
    write_hang_forensics("asked by rank " + rank_name(source) + " of '" + name_ + "' after its comm timeout");
  Reply r{};
  PeerStatus me = self_status();
  r.entered = me.entered;
  r.completed = me.completed;
  std::strncpy(r.current, me.current.c_str(), sizeof r.current - 1);
  post(source, q.reply_tag, bytes_of(r));
}

void ControlChannel::serve() {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL) return;
  // Drop messages that have gone out.
  std::erase_if(outgoing_, [](const std::unique_ptr<Outgoing>& o) {
    int done = 0;
    if (MPI_Test(&o->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
    return done != 0;
  });
  int flag = 0;
  MPI_Status st;
  while (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, ctrl_, &flag, &st) == MPI_SUCCESS && flag) {
    Query q{};
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kQueryTag, ctrl_, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    answer(st.MPI_SOURCE, q);
  }
  if (MPI_Iprobe(MPI_ANY_SOURCE, kDesyncTag, ctrl_, &flag, &st) == MPI_SUCCESS && flag) {
    int len = 0;
    MPI_Get_count(&st, MPI_BYTE, &len);
    std::string text(static_cast<size_t>(std::max(len, 0)), '\0');
    if (MPI_Recv(text.data(), len, MPI_BYTE, st.MPI_SOURCE, kDesyncTag, ctrl_, MPI_STATUS_IGNORE) == MPI_SUCCESS)
      note_desync(text, true);
  }
}

void ControlChannel::send_desync(const std::string& message) {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL) return;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) post(r, kDesyncTag, std::vector<char>(message.begin(), message.end()));
}

int ControlChannel::fresh_tag() {
  const int tag = next_tag_.fetch_add(1);
  if (tag > 30000) next_tag_.store(100);  // replies to old queries may linger; tags keep them apart
  return tag;
}

std::vector<PeerStatus> ControlChannel::query(double grace_s, QueryKind kind, const std::vector<int>& ranks) {
  std::vector<PeerStatus> out(static_cast<size_t>(size_));
  out[static_cast<size_t>(rank_)] = self_status();
  for (int r = 0; r < size_; ++r) {
    out[static_cast<size_t>(r)].rank = r;
    if (static_cast<size_t>(r) < hosts_.size()) out[static_cast<size_t>(r)].host = hosts_[static_cast<size_t>(r)];
  }
  if (ctrl_ == MPI_COMM_NULL || size_ == 1) return out;

  const int tag = fresh_tag();
  size_t n = static_cast<size_t>(size_);
  // One heap block for the query and the replies: if a peer never answers, MPI may still own it.
  std::unique_ptr<char[]> buf(new char[sizeof(Reply) * (n + 1)]);
  auto* replies = reinterpret_cast<Reply*>(buf.get());
  auto* query_msg = reinterpret_cast<Query*>(buf.get() + sizeof(Reply) * n);
  *query_msg = Query{tag, static_cast<int32_t>(kind), 0, 0};
  std::vector<MPI_Request> sends(n, MPI_REQUEST_NULL), recvs(n, MPI_REQUEST_NULL);
  int outstanding = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || (!ranks.empty() && std::find(ranks.begin(), ranks.end(), r) == ranks.end())) continue;
    MPI_Irecv(&replies[r], sizeof(Reply), MPI_BYTE, r, tag, ctrl_, &recvs[static_cast<size_t>(r)]);
    MPI_Isend(query_msg, sizeof(Query), MPI_BYTE, r, kQueryTag, ctrl_, &sends[static_cast<size_t>(r)]);
    ++outstanding;
  }
  double deadline = now_s() + grace_s;
  while (outstanding > 0 && now_s() < deadline) {
    serve();  // answer peers that are querying us at the same time, even without a control thread
    for (int r = 0; r < size_; ++r) {
      MPI_Request& req = recvs[static_cast<size_t>(r)];
      if (req == MPI_REQUEST_NULL) continue;
      int done = 0;
      if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        req = MPI_REQUEST_NULL;  // the peer is gone (the request is freed on error)
        --outstanding;
        continue;
      }
      if (done) {
        PeerStatus& s = out[static_cast<size_t>(r)];
        s.responded = true;
        s.entered = replies[r].entered;
        s.completed = replies[r].completed;
        replies[r].current[sizeof replies[r].current - 1] = '\0';
        s.current = replies[r].current;
        --outstanding;
      }
    }
    if (outstanding > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  bool abandoned = false;
  for (auto& req : recvs)
    if (req != MPI_REQUEST_NULL) {
      MPI_Cancel(&req);
      MPI_Request_free(&req);
      abandoned = true;
    }
  for (auto& req : sends) {
    int done = 0;
    if (req != MPI_REQUEST_NULL && MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) {
      MPI_Request_free(&req);  // a send to a dead peer may never complete
      abandoned = true;
    }
  }
  if (abandoned) {
    // MPI may still touch these buffers; keep them alive with the channel.
    std::lock_guard<std::mutex> lock(serve_mu_);
    abandoned_.push_back(std::move(buf));
  }
  return out;
}

// ---- the desync check --------------------------------------------------------------------------

void ControlChannel::poll_sequence_checks() {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL || size_ == 1) return;
  std::erase_if(checks_, [this](std::unique_ptr<SequenceQuery>& q) {
    if (!finish_check(*q)) return false;
    if (q->posted < 0) q.release();  // abandoned: MPI may still own its buffers
    return true;
  });
  const int64_t wanted = sequence_check_requests();
  if (wanted == checks_done_ || !checks_.empty()) return;
  checks_done_ = wanted;
  std::map<uint64_t, int64_t> live;  // forget the communicators that are gone
  for (const std::shared_ptr<FlightRecorder>& rec : live_flight_recorders()) {
    live[rec->id()] = verified_[rec->id()];
    post_check(rec);
  }
  verified_ = std::move(live);
}

// Asks the next member of `rec`'s communicator for its records from the last verified one on, at
// least up to one past this rank's latest (a record it has and this rank lacks).
void ControlChannel::post_check(const std::shared_ptr<FlightRecorder>& rec) {
  if (rec->size() < 2 || rec->id() == 0) return;
  auto q = std::make_unique<SequenceQuery>();
  q->rec = rec;
  q->peer = (rec->rank() + 1) % rec->size();
  q->peer_world = rec->world_rank_of(q->peer);
  if (q->peer_world < 0 || q->peer_world >= size_) return;
  const int64_t from = std::max<int64_t>({1, verified_[rec->id()] + 1, rec->latest() - (kWireRecords - 16)});
  q->query = Query{fresh_tag(), static_cast<int32_t>(QueryKind::Sequence), from, rec->id()};
  q->posted = now_s();
  MPI_Irecv(&q->reply, sizeof q->reply, MPI_BYTE, q->peer_world, q->query.reply_tag, ctrl_, &q->recv);
  MPI_Isend(&q->query, sizeof q->query, MPI_BYTE, q->peer_world, kQueryTag, ctrl_, &q->send);
  checks_.push_back(std::move(q));
}

// Compares once the answer is in; true when the query is done with (answered, or given up after
// 10 s: a stopped or lost peer is the timeout's to report).
bool ControlChannel::finish_check(SequenceQuery& q) {
  int done = 0;
  if (MPI_Test(&q.recv, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = -1;  // the peer is gone
  if (done == 0 && now_s() - q.posted < 10) return false;
  if (done != 1) {
    if (q.recv != MPI_REQUEST_NULL) {
      MPI_Cancel(&q.recv);
      MPI_Request_free(&q.recv);
    }
    if (q.send != MPI_REQUEST_NULL) MPI_Request_free(&q.send);
    q.posted = -1;  // abandoned
    return true;
  }
  MPI_Wait(&q.send, MPI_STATUS_IGNORE);  // matched: the peer has answered it
  const std::shared_ptr<FlightRecorder> rec = q.rec.lock();
  const SequenceReply& r = q.reply;
  if (!rec || r.latest < 0) return true;  // one of the two no longer has the communicator
  SequenceView theirs{q.peer, q.peer_world, r.latest, r.phase, {}};
  for (int i = 0; i < std::clamp(r.n, 0, kWireRecords); ++i) {
    const WireRecord& w = r.records[i];
    theirs.records.push_back(CollectiveRecord{
        w.seq, CollectiveCall{static_cast<CollectiveKind>(w.kind), static_cast<DType>(w.dtype), w.count, w.arg},
        w.phase, w.chain});
  }
  SequenceView mine{rec->rank(), rank_, 0, rec->phase_now(), {}};  // the phase first (flight_recorder.h)
  mine.latest = rec->latest();
  mine.records = rec->records(std::min(q.query.from, theirs.latest + 1), mine.latest);
  int64_t& verified = verified_[rec->id()];
  const std::string diff = first_sequence_difference(rec->comm_name(), rec->size(), mine, theirs, verified);
  if (!diff.empty())
    note_desync(
        diff + "; a rank skipped, added or changed a collective (found by world rank " + std::to_string(rank_) + ")",
        false);
  else if (!mine.records.empty() && !theirs.records.empty())
    verified = std::max(verified, std::min(mine.records.back().seq, theirs.records.back().seq));
  return true;
}

// ---- hang forensics ----------------------------------------------------------------------------

std::string ControlChannel::hang_forensics(const std::string& report, int64_t seq, const std::vector<PeerStatus>& peers,
                                           double grace_s) {
  // Where the sequences part: the first collective a rank that answered has not entered (or the
  // one timed out), and the ranks behind it.
  int64_t first = seq;
  std::string behind, wrote = std::to_string(world_ranks_[static_cast<size_t>(rank_)]);
  std::vector<int> alive;
  for (const PeerStatus& p : peers) {
    if (p.rank == rank_) continue;
    if (p.responded) alive.push_back(p.rank);
    if (p.responded && p.entered >= seq) continue;
    if (p.responded) first = std::min(first, p.entered + 1);
    behind += (behind.empty() ? "" : ", ") + rank_name(p.rank) + (p.responded ? "" : " (no answer)");
  }
  const std::vector<CollectiveRecord> rec =
      seq > 0 ? recorder_->records(first, first) : std::vector<CollectiveRecord>{};
  std::string out;
  if (seq > 0 && !behind.empty())
    out += "\n  the ranks' sequences part at " + (rec.empty() ? "#" + std::to_string(first) : describe(rec[0])) +
           " on '" + name_ + "'; ranks behind: " + behind;
  // This rank's file, then the peers' (they answer once theirs is written, so the abort that
  // follows cannot cut them short).
  const std::string path = write_hang_forensics("comm timeout: " + report);
  if (!alive.empty())
    for (const PeerStatus& p : query(std::max(grace_s, 10.0), QueryKind::Dump, alive))
      if (p.responded && p.rank != rank_) wrote += ", " + std::to_string(world_ranks_[static_cast<size_t>(p.rank)]);
  out += "\n  hang forensics (flight recorders, thread backtraces): " +
         (path.empty() ? std::string("could not be written in ") + run_dir() : path) +
         "; hang-rank<r>.txt written by world ranks " + wrote;
  return out;
}

// ---- the control thread ----------------------------------------------------------------------

namespace {
struct ControlService {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<ControlChannel>> channels;
  std::shared_ptr<ControlChannel> world;
  std::thread thread;
  bool stop = false;
  bool running = false;
};
ControlService& service() {
  static ControlService* s = new ControlService;  // never destroyed: may be used during exit
  return *s;
}
}  // namespace

void control_service_start() {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.running) return;
  s.stop = false;
  s.running = true;
  s.thread = std::thread([&s] {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.stop) {
      for (auto& ch : s.channels) ch->serve();
      if (s.world) {
        s.world->poll_sequence_checks();
        std::string desync;
        if (take_desync_to_send(desync)) s.world->send_desync(desync);
      }
      // 10 ms: a query is answered well inside the grace period, at negligible CPU cost.
      s.cv.wait_for(lock, std::chrono::milliseconds(10), [&s] { return s.stop; });
    }
  });
}

void control_service_stop() {
  ControlService& s = service();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running) return;
    s.stop = true;
  }
  s.cv.notify_all();
  s.thread.join();
  std::lock_guard<std::mutex> lock(s.mu);
  s.running = false;
  s.channels.clear();
  s.world.reset();
}

bool control_service_running() {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.running;
}

void control_service_add(const std::shared_ptr<ControlChannel>& ch) {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  s.channels.push_back(ch);
}

void control_service_set_world(const std::shared_ptr<ControlChannel>& ch) {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  s.world = ch;
}

void control_service_remove(const ControlChannel* ch) {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  std::erase_if(s.channels, [ch](const std::shared_ptr<ControlChannel>& c) { return c.get() == ch; });
  if (s.world.get() == ch) s.world.reset();
}

// ---- the report ------------------------------------------------------------------------------
namespace {

// "2, 3 on node n2 (all of its ranks), 5 on node n3": the missing ranks grouped by node, nodes in
// the order of their lowest missing rank; a node none of whose ranks arrived reads as lost.
std::string missing_by_node(const std::vector<int>& miss, const std::vector<PeerStatus>& peers) {
  std::vector<std::string> hosts;
  for (int r : miss)
    if (std::find(hosts.begin(), hosts.end(), peers[static_cast<size_t>(r)].host) == hosts.end())
      hosts.push_back(peers[static_cast<size_t>(r)].host);
  std::ostringstream os;
  for (size_t h = 0; h < hosts.size(); ++h) {
    int on_node = 0, missing = 0;
    for (const PeerStatus& p : peers) on_node += p.host == hosts[h];
    os << (h ? ", " : "");
    for (int r : miss)
      if (peers[static_cast<size_t>(r)].host == hosts[h]) os << (missing++ ? ", " : "") << r;
    if (hosts[h].empty()) continue;
    os << " on node " << hosts[h];
    if (missing == on_node) os << " (all of its ranks)";  // never this rank's node: it answers itself
  }
  return os.str();
}

}  // namespace

std::string format_timeout_report(const std::string& what, int comm_size, int64_t seq, int p2p_peer, double waited_s,
                                  double grace_s, const std::vector<PeerStatus>& peers, bool can_query,
                                  std::vector<int>* missing) {
  std::ostringstream os;
  os.precision(3);
  os << what << " (" << comm_size << " ranks) did not complete within " << waited_s << " s";
  std::vector<int> miss;
  if (!can_query) {
    os << "; cannot tell which ranks are missing (no control thread: MPI did not grant MPI_THREAD_MULTIPLE)";
    if (p2p_peer >= 0) miss.push_back(p2p_peer);
    if (missing) *missing = miss;
    return os.str();
  }
  std::ostringstream detail;
  for (const PeerStatus& p : peers) {
    bool relevant = p2p_peer >= 0 ? p.rank == p2p_peer : (!p.responded || p.entered < seq);
    if (!relevant) continue;
    miss.push_back(p.rank);
    detail << "\n  rank " << p.rank << (p.host.empty() ? "" : " (" + p.host + ")") << ": ";
    if (!p.responded)
      detail << "no answer within " << grace_s << " s (exited, finalised, or hung outside MPI)";
    else
      detail << "alive, last entered collective #" << p.entered << ", completed #" << p.completed << " (" << p.current
             << ")";
  }
  if (p2p_peer >= 0) {
    os << "; the peer is rank " << p2p_peer << detail.str();
  } else if (miss.empty()) {
    os << "; every rank entered #" << seq << " but it did not finish: mismatched calls or a stuck transport?";
    for (const PeerStatus& p : peers) os << "\n  rank " << p.rank << ": " << p.current;
  } else {
    os << "; ranks that did not arrive: " << missing_by_node(miss, peers) << detail.str();
  }
  if (missing) *missing = miss;
  return os.str();
}

}  // namespace dtrain::comm::detail

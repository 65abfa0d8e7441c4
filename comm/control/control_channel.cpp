#include "control/control_channel.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <sstream>
#include <thread>

#include "dtrain/comm/mpi_check.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm::detail {
namespace {

constexpr int kQueryTag = 1;  // replies use the tag named in the query (>= 100)

struct Query {
  int32_t reply_tag;
  int32_t unused;
};
struct Reply {
  int64_t entered;
  int64_t completed;
  char current[112];
};

}  // namespace

struct ControlChannel::PendingReply {
  Reply reply{};
  MPI_Request req = MPI_REQUEST_NULL;
};

ControlChannel::ControlChannel(MPI_Comm comm, std::string comm_name) : name_(std::move(comm_name)) {
  DT_MPI_CHECK(MPI_Comm_dup(comm, &ctrl_));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN));
  DT_MPI_CHECK(MPI_Comm_rank(ctrl_, &rank_));
  DT_MPI_CHECK(MPI_Comm_size(ctrl_, &size_));
  // Host names, for reports that name the node of a missing rank.
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  DT_MPI_CHECK(MPI_Get_processor_name(mine, &len));
  std::vector<char> all(static_cast<size_t>(size_) * MPI_MAX_PROCESSOR_NAME);
  DT_MPI_CHECK(MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, ctrl_));
  for (int r = 0; r < size_; ++r) {
    const char* name = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    hosts_.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }
}

ControlChannel::~ControlChannel() { release(); }

void ControlChannel::release() {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    for (auto& r : replies_)
      if (r->req != MPI_REQUEST_NULL) MPI_Request_free(&r->req);
    MPI_Comm_free(&ctrl_);
  }
  replies_.clear();
  ctrl_ = MPI_COMM_NULL;
}

void ControlChannel::note_entered(int64_t seq, const std::string& what) {
  std::lock_guard<std::mutex> lock(state_mu_);
  entered_ = seq;
  current_ = what;
}

void ControlChannel::note_completed(int64_t seq) {
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

void ControlChannel::serve() {
  std::lock_guard<std::mutex> lock(serve_mu_);
  if (ctrl_ == MPI_COMM_NULL) return;
  // Drop answers that have gone out.
  std::erase_if(replies_, [](const std::unique_ptr<PendingReply>& r) {
    int done = 0;
    if (MPI_Test(&r->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
    return done != 0;
  });
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, ctrl_, &flag, &st) != MPI_SUCCESS || !flag) return;
    Query q{};
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kQueryTag, ctrl_, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    auto r = std::make_unique<PendingReply>();
    PeerStatus me = self_status();
    r->reply.entered = me.entered;
    r->reply.completed = me.completed;
    std::strncpy(r->reply.current, me.current.c_str(), sizeof r->reply.current - 1);
    if (MPI_Isend(&r->reply, sizeof r->reply, MPI_BYTE, st.MPI_SOURCE, q.reply_tag, ctrl_, &r->req) == MPI_SUCCESS)
      replies_.push_back(std::move(r));
  }
}

std::vector<PeerStatus> ControlChannel::query(double grace_s) {
  std::vector<PeerStatus> out(static_cast<size_t>(size_));
  out[static_cast<size_t>(rank_)] = self_status();
  for (int r = 0; r < size_; ++r) {
    out[static_cast<size_t>(r)].rank = r;
    if (static_cast<size_t>(r) < hosts_.size()) out[static_cast<size_t>(r)].host = hosts_[static_cast<size_t>(r)];
  }
  if (ctrl_ == MPI_COMM_NULL || size_ == 1) return out;

  int tag = next_tag_.fetch_add(1);
  if (tag > 30000) next_tag_.store(100);  // replies to old queries may linger; tags keep them apart
  size_t n = static_cast<size_t>(size_);
  // One heap block for the query and the replies: if a peer never answers, MPI may still own it.
  std::unique_ptr<char[]> buf(new char[sizeof(Reply) * (n + 1)]);
  auto* replies = reinterpret_cast<Reply*>(buf.get());
  auto* query_msg = reinterpret_cast<Query*>(buf.get() + sizeof(Reply) * n);
  *query_msg = Query{tag, 0};
  std::vector<MPI_Request> sends(n, MPI_REQUEST_NULL), recvs(n, MPI_REQUEST_NULL);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Irecv(&replies[r], sizeof(Reply), MPI_BYTE, r, tag, ctrl_, &recvs[static_cast<size_t>(r)]);
    MPI_Isend(query_msg, sizeof(Query), MPI_BYTE, r, kQueryTag, ctrl_, &sends[static_cast<size_t>(r)]);
  }
  double deadline = now_s() + grace_s;
  int outstanding = size_ - 1;
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

// ---- the control thread ----------------------------------------------------------------------

namespace {
struct ControlService {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<ControlChannel>> channels;
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

void control_service_remove(const ControlChannel* ch) {
  ControlService& s = service();
  std::lock_guard<std::mutex> lock(s.mu);
  std::erase_if(s.channels, [ch](const std::shared_ptr<ControlChannel>& c) { return c.get() == ch; });
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

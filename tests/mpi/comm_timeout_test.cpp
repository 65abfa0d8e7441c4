// Timeouts name what is missing. These use TimeoutAction::Throw so the job survives to check the
// message; comm_early_exit checks the default (abort the job).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "control/control_channel.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"

using namespace dtrain;
using namespace dtrain::comm;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The report groups the missing ranks by node and marks a node none of whose ranks arrived.
TEST(TimeoutReport, NamesTheNodesOfTheMissingRanks) {
  std::vector<PeerStatus> peers(6);
  const char* hosts[] = {"n1", "n1", "n2", "n2", "n3", "n3"};
  for (int r = 0; r < 6; ++r) {
    peers[r].rank = r;
    peers[r].host = hosts[r];
    peers[r].responded = r != 2 && r != 3;
    peers[r].entered = r == 5 ? 6 : 7;
  }
  std::vector<int> missing;
  std::string m = comm::detail::format_timeout_report("allreduce #7 f32[4] sum on 'dp'", 6, 7, -1, 10, 2.5, peers, true, &missing);
  EXPECT_EQ(missing, (std::vector<int>{2, 3, 5}));
  EXPECT_TRUE(contains(m, "ranks that did not arrive: 2, 3 on node n2 (all of its ranks), 5 on node n3\n")) << m;
  EXPECT_TRUE(contains(m, "rank 2 (n2): no answer")) << m;
  EXPECT_TRUE(contains(m, "rank 5 (n3): alive, last entered collective #6")) << m;
}

TEST(Timeout, LateRanksAreNamedAndTheCollectiveStillCompletes) {
  Communicator& w = Runtime::get().world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto c = w.split(0, w.rank(), "late");  // a private communicator for the stuck collective
  c->set_timeout_action(TimeoutAction::Throw);
  Tensor t = Tensor::full({1000}, 1.0f);
  if (c->rank() == 0) {
    auto work = c->allreduce(t, ReduceOp::Sum);
    double t0 = now_s();
    try {
      work->wait(0.4);
      FAIL() << "the allreduce cannot complete while the other ranks sleep";
    } catch (const CommTimeoutError& e) {
      std::string m = e.what();
      EXPECT_TRUE(contains(m, "allreduce #1")) << m;
      EXPECT_TRUE(contains(m, "'late'")) << m;
      EXPECT_TRUE(contains(m, "ranks that did not arrive: 1")) << m;
      const std::string host = Runtime::get().topology().host;
      EXPECT_TRUE(contains(m, "rank 1 (" + host + "): alive, last entered collective #0")) << m;
      std::vector<int> want;
      for (int r = 1; r < c->size(); ++r) want.push_back(r);
      EXPECT_EQ(e.missing_ranks(), want);
      EXPECT_LT(now_s() - t0, 2.0) << "timeout report took too long";
    }
    work->wait();  // the late ranks arrive: the same Work completes
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    c->allreduce(t, ReduceOp::Sum)->wait();
  }
  EXPECT_EQ(t.f32()[999], static_cast<float>(c->size()));
}

TEST(Timeout, RecvTimeoutNamesThePeerAndIsCancelled) {
  Communicator& w = Runtime::get().world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto c = w.split(0, w.rank(), "p2p");
  c->set_timeout_action(TimeoutAction::Throw);
  if (c->rank() == 0) {
    Tensor t = Tensor::zeros({16});
    auto r = c->recv(t, 1, 42);
    try {
      r->wait(0.3);
      FAIL() << "nobody sends with tag 42";
    } catch (const CommTimeoutError& e) {
      std::string m = e.what();
      EXPECT_TRUE(contains(m, "recv #1 f32[16] from rank 1 tag 42")) << m;
      EXPECT_TRUE(contains(m, "the peer is rank 1")) << m;
      EXPECT_EQ(e.missing_ranks(), std::vector<int>{1});
    }
    EXPECT_TRUE(r->completed());
    EXPECT_FALSE(r->error().empty());
  }
  // The communicator is still usable after the cancelled receive.
  Tensor x = Tensor::full({4}, 2.0f);
  c->allreduce(x, ReduceOp::Sum)->wait();
  EXPECT_EQ(x.f32()[0], 2.0f * c->size());
}

TEST(Timeout, QueuedWorkReportsTheCollectiveItIsStuckBehind) {
  Communicator& w = Runtime::get().world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto c = w.split(0, w.rank(), "queue");
  c->set_timeout_action(TimeoutAction::Throw);
  Tensor a = Tensor::full({10}, 1.0f), b = Tensor::full({10}, 1.0f);
  if (c->rank() == 0) {
    auto wa = c->allreduce(a, ReduceOp::Sum);
    auto wb = c->broadcast(b, 0);
    try {
      wb->wait(0.4);
      FAIL() << "must time out";
    } catch (const CommTimeoutError& e) {
      std::string m = e.what();
      EXPECT_TRUE(contains(m, "broadcast #2")) << m;
      EXPECT_TRUE(contains(m, "queued behind collective #1")) << m;
      EXPECT_TRUE(contains(m, "ranks that did not arrive: 1")) << m;
    }
    wa->wait();
    wb->wait();
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    c->allreduce(a, ReduceOp::Sum)->wait();
    c->broadcast(b, 0)->wait();
  }
  EXPECT_EQ(a.f32()[0], static_cast<float>(c->size()));
}

TEST(Timeout, DefaultComesFromTheEnvironmentKnob) {
  // CTest sets DTRAIN_COMM_TIMEOUT=60 for the comm tests.
  const char* v = std::getenv("DTRAIN_COMM_TIMEOUT");
  if (!v) GTEST_SKIP() << "DTRAIN_COMM_TIMEOUT not set";
  EXPECT_DOUBLE_EQ(Runtime::get().world().timeout(), std::atof(v));
}

}  // namespace

// The flight recorder, the desync check's comparison of two ranks' sequences, and the hang
// forensics file. Multi-rank behaviour (a stopped rank, a skipped collective) is tested on real
// `dtrain train` jobs by tests/cluster/hang_test.sh.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "control/flight_recorder.h"
#include "control/forensics.h"
#include "control/sequence_check.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/forensics.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"

using namespace dtrain;
using namespace dtrain::comm;
using namespace dtrain::comm::detail;

// Outside the anonymous namespace: an exported symbol, so that dladdr names it where the frames are
// named without libbacktrace (the clang sanitizer build links this test with -rdynamic).
[[gnu::noinline]] void parked_in_a_test_function(std::mutex& mu, std::condition_variable& cv, const bool& go) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return go; });
}

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

constexpr int64_t kStep1 = 3, kAfterStep1 = 4, kStep2 = 5;  // phases (flight_recorder.h)

CollectiveCall allreduce(int64_t n) {
  return {CollectiveKind::Allreduce, DType::F32, n, static_cast<int32_t>(ReduceOp::Sum)};
}

// A rank's view of its own records, as the check builds it.
SequenceView view_of(const FlightRecorder& r, int rank, int64_t phase, int64_t from = 1) {
  return SequenceView{rank, rank, r.latest(), phase, r.records(from, r.latest())};
}

TEST(FlightRecorder, KeepsTheLastNWithTheirTimes) {
  FlightRecorder r("dp", 1, 2, 4);
  for (int64_t s = 1; s <= 5; ++s) r.issued(s, allreduce(10), kStep1, wall_s());
  r.started(6);  // a worker may start a collective before the caller has recorded it
  r.issued(6, allreduce(20), kStep2, wall_s());
  for (int64_t s = 1; s <= 5; ++s) r.ended(s);
  std::vector<CollectiveRecord> kept = r.records(1, 6);
  ASSERT_EQ(kept.size(), 4u);
  EXPECT_EQ(kept.front().seq, 3);
  EXPECT_EQ(kept.back().seq, 6);
  EXPECT_GT(kept.back().started, 0);
  EXPECT_EQ(kept.back().ended, 0);
  EXPECT_EQ(describe(kept.back()), "allreduce #6 f32 x 20 sum in step 2");
  std::ostringstream os;
  r.write(os);
  EXPECT_TRUE(contains(os.str(),
                       "communicator 'dp' (rank 1 of 2): 6 collectives issued, the last 4 kept; "
                       "completed through #5"))
      << os.str();
  EXPECT_TRUE(contains(os.str(), "allreduce #6 f32 x 20 sum in step 2: enqueued ")) << os.str();
  EXPECT_TRUE(contains(os.str(), "NOT ENDED (running for ")) << os.str();
}

// A rank past step 1 that never issued the collective its neighbour issued in step 1.
TEST(SequenceDifference, NamesARankThatSkippedACollective) {
  FlightRecorder a("dp", 0, 2, 16), b("dp", 1, 2, 16);
  for (int64_t s = 1; s <= 3; ++s) a.issued(s, allreduce(8), kStep1, wall_s());
  for (int64_t s = 1; s <= 2; ++s) b.issued(s, allreduce(8), kStep1, wall_s());
  const std::string m = first_sequence_difference("dp", 2, view_of(a, 0, kStep1), view_of(b, 1, kAfterStep1), 0);
  EXPECT_EQ(m,
            "collective sequences differ on 'dp' (2 ranks) at #3: rank 0 (world rank 0) issued allreduce #3 f32 x "
            "8 sum in step 1; rank 1 (world rank 1) is after step 1 and never issued it (its last on 'dp' is #2)");
  // The same, seen from the other side.
  EXPECT_TRUE(contains(first_sequence_difference("dp", 2, view_of(b, 1, kAfterStep1), view_of(a, 0, kStep1), 0),
                       "rank 1 (world rank 1) is after step 1 and never issued it"));
  // Still in step 1, rank 1 may yet issue it: no difference.
  EXPECT_EQ(first_sequence_difference("dp", 2, view_of(a, 0, kStep1), view_of(b, 1, kStep1), 0), "");
}

TEST(SequenceDifference, NamesTheFirstDifferingCall) {
  FlightRecorder a("world", 0, 2, 16), b("world", 1, 2, 16);
  a.issued(1, allreduce(8), kStep1, wall_s());
  b.issued(1, allreduce(8), kStep1, wall_s());
  a.issued(2, allreduce(8), kStep1, wall_s());
  b.issued(2, {CollectiveKind::Allgather, DType::BF16, 4, 0}, kStep1, wall_s());
  a.issued(3, allreduce(8), kStep1, wall_s());
  b.issued(3, allreduce(8), kStep2, wall_s());
  a.issued(4, allreduce(8), kStep2, wall_s());
  b.issued(4, allreduce(8), kStep2, wall_s());
  const std::string m = first_sequence_difference("world", 2, view_of(a, 0, kStep1), view_of(b, 1, kStep2), 0);
  EXPECT_EQ(m,
            "collective sequences differ on 'world' (2 ranks) at #2: rank 0 (world rank 0) issued allreduce #2 f32 "
            "x 8 sum in step 1, rank 1 (world rank 1) allgather #2 bf16 x 4 in step 1");
  // Records that begin after an unverified difference say so.
  EXPECT_TRUE(contains(first_sequence_difference("world", 2, view_of(a, 0, kStep1, 2), view_of(b, 1, kStep2, 2), 0),
                       "at #2 or before (earlier records are gone)"));
  EXPECT_TRUE(contains(first_sequence_difference("world", 2, view_of(a, 0, kStep2, 4), view_of(b, 1, kStep2, 4), 0),
                       "before #4 (earlier records are gone): rank 0 (world rank 0) and rank 1 (world rank 1) "
                       "issued different sequences up to it"));
}

// Equal sequences, one rank ahead within the phase or the other still in an earlier one.
TEST(SequenceDifference, NoneWhenOnlyTheProgressDiffers) {
  FlightRecorder a("pp", 0, 2, 16), b("pp", 1, 2, 16);
  for (int64_t s = 1; s <= 4; ++s) a.issued(s, allreduce(s), s <= 2 ? kStep1 : kStep2, wall_s());
  for (int64_t s = 1; s <= 2; ++s) b.issued(s, allreduce(s), kStep1, wall_s());
  EXPECT_EQ(first_sequence_difference("pp", 2, view_of(a, 0, kStep2), view_of(b, 1, kAfterStep1), 0), "");
  EXPECT_EQ(first_sequence_difference("pp", 2, view_of(b, 1, kAfterStep1), view_of(a, 0, kStep2), 0), "");
  EXPECT_EQ(first_sequence_difference("pp", 2, view_of(a, 0, 0), view_of(b, 1, 0), 0), "") << "outside a trainer";
}

// The file: the reason, every communicator's recorder and every thread's stack, once per process.
TEST(HangForensics, WritesRecordersAndEveryThreadsBacktrace) {
  Communicator& world = Runtime::get().world();
  const std::string dir = std::string(DTRAIN_BINARY_DIR) + "/forensics-test-" + std::to_string(world.rank());
  std::filesystem::remove_all(dir);
  set_run_dir(dir);
  Tensor t = Tensor::full({3}, 1.0f);
  world.allreduce(t)->wait();
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::thread parked([&] { parked_in_a_test_function(mu, cv, go); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double t0 = now_s();
  const std::string path = write_hang_forensics("a test of the forensics");
  const double took = now_s() - t0;
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  parked.join();
  ASSERT_EQ(path, dir + "/hang-rank" + std::to_string(Runtime::get().topology().rank) + ".txt");
  EXPECT_EQ(write_hang_forensics("again"), path) << "written once per process";
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(contains(text, "\nreason: a test of the forensics\n")) << text;
  EXPECT_TRUE(contains(text, "communicator 'world' (rank " + std::to_string(world.rank()))) << text;
  EXPECT_TRUE(contains(text, "allreduce #")) << text;
  EXPECT_TRUE(contains(text, "parked_in_a_test_function")) << text;  // another thread's stack
  EXPECT_TRUE(contains(text, "(the one writing this file)")) << text;
  EXPECT_FALSE(contains(text, "no stack: the thread did not answer")) << text;
  EXPECT_LT(took, 3.0) << "a hang's forensics must not delay the abort long";
  std::printf("[rank %d] forensics written in %.3f s\n", world.rank(), took);
  std::filesystem::remove_all(dir);
  set_run_dir(".");
}

}  // namespace

// MPI backend collectives on every dtype, checked exactly (inputs whose result is known at any
// rank count, as in nccl-tests' verifiable mode).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "comm_test_util.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/env.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"

using namespace dtrain;
using namespace dtrain::comm;
using dtrain::comm::testing::all_dtypes;
using dtrain::comm::testing::count_wrong;
using dtrain::comm::testing::make_filled;

namespace {

Communicator& world() { return Runtime::get().world(); }

// Rank r contributes (r + 1) * k with k = i % 7 + 1: sums, extremes and means are small exact numbers.
double input(int r, int64_t i) { return (r + 1) * static_cast<double>(i % 7 + 1); }

// op over ranks r = 0..n-1 of (r + 1) * k.
double expected_k(ReduceOp op, DType dt, int n, double k) {
  double sum = k * n * (n + 1) / 2;
  switch (op) {
    case ReduceOp::Sum:
      return sum;
    case ReduceOp::Max:
      return k * n;
    case ReduceOp::Min:
      return k;
    case ReduceOp::Avg:
      if (dt == DType::F32 || dt == DType::BF16 || dt == DType::F16) return sum / n;
      return static_cast<double>(static_cast<int64_t>(sum) / n);  // integers truncate
  }
  return 0;
}
double expected(ReduceOp op, DType dt, int n, int64_t i) {
  return expected_k(op, dt, n, static_cast<double>(i % 7 + 1));
}

// Sets the allreduce algorithm of a communicator for one scope.
class AlgorithmScope {
 public:
  AlgorithmScope(Communicator& c, AllreduceAlgorithm a) : c_(c), before_(c.allreduce_algorithm()) {
    c.set_allreduce_algorithm(a);
  }
  ~AlgorithmScope() { c_.set_allreduce_algorithm(before_); }

 private:
  Communicator& c_;
  AllreduceAlgorithm before_;
};

const AllreduceAlgorithm kAlgorithms[] = {AllreduceAlgorithm::Auto, AllreduceAlgorithm::Mpi, AllreduceAlgorithm::Shm,
                                          AllreduceAlgorithm::Hier};

class AllreduceTest : public ::testing::TestWithParam<std::tuple<DType, ReduceOp>> {};

TEST_P(AllreduceTest, ExactOnEveryRank) {
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const DType dt = std::get<0>(GetParam());
  const ReduceOp op = std::get<1>(GetParam());
  Communicator& c = world();
  for (AllreduceAlgorithm algorithm : kAlgorithms) {
    AlgorithmScope scope(c, algorithm);
    // Sizes below, within and over several shared-memory chunks (CTest sets DTRAIN_SHM_CHUNK_MB
    // small), one not a multiple of the 64-byte cuts.
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}, int64_t{1} << 18}) {
      Tensor t = make_filled(n, dt, [&](int64_t i) { return input(c.rank(), i); });
      c.allreduce(t, op)->wait();
      std::string first;
      int64_t wrong = count_wrong(
          t, [&](int64_t i) { return expected(op, dt, c.size(), i); }, &first);
      EXPECT_EQ(wrong, 0) << dtype_name(dt) << " " << reduce_op_name(op) << " n=" << n << " by "
                          << allreduce_algorithm_name(c.allreduce_plan(t, op)) << ": " << first;
    }
  }
}

// What the layout is: nodes of DTRAIN_TEST_RANKS_PER_NODE world ranks where the hook is set.
struct Layout {
  int nodes = 1;
  bool uniform = true;  // every node holds as many ranks, more than one
};
Layout layout_of(const Communicator& c) {
  const long per_node = env::get_long("DTRAIN_TEST_RANKS_PER_NODE");
  const Topology& topo = Runtime::get().topology();
  if (per_node <= 0) return {topo.node_count, topo.size % topo.node_count == 0 && topo.local_size > 1};
  return {static_cast<int>((c.size() + per_node - 1) / per_node), c.size() % per_node == 0 && per_node > 1};
}

TEST(TopologyAllreduce, PlanFollowsTheLayout) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const Layout layout = layout_of(c);
  using A = AllreduceAlgorithm;
  const A across = layout.nodes == 1 ? A::Shm : layout.uniform ? A::Hier : A::Mpi;
  Tensor big = Tensor::zeros({1 << 20});  // 4 MiB
  Tensor small = Tensor::zeros({16});
  Tensor ints = Tensor::zeros({1 << 20}, DType::I32);
  const std::pair<A, A> want[] = {
      {A::Mpi, A::Mpi}, {A::Shm, layout.nodes == 1 ? A::Shm : A::Mpi}, {A::Hier, across}, {A::Auto, across}};
  for (auto [set, expect] : want) {
    AlgorithmScope scope(c, set);
    EXPECT_EQ(c.allreduce_plan(big, ReduceOp::Sum), expect)
        << allreduce_algorithm_name(set) << " on " << layout.nodes << " node(s)";
    EXPECT_EQ(c.allreduce_plan(ints, ReduceOp::Sum), A::Mpi) << "i32 always goes through MPI";
  }
  AlgorithmScope scope(c, A::Auto);
  EXPECT_EQ(c.allreduce_plan(small, ReduceOp::Sum), A::Mpi) << "auto keeps small messages on MPI_Allreduce";
  // A split communicator keeps the algorithm.
  c.set_allreduce_algorithm(A::Shm);
  EXPECT_EQ(c.split(0, c.rank())->allreduce_algorithm(), A::Shm);
}

TEST(TopologyAllreduce, EveryRankGetsTheSameBits) {
  // Random values: each element is folded once, by one rank, so every rank must hold the same
  // bits; on 2 ranks x0 + x1 is also MPI's own result.
  Communicator& c = world();
  const int64_t n = 300001;
  Rng rng(1234 + static_cast<uint64_t>(c.rank()));
  Tensor x = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) x.f32()[i] = static_cast<float>(rng.normal());
  Tensor by_mpi = x.clone();
  {
    AlgorithmScope scope(c, AllreduceAlgorithm::Mpi);
    c.allreduce(by_mpi, ReduceOp::Sum)->wait();
  }
  for (AllreduceAlgorithm algorithm : kAlgorithms) {
    AlgorithmScope scope(c, algorithm);
    Tensor t = x.clone();
    c.allreduce(t, ReduceOp::Sum)->wait();
    Tensor all = Tensor::empty({n * c.size()});
    c.allgather(t, all)->wait();
    int64_t differ = 0, far = 0;
    for (int r = 0; r < c.size(); ++r) differ += std::memcmp(all.f32() + r * n, t.f32(), n * sizeof(float)) != 0;
    for (int64_t i = 0; i < n; ++i) far += std::abs(t.f32()[i] - by_mpi.f32()[i]) > 1e-5f * (1 + std::abs(t.f32()[i]));
    const char* name = allreduce_algorithm_name(c.allreduce_plan(t, ReduceOp::Sum));
    EXPECT_EQ(differ, 0) << name << ": ranks hold different sums";
    EXPECT_EQ(far, 0) << name << ": sums away from MPI_Allreduce's";
    if (c.size() == 2) {
      EXPECT_EQ(std::memcmp(t.f32(), by_mpi.f32(), n * sizeof(float)), 0) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypesAndOps, AllreduceTest,
    ::testing::Combine(::testing::Values(DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8),
                       ::testing::Values(ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min)),
    [](const auto& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + "_" + reduce_op_name(std::get<1>(info.param));
    });

TEST(Collectives, HalfTypesReduceAsFloatsNotWords) {
  // Negative values: as raw 16-bit words -1 (0xBF80 in bf16) compares below -2 (0xC000), so an
  // integer op on the words would get max and min backwards and the sum wrong.
  Communicator& c = world();
  const int n = c.size();
  for (DType dt : {DType::BF16, DType::F16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg}) {
      Tensor t = make_filled(257, dt, [&](int64_t i) { return -(c.rank() + 1.0) * (i % 2 ? 0.5 : 1.0); });
      c.allreduce(t, op)->wait();
      double want = op == ReduceOp::Sum   ? -n * (n + 1) / 2.0
                    : op == ReduceOp::Max ? -1.0
                    : op == ReduceOp::Min ? -n
                                          : -(n + 1) / 2.0;
      std::string first;
      EXPECT_EQ(count_wrong(
                    t, [&](int64_t i) { return want * (i % 2 ? 0.5 : 1.0); }, &first),
                0)
          << dtype_name(dt) << " " << reduce_op_name(op) << ": " << first;
    }
  }
}

TEST(Collectives, BroadcastFromEveryRoot) {
  Communicator& c = world();
  for (DType dt : all_dtypes()) {
    for (int root = 0; root < c.size(); ++root) {
      Tensor t = make_filled(4097, dt, [&](int64_t i) { return c.rank() == root ? (root + 1) * (i % 5 + 1) : 99; });
      c.broadcast(t, root)->wait();
      std::string first;
      EXPECT_EQ(count_wrong(
                    t, [&](int64_t i) { return (root + 1) * (i % 5 + 1); }, &first),
                0)
          << dtype_name(dt) << " root " << root << ": " << first;
    }
  }
}

// Whether `work` ran through the node's shared-memory window (its description says so), and
// whether it should have: on one node of several ranks, under auto from 64 KiB, under shm and hier.
bool on_window(const Work& work) { return work.description().find(" shm on '") != std::string::npos; }
bool window_expected(const Communicator& c, AllreduceAlgorithm algorithm, size_t bytes) {
  if (c.size() == 1 || layout_of(c).nodes > 1 || algorithm == AllreduceAlgorithm::Mpi) return false;
  return algorithm != AllreduceAlgorithm::Auto || bytes >= (64 << 10);
}

// Small blocks (MPI's) and blocks of several 256 KiB chunks with a short tail (the node window's
// under every algorithm but mpi, on one node; MPI's across nodes).
TEST(Collectives, AllgatherPlacesBlockRFromRankR) {
  Communicator& c = world();
  for (AllreduceAlgorithm algorithm : kAlgorithms) {
    AlgorithmScope scope(c, algorithm);
    for (int64_t m : {int64_t{333}, int64_t{100003}}) {
      for (DType dt : all_dtypes()) {
        for (bool in_place : {false, true}) {  // in place: `in` is this rank's block of `out`
          Tensor in = make_filled(m, dt, [&](int64_t i) { return c.rank() + 1 + i % 3; });
          Tensor out = Tensor::empty({m * c.size()}, dt);
          if (in_place) {
            Tensor mine = out.slice0(c.rank() * m, (c.rank() + 1) * m);
            std::memcpy(mine.raw(), in.raw(), in.nbytes());
            in = mine;
          }
          std::shared_ptr<Work> w = c.allgather(in, out);
          w->wait();
          std::string first;
          EXPECT_EQ(count_wrong(
                        out, [&](int64_t i) { return static_cast<double>(i / m + 1 + (i % m) % 3); }, &first),
                    0)
              << dtype_name(dt) << " " << m << (in_place ? " in place " : " ") << w->description() << ": " << first;
          EXPECT_EQ(on_window(*w), window_expected(c, algorithm, out.nbytes())) << w->description();
        }
      }
    }
  }
}

// Rank r sends rank q (r + 2q) % 3 bytes (none to some), each byte 16 * r + q; block r of what q
// receives is rank r's block q (the counts differ each way, so swapped counts fail).
TEST(Collectives, AlltoallvDeliversBlocksOfUnequalSizes) {
  Communicator& c = world();
  const int n = c.size(), me = c.rank();
  std::vector<int64_t> send_counts, recv_counts;
  for (int q = 0; q < n; ++q) {
    send_counts.push_back((me + 2 * q) % 3);
    recv_counts.push_back((q + 2 * me) % 3);
  }
  std::vector<uint8_t> bytes;
  for (int q = 0; q < n; ++q)
    bytes.insert(bytes.end(), static_cast<size_t>(send_counts[q]), static_cast<uint8_t>(16 * me + q));
  Tensor in = Tensor::empty({static_cast<int64_t>(bytes.size()) + 1}, DType::U8);
  std::copy(bytes.begin(), bytes.end(), in.data<uint8_t>());
  Tensor out = Tensor::zeros({2 * n + 1}, DType::U8);
  c.alltoallv(in, send_counts, out, recv_counts)->wait();
  std::vector<uint8_t> want;
  for (int r = 0; r < n; ++r)
    want.insert(want.end(), static_cast<size_t>(recv_counts[r]), static_cast<uint8_t>(16 * r + me));
  EXPECT_EQ(std::vector<uint8_t>(out.data<uint8_t>(), out.data<uint8_t>() + want.size()), want);
  EXPECT_THROW(c.alltoallv(in, {1}, out, {1}), Error);  // a count per rank
}

TEST(Collectives, ReduceScatterGivesRankRItsBlock) {
  Communicator& c = world();
  const int n = c.size();
  for (AllreduceAlgorithm algorithm : kAlgorithms) {
    AlgorithmScope scope(c, algorithm);
    for (int64_t m : {int64_t{100}, int64_t{100003}}) {
      for (DType dt : all_dtypes()) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
          // Block b, element j on rank r: (r + 1) * (b + 1 + j % 3).
          Tensor in = make_filled(m * n, dt, [&](int64_t i) { return (c.rank() + 1) * (i / m + 1 + (i % m) % 3); });
          Tensor out = Tensor::empty({m}, dt);
          std::shared_ptr<Work> w = c.reduce_scatter(in, out, op);
          w->wait();
          std::string first;
          auto want = [&](int64_t j) { return expected_k(op, dt, n, static_cast<double>(c.rank() + 1 + j % 3)); };
          EXPECT_EQ(count_wrong(out, want, &first), 0)
              << dtype_name(dt) << " " << reduce_op_name(op) << " " << m << " " << w->description() << ": " << first;
          EXPECT_EQ(on_window(*w), dt == DType::F32 && window_expected(c, algorithm, in.nbytes())) << w->description();
        }
      }
    }
  }
}

TEST(Collectives, SendRecvRingLargeAndSmall) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (int64_t n : {int64_t{3}, int64_t{1} << 20}) {  // eager and rendezvous protocols
    Tensor out = make_filled(n, DType::F32, [&](int64_t i) { return c.rank() * 1000 + i % 100; });
    Tensor in = Tensor::zeros({n}, DType::F32);
    auto r = c.recv(in, prev, 7);
    auto s = c.send(out, next, 7);
    r->wait();
    s->wait();
    std::string first;
    EXPECT_EQ(count_wrong(
                  in, [&](int64_t i) { return prev * 1000 + i % 100; }, &first),
              0)
        << first;
  }
}

TEST(Collectives, RecvOfWrongSizeIsAnError) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  if (c.rank() == 0) {
    Tensor small = Tensor::zeros({10}, DType::F32);
    Tensor big = Tensor::zeros({20}, DType::F32);
    c.send(small, 1, 3)->wait();
    (void)big;
  } else if (c.rank() == 1) {
    Tensor big = Tensor::zeros({20}, DType::F32);
    auto w = c.recv(big, 0, 3);
    try {
      w->wait();
      ADD_FAILURE() << "a 10-element message into a 20-element recv must fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected 20"), std::string::npos) << e.what();
    }
  }
  c.barrier();
}

TEST(Collectives, BarrierWaitsForTheSlowestRank) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  c.barrier();
  double t0 = now_s();
  if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  c.barrier();
  if (c.rank() != 0) {
    EXPECT_GE(now_s() - t0, 0.25);
  }
}

TEST(Collectives, SplitEvenOdd) {
  Communicator& c = world();
  int color = c.rank() % 2;
  auto sub = c.split(color, -c.rank());  // key reverses the order
  ASSERT_NE(sub, nullptr);
  int expect_size = (c.size() + 1 - color) / 2;
  EXPECT_EQ(sub->size(), expect_size);
  EXPECT_EQ(sub->rank(), expect_size - 1 - c.rank() / 2);
  Tensor t = make_filled(5, DType::I64, [&](int64_t) { return c.rank(); });
  sub->allreduce(t, ReduceOp::Sum)->wait();
  int64_t want = 0;
  for (int r = color; r < c.size(); r += 2) want += r;
  EXPECT_EQ(t.data<int64_t>()[0], want);
  // A rank passing kNoColor joins nothing.
  auto none = c.split(c.rank() == 0 ? Communicator::kNoColor : 0, 0);
  EXPECT_EQ(none == nullptr, c.rank() == 0);
  if (none) {
    EXPECT_EQ(none->size(), c.size() - 1);
    none->barrier();
  }
}

TEST(Collectives, ManyInFlightWaitedInReverse) {
  Communicator& c = world();
  std::vector<Tensor> ts;
  std::vector<std::shared_ptr<Work>> ws;
  for (int k = 0; k < 16; ++k) {
    ts.push_back(make_filled(10000 + k, DType::F32, [&](int64_t i) { return (c.rank() + 1) * (k + i % 3); }));
    ws.push_back(c.allreduce(ts.back(), ReduceOp::Sum));
  }
  for (int k = 15; k >= 0; --k) {
    ws[static_cast<size_t>(k)]->wait();
    std::string first;
    double tri = c.size() * (c.size() + 1) / 2.0;
    EXPECT_EQ(count_wrong(
                  ts[static_cast<size_t>(k)], [&](int64_t i) { return tri * (k + i % 3); }, &first),
              0)
        << "k=" << k << ": " << first;
  }
  EXPECT_GT(ws.back()->sequence(), ws.front()->sequence());
}

TEST(Collectives, ProgressWhileTheCallerComputes) {
  // The caller makes no MPI call between launch and test(): the transfer must still finish.
  Communicator& c = world();
  Tensor t = Tensor::full({1 << 21}, 1.0f);  // 8 MiB
  c.barrier();
  double t0 = now_s();
  c.allreduce(t, ReduceOp::Sum)->wait();
  double blocking = now_s() - t0;
  c.barrier();
  auto w = c.allreduce(t, ReduceOp::Sum);
  auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(4 * blocking + 0.2);
  volatile double sink = 0;
  while (std::chrono::steady_clock::now() < until) sink = sink + 1.0;  // compute, no MPI
  EXPECT_TRUE(w->completed()) << "allreduce did not progress during " << 4 * blocking + 0.2 << " s of compute";
  w->wait();
  EXPECT_EQ(t.f32()[0], static_cast<float>(c.size()) * c.size());
}

TEST(Collectives, InputChecksNameTheProblem) {
  Communicator& c = world();
  Tensor in = Tensor::zeros({4});
  Tensor out = Tensor::zeros({4 * c.size() + 1});
  try {
    c.allgather(in, out);
    FAIL() << "wrong out size accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("size() * in.numel()"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.broadcast(in, c.size()), Error);
  EXPECT_THROW(c.send(in, c.rank(), 0), Error);
}

}  // namespace

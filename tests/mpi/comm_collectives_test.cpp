// MPI backend collectives on every dtype, checked exactly (inputs whose result is known at any
// rank count, as in nccl-tests' verifiable mode).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "comm_test_util.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
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

class AllreduceTest : public ::testing::TestWithParam<std::tuple<DType, ReduceOp>> {};

TEST_P(AllreduceTest, ExactOnEveryRank) {
  auto [dt, op] = GetParam();
  Communicator& c = world();
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1} << 18}) {
    Tensor t = make_filled(n, dt, [&](int64_t i) { return input(c.rank(), i); });
    c.allreduce(t, op)->wait();
    std::string first;
    int64_t wrong = count_wrong(
        t, [&](int64_t i) { return expected(op, dt, c.size(), i); }, &first);
    EXPECT_EQ(wrong, 0) << dtype_name(dt) << " " << reduce_op_name(op) << " n=" << n << ": " << first;
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

TEST(Collectives, AllgatherPlacesBlockRFromRankR) {
  Communicator& c = world();
  for (DType dt : all_dtypes()) {
    const int64_t m = 333;
    Tensor in = make_filled(m, dt, [&](int64_t i) { return c.rank() + 1 + i % 3; });
    Tensor out = Tensor::empty({m * c.size()}, dt);
    c.allgather(in, out)->wait();
    std::string first;
    EXPECT_EQ(count_wrong(
                  out, [&](int64_t i) { return static_cast<double>(i / m + 1 + (i % m) % 3); }, &first),
              0)
        << dtype_name(dt) << ": " << first;
  }
}

TEST(Collectives, ReduceScatterGivesRankRItsBlock) {
  Communicator& c = world();
  const int n = c.size();
  for (DType dt : all_dtypes()) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      const int64_t m = 100;
      // Block b, element j on rank r: (r + 1) * (b + 1 + j % 3).
      Tensor in = make_filled(m * n, dt, [&](int64_t i) { return (c.rank() + 1) * (i / m + 1 + (i % m) % 3); });
      Tensor out = Tensor::empty({m}, dt);
      c.reduce_scatter(in, out, op)->wait();
      std::string first;
      auto want = [&](int64_t j) { return expected_k(op, dt, n, static_cast<double>(c.rank() + 1 + j % 3)); };
      EXPECT_EQ(count_wrong(out, want, &first), 0) << dtype_name(dt) << " " << reduce_op_name(op) << ": " << first;
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

// Bootstrap: topology, the table, MPI errors as typed errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/comm/runtime.h"

using namespace dtrain;
using namespace dtrain::comm;

namespace {

TEST(Runtime, TopologyMatchesMpi) {
  const Topology& t = Runtime::get().topology();
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(t.rank, rank);
  EXPECT_EQ(t.size, size);
  EXPECT_EQ(Runtime::get().world().rank(), rank);
  EXPECT_EQ(Runtime::get().world().size(), size);
  EXPECT_GE(t.local_rank, 0);
  EXPECT_LT(t.local_rank, t.local_size);
  EXPECT_GE(t.node_index, 0);
  EXPECT_LT(t.node_index, t.node_count);
  EXPECT_FALSE(t.host.empty());
  EXPECT_GE(t.threads_per_rank, 1);
  EXPECT_EQ(t.mpi_thread_level, MPI_THREAD_MULTIPLE) << "Open MPI 4.1 grants MULTIPLE";
  EXPECT_TRUE(Runtime::get().threaded_progress());
  // Node-local sizes add up: summing 1/local_size over the ranks counts the nodes.
  double nodes = 1.0 / t.local_size;
  MPI_Allreduce(MPI_IN_PLACE, &nodes, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_NEAR(nodes, t.node_count, 1e-9);
  // Local ranks on one node are distinct: the sum over the node is local_size*(local_size-1)/2.
  int lr = t.local_rank, lr_sum = 0;
  MPI_Comm node;
  MPI_Comm_split(MPI_COMM_WORLD, t.node_index, t.rank, &node);
  MPI_Allreduce(&lr, &lr_sum, 1, MPI_INT, MPI_SUM, node);
  MPI_Comm_free(&node);
  EXPECT_EQ(lr_sum, t.local_size * (t.local_size - 1) / 2);
}

TEST(Runtime, InitIsIdempotent) {
  Runtime& a = Runtime::get();
  Runtime& b = Runtime::init(nullptr, nullptr);
  EXPECT_EQ(&a, &b);
  EXPECT_TRUE(Runtime::initialized());
}

TEST(Runtime, TopologyTableOnRankZeroListsEveryRank) {
  std::string table = Runtime::get().topology_table();
  const Topology& t = Runtime::get().topology();
  if (t.rank != 0) {
    EXPECT_TRUE(table.empty());
    return;
  }
  EXPECT_NE(table.find(std::to_string(t.size) + " ranks"), std::string::npos) << table;
  EXPECT_NE(table.find(t.host), std::string::npos) << table;
  // One line per rank plus the two header lines (fewer than 32 ranks here).
  size_t lines = static_cast<size_t>(std::count(table.begin(), table.end(), '\n'));
  EXPECT_GE(lines, static_cast<size_t>(t.size) + 2) << table;
  std::cout << table;
}

TEST(Runtime, BindingWarningWhenThreadsOutnumberCores) {
  Topology t = Runtime::get().topology();
  EXPECT_EQ(t.binding_warning(t.bound_cores), "");
  std::string w = t.binding_warning(t.bound_cores + 1);
  EXPECT_NE(w.find("--bind-to none"), std::string::npos) << w;
}

TEST(Runtime, MpiErrorsBecomeTypedErrorsWithRankAndMpiText) {
  int rank = Runtime::get().topology().rank;
  int x = 0;
  try {
    DT_MPI_CHECK(MPI_Bcast(&x, 1, MPI_INT, 1 << 20, mpi_comm_of(Runtime::get().world())));
    FAIL() << "an invalid root must fail";
  } catch (const Error& e) {
    std::string w = e.what();
    EXPECT_NE(w.find("MPI_Bcast failed"), std::string::npos) << w;
    EXPECT_NE(w.find("MPI_ERR_ROOT"), std::string::npos) << w;
    EXPECT_NE(w.find("rank " + std::to_string(rank) + " on "), std::string::npos) << w;
    EXPECT_EQ(e.domain(), "mpi");
  }
}

TEST(Runtime, BandwidthFormulasMatchNcclTests) {
  EXPECT_DOUBLE_EQ(alg_bandwidth(1e9, 0.5), 2e9);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("allreduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("allreduce", 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("allgather", 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor("broadcast", 8), 1.0);
}

}  // namespace

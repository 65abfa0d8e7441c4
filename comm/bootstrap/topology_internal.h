#pragma once
// Shared by runtime.cpp and topology.cpp.
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/runtime.h"

namespace dtrain::comm::detail {

std::string detect_launcher();
// One rank's row of the topology table: fixed-size so that ranks can MPI_Gather it as bytes.
struct TopologyRow {
  int32_t rank, node_index, local_rank, local_size, cuda_device, threads, bound, node_cores;
  char host[64];
};
std::string format_topology_table(const Topology& me, const std::vector<TopologyRow>& rows, bool threaded);

}  // namespace dtrain::comm::detail

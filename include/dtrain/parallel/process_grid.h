#pragma once
// The 3-D process grid: world = dp x tp x pp. Tensor-parallel ranks are neighbours (they exchange
// activations every layer, so they should share a node), then data parallel, then pipeline:
//   world rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
// Each dimension has its own communicator from Communicator::split (MPI_Comm_split underneath).
#include <memory>

#include "dtrain/comm/communicator.h"

namespace dtrain::parallel {

class ProcessGrid {
 public:
  // Collective over `world`. Throws InputError when tp * pp does not divide the world size.
  ProcessGrid(comm::Communicator& world, int tp, int pp);

  int dp_size() const { return dp_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }
  int dp_rank() const { return dp_rank_; }
  int tp_rank() const { return tp_rank_; }
  int pp_rank() const { return pp_rank_; }
  comm::Communicator& world() { return world_; }
  comm::Communicator& dp() { return *dp_comm_; }
  comm::Communicator& tp() { return *tp_comm_; }
  comm::Communicator& pp() { return *pp_comm_; }
  // The world rank at grid coordinates (dp, tp, pp).
  int rank_of(int dp_rank, int tp_rank, int pp_rank) const { return (pp_rank * dp_ + dp_rank) * tp_ + tp_rank; }

 private:
  comm::Communicator& world_;
  int dp_, tp_, pp_;
  int dp_rank_, tp_rank_, pp_rank_;
  std::unique_ptr<comm::Communicator> dp_comm_, tp_comm_, pp_comm_;
};

}  // namespace dtrain::parallel

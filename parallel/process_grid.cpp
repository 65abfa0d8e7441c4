#include "dtrain/parallel/process_grid.h"

#include "dtrain/core/error.h"

namespace dtrain::parallel {

ProcessGrid::ProcessGrid(comm::Communicator& world, int tp, int pp) : world_(world), tp_(tp), pp_(pp) {
  const int n = world.size();
  DT_INPUT_CHECK(tp >= 1 && pp >= 1 && n % (tp * pp) == 0,
                 "--tp " << tp << " x --pp " << pp << " must divide the " << n << " ranks (dp is the rest)");
  dp_ = n / (tp * pp);
  const int r = world.rank();
  tp_rank_ = r % tp;
  dp_rank_ = (r / tp) % dp_;
  pp_rank_ = r / (tp * dp_);
  // Every rank makes the three splits in the same order (split is collective over world).
  tp_comm_ = world.split(pp_rank_ * dp_ + dp_rank_, tp_rank_, "tp");
  dp_comm_ = world.split(pp_rank_ * tp_ + tp_rank_, dp_rank_, "dp");
  pp_comm_ = world.split(dp_rank_ * tp_ + tp_rank_, pp_rank_, "pp");
}

}  // namespace dtrain::parallel

#pragma once
// ZeRO-3's shard-by-shard initialisation. The model's constructor hands each unit to this sink as
// it completes it (nn::UnitSink); the sink keeps this rank's block of the unit's flat values (the
// layout ShardedDataParallel uses: the parameters in forward order, padded to a multiple of the
// ranks) and leaves the values empty, so a rank holds at most one whole unit at any time. The
// values are drawn exactly as without a sink: every layout starts from a one-rank run's numbers.
// ShardedDataParallel over the same units and ranks then starts from these blocks. A unit with
// frozen parameters (by name, as the trainer will freeze them) is kept as two: its trained
// parameters' block and its frozen ones', as ShardedDataParallel cuts it.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"

namespace dtrain::parallel {

class ShardedInit final : public nn::UnitSink {
 public:
  struct Unit {
    std::vector<nn::Parameter*> params;  // forward order
    std::vector<Shape> shapes;           // their values' shapes (the values are empty)
    Tensor block;                        // this rank's block of the unit's flat values (host)
  };

  // rank: this rank's place among the `ranks` the units are sharded over; frozen: whether a
  // parameter will be frozen, by its name within the unit's modules (none when empty).
  ShardedInit(int rank, int ranks, std::function<bool(const std::string&)> frozen = {});
  void unit_built(const std::vector<nn::Module*>& entries) override;

  const Unit* find(const nn::Parameter* first) const;  // the unit whose first parameter is `first`
  void free_block(const nn::Parameter* first);         // that unit's block, once the shard holds it
  bool empty() const { return units_.empty(); }        // no unit was built into it
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  int64_t parameter_count() const;          // the elements of the units' values
  std::vector<int64_t> unit_sizes() const;  // per unit

 private:
  void keep_block(std::vector<nn::Parameter*> params);  // one unit's (or part's) block; values dropped

  int rank_, ranks_;
  std::function<bool(const std::string&)> frozen_;
  std::map<const nn::Parameter*, Unit> units_;
};

// A unit's parameters: those of its entries, each once, in order.
std::vector<nn::Parameter*> unit_parameters(const std::vector<nn::Module*>& entries);

// The elements of each rank's block of a unit of `numel` values over `ranks` ranks: the unit's flat
// vector padded to a multiple of the ranks, cut in equal blocks.
inline int64_t unit_block_numel(int64_t numel, int64_t ranks) { return (numel + ranks - 1) / ranks; }

}  // namespace dtrain::parallel

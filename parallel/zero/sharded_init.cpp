#include "dtrain/parallel/zero/sharded_init.h"

#include <algorithm>
#include <set>
#include <utility>

namespace dtrain::parallel {

std::vector<nn::Parameter*> unit_parameters(const std::vector<nn::Module*>& entries) {
  std::vector<nn::Parameter*> params;
  std::set<nn::Parameter*> seen;
  for (nn::Module* m : entries)
    for (nn::Parameter* p : m->parameters())
      if (seen.insert(p).second) params.push_back(p);
  return params;
}

ShardedInit::ShardedInit(int rank, int ranks, std::function<bool(const std::string&)> frozen)
    : rank_(rank), ranks_(ranks), frozen_(std::move(frozen)) {
  DT_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "ShardedInit: rank " << rank << " of " << ranks);
}

void ShardedInit::unit_built(const std::vector<nn::Module*>& entries) {
  std::vector<nn::Parameter*> trained = unit_parameters(entries), frozen;
  if (frozen_) {
    const auto at = std::stable_partition(trained.begin(), trained.end(),
                                          [&](const nn::Parameter* p) { return !frozen_(p->name); });
    frozen.assign(at, trained.end());
    trained.erase(at, trained.end());
  }
  if (!trained.empty()) keep_block(std::move(trained));
  if (!frozen.empty()) keep_block(std::move(frozen));
}

void ShardedInit::keep_block(std::vector<nn::Parameter*> params) {
  Unit u;
  u.params = std::move(params);
  int64_t numel = 0;
  for (const nn::Parameter* p : u.params) numel += p->value.numel();
  const int64_t block = unit_block_numel(numel, ranks_), begin = rank_ * block;
  u.block = Tensor::zeros({block});
  int64_t offset = 0;
  for (nn::Parameter* p : u.params) {
    DT_CHECK(p->value.dtype() == DType::F32 && p->value.device().is_cpu(),
             "shard-by-shard initialisation takes f32 values on the host; " << p->name << " is " << p->value.str());
    const int64_t n = p->value.numel();
    const int64_t first = std::max(begin, offset), last = std::min(begin + block, offset + n);
    if (first < last)
      std::copy(p->value.f32() + (first - offset), p->value.f32() + (last - offset), u.block.f32() + (first - begin));
    u.shapes.push_back(p->value.shape());
    p->placement.freed_shape = p->value.shape();
    nn::drop_values(*p);  // so is the gradient the layer made whole
    offset += n;
  }
  const nn::Parameter* first = u.params.front();
  units_[first] = std::move(u);
}

const ShardedInit::Unit* ShardedInit::find(const nn::Parameter* first) const {
  auto it = units_.find(first);
  return it == units_.end() ? nullptr : &it->second;
}

void ShardedInit::free_block(const nn::Parameter* first) { units_.at(first).block = Tensor(); }

int64_t ShardedInit::parameter_count() const {
  int64_t n = 0;
  for (int64_t s : unit_sizes()) n += s;
  return n;
}

std::vector<int64_t> ShardedInit::unit_sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& [first, u] : units_) {
    int64_t n = 0;
    for (const Shape& s : u.shapes) n += shape_numel(s);
    sizes.push_back(n);
  }
  return sizes;
}

}  // namespace dtrain::parallel

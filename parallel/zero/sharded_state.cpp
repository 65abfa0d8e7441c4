// ShardedDataParallel's optimizer state and checkpoints (sharded_data_parallel.h): the optimizer's
// groups over this rank's pieces, state to and from the one-rank layout, the pieces a checkpoint
// writes and those it loads back, population-based training's state tensors.
#include <algorithm>
#include <tuple>

#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::parallel {

std::vector<optim::ParamGroup> ShardedDataParallel::optimizer_groups(
    const std::vector<optim::ParamGroup>& model_groups) {
  std::vector<optim::ParamGroup> groups;
  for (const optim::ParamGroup& g : model_groups) {
    optim::ParamGroup& mine = groups.emplace_back(g);
    mine.params.clear();
    for (nn::Parameter* p : g.params)
      if (auto it = piece_of_.find(p); it != piece_of_.end()) mine.params.push_back(it->second);
  }
  return groups;
}

std::pair<const ShardedDataParallel::Unit*, size_t> ShardedDataParallel::find(const std::string& param) const {
  for (const Unit& u : units_)
    for (size_t i = 0; i < u.params.size(); ++i)
      if (u.params[i]->name == param) return {&u, i};
  DT_CHECK(false, "sharded data parallel: no parameter " << param);
  return {nullptr, 0};
}

std::pair<int64_t, std::string> ShardedDataParallel::place_in_shard(const optim::StateTensor& st) const {
  const size_t dot = st.name.rfind('.');
  auto it = dot == std::string::npos ? start_in_shard_.end() : start_in_shard_.find(st.name.substr(0, dot));
  DT_CHECK(it != start_in_shard_.end(), "optimizer state " << st.name << " is of no piece of this rank's shard");
  return {it->second, st.name.substr(dot + 1)};
}

std::map<std::string, Tensor> ShardedDataParallel::gather_state(const std::vector<optim::StateTensor>& state) {
  // Each kind of state as this rank's shard (padding zero), then every unit's blocks gathered.
  std::map<std::string, Tensor> by_kind;
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_shard(st);
    Tensor& shard = by_kind[kind];
    if (!shard.defined()) shard = zeros_on(shard_.grad.shape(), device_);
    Tensor part = shard.slice0(start, start + st.value->numel());
    copy_any(st.value->reshape({st.value->numel()}), part);
  }
  std::map<std::string, Tensor> full;
  for (const auto& [kind, shard] : by_kind)
    for (Unit& u : units_) {
      if (u.frozen) continue;  // no state
      Tensor whole = zeros_on({u.padded}, device_);
      if (shards().size() > 1)
        shards().allgather(grad_block(shard, u), whole)->wait();
      else
        engine_for(device_).copy(grad_block(shard, u), whole);
      const Tensor host = to_host(whole);
      for (size_t i = 0; i < u.params.size(); ++i) full[u.params[i]->name + "." + kind] = view(host, u, i).clone();
    }
  return full;
}

void ShardedDataParallel::load_state(const std::map<std::string, Tensor>& full,
                                     const std::vector<optim::StateTensor>& state) {
  const int64_t r = shards().rank();
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_shard(st);
    const std::string param = st.name.substr(0, st.name.size() - kind.size() - 1);
    const auto [u, i] = find(param);
    const std::string name = param + "." + kind;
    auto it = full.find(name);
    DT_INPUT_CHECK(it != full.end(), "no optimizer state " << name);
    DT_INPUT_CHECK(it->second.shape() == u->shapes[i], "optimizer state " << name << " is " << it->second.str()
                                                                          << ", parameter " << param << " is "
                                                                          << shape_str(u->shapes[i]));
    // The piece starts at element max(block start, offset) of the unit: that minus the offset in
    // the parameter.
    const int64_t from = std::max(r * block_numel(*u), u->offset[i]) - u->offset[i];
    Tensor dst = st.value->reshape({st.value->numel()});
    copy_any(it->second.reshape({it->second.numel()}).slice0(from, from + dst.numel()), dst);
  }
}

std::map<std::string, Tensor> ShardedDataParallel::shard_pieces(const std::vector<optim::StateTensor>& state) const {
  std::map<std::string, Tensor> out;
  if (cross_ && cross_->rank() != 0) return out;  // --shard-scope node: the first node's ranks write the pieces
  auto put = [&](const std::string& key, const std::string& param, const Tensor& piece) {
    const std::vector<int64_t>& range = piece_range_.at(param);
    out[key] = to_host(piece.reshape({piece.numel()})).clone();
    out["range/" + key] = Tensor::empty({static_cast<int64_t>(range.size())}, DType::I64);
    std::copy(range.begin(), range.end(), out["range/" + key].data<int64_t>());
  };
  for (const nn::Parameter& piece : pieces_) put("param/" + piece.name, piece.name, piece.value);
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_shard(st);
    (void)start;
    put("optim/" + st.name, st.name.substr(0, st.name.size() - kind.size() - 1), *st.value);
  }
  return out;
}

std::vector<Tensor*> ShardedDataParallel::parameter_state(const std::vector<nn::Parameter*>&,
                                                          const std::vector<nn::Parameter*>& pieces) {
  std::vector<Tensor*> out;
  for (nn::Parameter* p : pieces) out.push_back(&p->value);
  return out;
}

// The pieces were overwritten: ZeRO-2 gathers the blocks into the whole values; ZeRO-3 drops what a
// pass kept gathered (the next pass gathers the new masters).
void ShardedDataParallel::state_replaced() {
  if (opt_.zero == 2) {
    allgather_values(true);
    return;
  }
  for (Unit& u : units_) release(u);
}

// Each key's destination on this rank, which starts at element `begin` of the tensor: its piece of
// a value (ZeRO-3's shard master; at ZeRO-2 a view of the whole value, whose other blocks
// broadcast_state then gathers from their owners) or of a state tensor. So a rank reads only the
// parts that hold some of its own pieces, at either stage.
void ShardedDataParallel::load_pieces(const PieceSource& for_each_piece, const std::vector<optim::StateTensor>& state) {
  DT_CHECK(!hold_, "load_pieces while the whole model is held: releasing it would overwrite the loaded masters");
  struct Target {
    Tensor dst;
    int64_t begin = 0;
    Shape shape;  // the parameter's
    int64_t filled = 0;
  };
  std::map<std::string, Target> targets;
  for (Unit& u : units_) release(u);  // ZeRO-3: no unit keeps values from before
  auto piece_shape = [&](const std::string& param) {
    const std::vector<int64_t>& range = piece_range_.at(param);
    return std::make_pair(range[0], Shape(range.begin() + 2, range.end()));
  };
  for (nn::Parameter& piece : pieces_) {
    const auto [begin, shape] = piece_shape(piece.name);
    targets["param/" + piece.name] = {piece.value.reshape({piece.value.numel()}), begin, shape};
  }
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_shard(st);
    (void)start;
    const auto [begin, shape] = piece_shape(st.name.substr(0, st.name.size() - kind.size() - 1));
    targets["optim/" + st.name] = {st.value->reshape({st.value->numel()}), begin, shape};
  }
  // A key's elements [from, from + count) that this rank holds, as [first, last) (empty: none).
  auto overlap = [&](const std::string& key, int64_t from, int64_t count) -> std::tuple<Target*, int64_t, int64_t> {
    const auto it = targets.find(key);
    if (it == targets.end()) return {nullptr, 0, 0};  // another rank's pieces, or state this optimizer has not
    Target& t = it->second;
    return {&t, std::max(from, t.begin), std::min(from + count, t.begin + t.dst.numel())};
  };
  const PieceWanted wants = [&](const std::string& key, int64_t from, int64_t count, const Shape& shape) {
    const auto [t, first, last] = overlap(key, from, count);
    if (!t) return false;
    DT_INPUT_CHECK(shape == t->shape, key << " is " << shape_str(shape) << ", this model's " << shape_str(t->shape));
    return first < last;
  };
  const PieceTaker take = [&](const std::string& key, int64_t from, const Shape& shape, const Tensor& values) {
    if (!wants(key, from, values.numel(), shape)) return;
    const auto [t, first, last] = overlap(key, from, values.numel());
    Tensor dst = t->dst.slice0(first - t->begin, last - t->begin);
    copy_any(values.slice0(first - from, last - from), dst);
    t->filled += last - first;
  };
  for_each_piece(take, wants);
  for (const auto& [key, t] : targets)
    DT_INPUT_CHECK(t.filled == t.dst.numel(), "the shard parts give " << t.filled << " of the " << t.dst.numel()
                                                                      << " elements of " << key
                                                                      << " that this rank holds");
}

}  // namespace dtrain::parallel

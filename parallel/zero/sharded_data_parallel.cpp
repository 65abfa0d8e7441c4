#include "dtrain/parallel/zero/sharded_data_parallel.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "dtrain/core/timer.h"
#include "dtrain/parallel/zero/sharded_init.h"

namespace dtrain::parallel {

namespace {
// A value or gradient between passes: empty, of the parameter's rank (what decides its optimizer
// group: optim::decay_groups keeps vectors undecayed).
Tensor empty_like_rank(const Shape& shape, Device dev) {
  return Tensor::empty(Shape(shape.size(), 0), DType::F32, dev);
}
}  // namespace

ShardGroups shard_groups(comm::Communicator& dp, const std::string& scope) {
  if (scope != "node") return {};
  comm::NodeSplit split = comm::split_by_node(dp);
  DT_INPUT_CHECK(split.uniform,
                 "option --shard-scope node needs as many data-parallel ranks on every node; "
                 "this job's nodes hold different counts");
  if (split.cross->size() == 1) return {};  // on one node the node is the whole data-parallel group
  return {std::move(split.node), std::move(split.cross)};
}

ShardedDataParallel::ShardedDataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt)
    : model_(model), comm_(comm), opt_(opt) {
  DT_CHECK(opt.zero == 2 || opt.zero == 3, "ShardedDataParallel takes ZeRO 2 or 3, not " << opt.zero);
  DT_INPUT_CHECK(opt.gather_dtype == DType::F32 || opt.gather_dtype == DType::BF16,
                 "option --zero-gather-dtype must be f32 or bf16");
  DT_INPUT_CHECK(opt.shard_scope == "all" || opt.shard_scope == "node",
                 "option --shard-scope must be all or node, got '" << opt.shard_scope << "'");
  if (opt.compression != "none") {
    hook_ = make_grad_hook({opt.compression, opt.compression_scope, opt.seed}, comm);
    if (opt.momentum_correction > 0) hook_->set_momentum_correction(opt.momentum_correction);
  }
  ShardGroups groups = shard_groups(comm, opt.shard_scope);
  node_ = std::move(groups.node);
  cross_ = std::move(groups.cross);
  cut_into_units();
  lay_out_units();
  make_pieces();
  install_hooks();
}

// The model's units (Module::shard_units), each with the parameters its modules hold and the key a
// per-tensor compressor gives each (data parallel's: last parameter first, so its state and draws,
// PowerSGD's first factors, are the unsharded run's).
void ShardedDataParallel::cut_into_units() {
  const nn::ShardUnits cut = model_.shard_units();
  DT_INPUT_CHECK(!cut.entries.empty(), "option --zero " << opt_.zero << ": the model (" << model_.kind()
                                                        << ") cannot be cut into units to shard");
  order_ = cut.entries;
  units_.resize(static_cast<size_t>(*std::max_element(cut.unit_of.begin(), cut.unit_of.end()) + 1));
  std::set<nn::Parameter*> seen;
  for (size_t pos = 0; pos < order_.size(); ++pos) {
    Unit& u = units_[static_cast<size_t>(cut.unit_of[pos])];
    u.entries.push_back(static_cast<int>(pos));
    for (nn::Parameter* p : order_[pos]->parameters())
      if (seen.insert(p).second) u.params.push_back(p);
  }
  const std::vector<nn::Parameter*> all = model_.parameters();
  std::map<const nn::Parameter*, int> from_last;
  for (size_t i = 0; i < all.size(); ++i) {
    DT_INPUT_CHECK(seen.count(all[i]), "option --zero " << opt_.zero << ": parameter " << all[i]->name
                                                        << " is in no unit of " << model_.kind()
                                                        << ", so it cannot be sharded");
    from_last[all[i]] = static_cast<int>(all.size() - 1 - i);
  }
  device_ = all.front()->value.device();
  for (Unit& u : units_)
    for (nn::Parameter* p : u.params) u.bucket.push_back(from_last.at(p));
  split_frozen();
  units_at_.assign(order_.size(), {});
  for (Unit& u : units_)
    for (int e : u.entries) units_at_[static_cast<size_t>(e)].push_back(&u);
}

// A unit's frozen parameters become a unit of their own after all others, with the same modules
// (a unit of frozen parameters only is marked so where it is); the trained part keeps its place,
// so a compressor's keys stay those of the run without frozen parameters.
void ShardedDataParallel::split_frozen() {
  const size_t count = units_.size();
  for (size_t k = 0; k < count; ++k) {
    Unit trained, frozen;
    for (size_t i = 0; i < units_[k].params.size(); ++i) {
      Unit& part = units_[k].params[i]->frozen ? frozen : trained;
      part.params.push_back(units_[k].params[i]);
      part.bucket.push_back(units_[k].bucket[i]);
    }
    if (frozen.params.empty()) continue;
    if (trained.params.empty()) {
      units_[k].frozen = true;
      continue;
    }
    // Built shard by shard, a unit's blocks are laid out as ShardedInit cut it: cut here alike only
    // where it did; elsewhere the frozen parameters keep their places in the unit's gradient (zeros).
    const ShardedInit::Unit* built = opt_.built ? opt_.built->find(trained.params.front()) : nullptr;
    if (opt_.built && !(built && built->params == trained.params)) continue;
    units_[k].params = std::move(trained.params);
    units_[k].bucket = std::move(trained.bucket);
    frozen.entries = units_[k].entries;
    frozen.frozen = true;
    units_.push_back(std::move(frozen));
  }
}

// Each unit's flat layout and this rank's blocks. Every rank's model holds the same initial values
// (drawn from the seed): each keeps its blocks of them, and at ZeRO-3 frees the rest; or, built
// shard by shard (opt.built), each rank kept only its blocks while the model was built.
void ShardedDataParallel::lay_out_units() {
  const int64_t world = shards().size();
  DT_CHECK(!opt_.built || (opt_.zero == 3 && opt_.built->ranks() == world && opt_.built->rank() == shards().rank()),
           "the model was built in blocks for rank " << opt_.built->rank() << " of " << opt_.built->ranks()
                                                     << ", not for this ZeRO-" << opt_.zero << " group");
  int64_t shard_total = 0, grad_total = 0;
  std::vector<const ShardedInit::Unit*> built;
  for (Unit& u : units_) {
    built.push_back(opt_.built ? opt_.built->find(u.params.front()) : nullptr);
    DT_CHECK(!opt_.built || (built.back() && built.back()->params == u.params),
             "unit of " << u.params.front()->name << " was not built as this model cuts it");
    for (size_t i = 0; i < u.params.size(); ++i) {
      nn::Parameter* p = u.params[i];
      DT_CHECK(p->value.dtype() == DType::F32 && p->value.device() == device_,
               "sharded data parallel keeps f32 parameters on one device; " << p->name << " is " << p->value.str());
      u.offset.push_back(u.numel);
      u.shapes.push_back(built.back() ? built.back()->shapes[i] : p->value.shape());
      p->placement.freed_shape = u.shapes.back();  // ZeRO-3 empties the value between passes
      u.numel += shape_numel(u.shapes.back());
    }
    u.padded = unit_block_numel(u.numel, world) * world;
    u.shard_begin = shard_total;
    shard_total += u.padded / world;
    u.grad_begin = grad_total;
    if (!u.frozen) grad_total += u.padded / world;
  }
  // ZeRO-2's masters are the whole values themselves (each piece a view of its block of them);
  // ZeRO-3 keeps this rank's blocks in a buffer of their own.
  // Built in blocks, the shard is written block by block as the blocks are freed (its pages are
  // touched no sooner): the two are not held at once.
  if (opt_.zero == 3)
    shard_.value = opt_.built ? Tensor::empty({shard_total}, DType::F32, device_) : zeros_on({shard_total}, device_);
  shard_.grad = zeros_on({grad_total}, device_);
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = units_[k];
    if (built[k]) {
      Tensor mine = shard_block(shard_.value, u);
      copy_any(built[k]->block, mine);
      opt_.built->free_block(u.params.front());
      for (size_t i = 0; i < u.params.size(); ++i) u.params[i]->value = empty_like_rank(u.shapes[i], device_);
      empty_grads(u);
      continue;
    }
    u.full = zeros_on({u.padded}, device_);
    if (opt_.zero == 3) {  // one unit at a time (release counts it out); ZeRO-2's values are its parameters
      gathered_bytes_ += static_cast<int64_t>(u.full.nbytes());
      peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
    }
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor part = view(u.full, u, i);
      copy_any(u.params[i]->value, part);
    }
    point_values(u);
    take_shard(u);
    empty_grads(u);
    release(u);
  }
  opt_.built = nullptr;  // the blocks are the shard now; the sink goes with the build
}

// The parameters' parts in this rank's blocks: 1-D views into the shard (named as their
// parameters), what optimizer_groups hands out, with their ranges for shard_pieces.
void ShardedDataParallel::make_pieces() {
  size_t count = 0;
  for (const Unit& u : units_) count += u.params.size();
  pieces_.reserve(count);  // piece_of_ keeps pointers into it
  const int64_t r = shards().rank();
  for (Unit& u : units_) {
    const int64_t b = block_numel(u), begin = r * b;
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t first = std::max(begin, u.offset[i]);
      const int64_t last = std::min(begin + b, u.offset[i] + shape_numel(u.shapes[i]));
      if (first >= last) continue;
      nn::Parameter& piece = pieces_.emplace_back();
      piece.name = u.params[i]->name;
      const int64_t at = u.shard_begin + first - begin, grad_at = u.grad_begin + first - begin;
      piece.value = opt_.zero == 3 ? shard_.value.slice0(at, at + last - first) : u.full.slice0(first, last);
      piece_of_[u.params[i]] = &piece;
      if (!u.frozen) {  // a frozen piece is a value only (checkpoints'): no gradient, no optimizer state
        piece.grad = shard_.grad.slice0(grad_at, grad_at + last - first);
        start_in_shard_[piece.name] = grad_at;
      }
      std::vector<int64_t>& range = piece_range_[piece.name];
      range = {first - u.offset[i], last - first};
      range.insert(range.end(), u.shapes[i].begin(), u.shapes[i].end());
    }
  }
  DT_INPUT_CHECK(!pieces_.empty(), "option --zero " << opt_.zero << " over " << shards().size()
                                                    << " ranks: the model's parameters leave rank " << r
                                                    << " nothing to hold");
  // The optimizer state's gathers run per trained unit on the ranks that hold any of it.
  const bool trains = std::any_of(units_.begin(), units_.end(), [](const Unit& u) { return !u.frozen; });
  DT_INPUT_CHECK(!trains || !start_in_shard_.empty(), "option --zero " << opt_.zero << " over " << shards().size()
                                                                      << " ranks: the trained parameters leave rank "
                                                                      << r << " no optimizer state");
}

ShardedDataParallel::~ShardedDataParallel() {
  for (nn::Module* m : order_) m->set_pass_hooks(nullptr);
  try {
    retire_finished(true);  // nothing may still write into the blocks once they are freed
    for (Unit& u : units_)
      if (u.gathering) u.gathering->wait();
  } catch (const std::exception&) {
  }
}

void ShardedDataParallel::install_hooks() {
  for (size_t pos = 0; pos < order_.size(); ++pos) {
    const int e = static_cast<int>(pos);
    auto hooks = std::make_shared<nn::PassHooks>();
    hooks->before_forward = [this, e, units = units_at_[pos]] {
      for (Unit* u : units) before_forward(*u, e);
    };
    hooks->after_forward = [this, e, units = units_at_[pos]] {
      for (Unit* u : units) after_forward(*u, e);
    };
    hooks->before_backward = [this, e, units = units_at_[pos]] {
      for (Unit* u : units) before_backward(*u, e);
    };
    hooks->after_backward = [this, e, units = units_at_[pos]] {
      for (Unit* u : units) after_backward(*u, e);
    };
    order_[pos]->set_pass_hooks(hooks);
  }
}

Tensor ShardedDataParallel::shard_block(const Tensor& shard, const Unit& u) const {
  return shard.slice0(u.shard_begin, u.shard_begin + block_numel(u));
}

Tensor ShardedDataParallel::grad_block(const Tensor& shard, const Unit& u) const {
  return shard.slice0(u.grad_begin, u.grad_begin + block_numel(u));
}

Tensor ShardedDataParallel::view(const Tensor& flat, const Unit& u, size_t i) {
  return flat.slice0(u.offset[i], u.offset[i] + shape_numel(u.shapes[i])).reshape(u.shapes[i]);
}

void ShardedDataParallel::point_values(Unit& u) {
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i]->value = view(u.full, u, i);
}

void ShardedDataParallel::take_shard(Unit& u) {
  if (opt_.zero == 2) return;  // the pieces are views of the whole values
  Tensor block = shard_block(shard_.value, u);
  engine_for(device_).copy(u.full.slice0(shards().rank() * block_numel(u), (shards().rank() + 1) * block_numel(u)),
                           block);
}

// ---- the passes -------------------------------------------------------------------------------

void ShardedDataParallel::before_forward(Unit& u, int entry) {
  if (entry == u.entries.front()) u.forwards = 0;
  if (opt_.zero == 3) {
    start_gather(u);
    finish_gather(u);
    if (opt_.prefetch) prefetch(entry + 1);
  }
}

void ShardedDataParallel::after_forward(Unit& u, int entry) {
  ++u.forwards;
  if (entry != u.entries.back()) return;  // a later module of the unit still reads its values
  if (order_[static_cast<size_t>(entry)]->training() && !opt_.reshard_after_forward) return;  // kept for backward
  release(u);
}

void ShardedDataParallel::before_backward(Unit& u, int entry) {
  if (entry == u.entries.back()) u.backwards = 0;
  if (opt_.zero == 3) {
    start_gather(u);
    finish_gather(u);
    if (opt_.prefetch) prefetch(entry - 1);
  }
  if (u.frozen || u.grad.defined()) return;
  u.grad = take_buffer(u.padded);
  engine_for(device_).fill(u.grad, 0.f);
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i]->grad = view(u.grad, u, i);
  grad_bytes_ += static_cast<int64_t>(u.grad.nbytes());
  peak_grad_bytes_ = std::max(peak_grad_bytes_, grad_bytes_);
}

void ShardedDataParallel::after_backward(Unit& u, int entry) {
  ++u.backwards;
  if (entry != u.entries.front()) return;  // an earlier module of the unit still adds to its gradient
  if (u.frozen || hook_) {
    if (!u.frozen && syncing_) exchange_compressed(u);
    release(u);
    return;
  }
  // The step's first gradient of the unit goes straight into its block of the shard (which holds
  // zeros: the same bits as adding it there); later micro-batches' are added when they arrive.
  const bool first = !std::exchange(u.in_shard, true);
  Pending p{&u, first ? grad_block(shard_.grad, u) : Tensor::empty({block_numel(u)}, DType::F32, device_), nullptr,
            false, first};
  const int64_t w0 = wire_bytes();
  if (shards().size() > 1)
    p.work = shards().reduce_scatter(u.grad, p.block, comm::ReduceOp::Avg);
  else
    engine_for(device_).copy(u.grad, p.block);
  stats_.bytes_sent += wire_bytes() - w0;
  stats_.bytes_reduced += static_cast<int64_t>(u.grad.nbytes());
  ++stats_.collectives;
  pending_.push_back(std::move(p));
  release(u);
  retire_finished(false);
}

void ShardedDataParallel::prefetch(int entry) {
  if (entry < 0 || entry >= static_cast<int>(order_.size())) return;
  for (Unit* u : units_at_[static_cast<size_t>(entry)]) start_gather(*u);
}

// ---- gathering and freeing a unit's values ------------------------------------------------------

void ShardedDataParallel::start_gather(Unit& u) {
  if (u.full.defined()) return;  // gathered, or on its way
  const DType wire = hold_ ? DType::F32 : opt_.gather_dtype;
  u.full = take_buffer(u.padded);
  gathered_bytes_ += static_cast<int64_t>(u.full.nbytes());
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_ + spare_bytes_);
  const Tensor mine = shard_block(shard_.value, u);
  Engine& e = engine_for(device_);
  u.fresh = true;
  if (shards().size() == 1) {
    e.copy(mine, u.full);
    return;
  }
  const int64_t w0 = wire_bytes();
  if (wire == DType::F32) {
    u.gathering = shards().allgather(mine, u.full);
  } else {
    u.wire_block = Tensor::empty({block_numel(u)}, wire, device_);
    e.cast(mine, u.wire_block);
    u.wire = Tensor::empty({u.padded}, wire, device_);
    u.gathering = shards().allgather(u.wire_block, u.wire);
  }
  stats_.bytes_sent += wire_bytes() - w0;
  ++stats_.collectives;
}

void ShardedDataParallel::finish_gather(Unit& u) {
  if (!u.fresh) return;
  if (u.gathering) {
    const double t0 = now_s();
    u.gathering->wait();
    stats_.comm_wait_s += now_s() - t0;
    u.gathering.reset();
  }
  if (u.wire.defined()) {
    engine_for(device_).cast(u.wire, u.full);
    u.wire = Tensor();
    u.wire_block = Tensor();
  }
  u.fresh = false;
  point_values(u);
  nn::update_working_copies(u.params, engine_for(device_).math_precision());
}

void ShardedDataParallel::release(Unit& u) {
  if (opt_.zero != 3 || hold_ || !u.full.defined()) return;
  if (u.gathering) {
    u.gathering->wait();
    u.gathering.reset();
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    u.params[i]->value = empty_like_rank(u.shapes[i], device_);
    u.params[i]->working = Tensor();
  }
  u.fresh = false;
  gathered_bytes_ -= static_cast<int64_t>(u.full.nbytes());
  give_buffer(u.full);
  u.wire = Tensor();
  u.wire_block = Tensor();
}

// A freed unit buffer (values or gradient) is kept for the next unit of its size, as the blocks of a
// model are alike: a pass then allocates nothing and touches no fresh pages. One at most; the
// memory report counts them with the gathered units.
Tensor ShardedDataParallel::take_buffer(int64_t numel) {
  for (auto it = spare_.begin(); it != spare_.end(); ++it)
    if (it->numel() == numel) {
      Tensor t = *it;
      spare_.erase(it);
      spare_bytes_ -= static_cast<int64_t>(t.nbytes());
      return t;
    }
  return Tensor::empty({numel}, DType::F32, device_);
}

void ShardedDataParallel::give_buffer(Tensor& t) {
  if (spare_.empty()) {
    spare_bytes_ += static_cast<int64_t>(t.nbytes());
    spare_.push_back(t);
    peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_ + spare_bytes_);
  }
  t = Tensor();
}

// ---- the step -----------------------------------------------------------------------------------

void ShardedDataParallel::begin_backward(bool sync) {
  syncing_ = sync || !hook_;  // compressed exchanges wait for the micro-batch that syncs
  retire_finished(true);      // a gradient buffer still being reduce-scattered is not written again
  if (step_open_) return;
  engine_for(device_).fill(shard_.grad, 0.f);  // the step's first micro-batch
  step_open_ = true;
}

// Moves p on as far as it goes without waiting (or to its end with `wait`): its reduce-scatter, then
// with --shard-scope node the average of its block between the nodes. Whether both are done.
bool ShardedDataParallel::advance(Pending& p, bool wait) {
  const double t0 = now_s();
  if (p.work) {
    if (!wait && !p.work->test()) return false;
    p.work->wait();
    p.work.reset();
  }
  if (cross_ && !p.crossed) {
    const int64_t w0 = cross_->wire_bytes_sent();
    p.work = cross_->allreduce(p.block, comm::ReduceOp::Avg);
    stats_.bytes_sent += cross_->wire_bytes_sent() - w0;
    ++stats_.collectives;
    p.crossed = true;
    return advance(p, wait);
  }
  if (wait) stats_.comm_wait_s += now_s() - t0;
  return true;
}

void ShardedDataParallel::retire(Pending& p) {
  if (!p.into_shard) {
    Tensor mine = grad_block(shard_.grad, *p.unit);
    engine_for(device_).axpy(1.f, p.block, mine);
  }
  free_grad(*p.unit);
}

void ShardedDataParallel::free_grad(Unit& u) {
  grad_bytes_ -= static_cast<int64_t>(u.grad.nbytes());
  give_buffer(u.grad);
  empty_grads(u);
}

void ShardedDataParallel::empty_grads(Unit& u) {
  for (size_t i = 0; i < u.params.size(); ++i)
    u.params[i]->grad = u.frozen ? Tensor() : empty_like_rank(u.shapes[i], device_);
}

void ShardedDataParallel::retire_finished(bool wait_all) {
  // In issue order: a reduce-scatter completes before a later one on the same communicator.
  size_t done = 0;
  while (done < pending_.size() && advance(pending_[done], wait_all)) retire(pending_[done++]);
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
}

void ShardedDataParallel::finish() {
  // A unit whose modules this step's graph skipped never reduce-scattered: every rank must issue
  // the same collectives, so its (zero) gradient goes now.
  for (size_t pos = 0; pos < order_.size(); ++pos)
    for (Unit* u : units_at_[pos])
      if (!u->frozen && u->backwards == 0 && static_cast<int>(pos) == u->entries.front()) {
        before_backward(*u, static_cast<int>(pos));
        for (int e : u->entries) after_backward(*u, e);
      }
  retire_finished(true);
  if (hook_) keep_compressed_blocks();
  for (Unit& u : units_) {
    u.backwards = 0;
    u.in_shard = false;
  }
  step_open_ = false;
}

void ShardedDataParallel::after_step() {
  if (opt_.zero == 2) allgather_values(false);  // ZeRO-3: the next forward gathers the updated blocks
}

// Frozen units' values change only by a load (frozen_too).
void ShardedDataParallel::allgather_values(bool frozen_too) {
  if (shards().size() == 1) return;  // the optimizer updated the whole values
  const double t0 = now_s();
  std::vector<std::shared_ptr<comm::Work>> works;
  for (Unit& u : units_) {
    if (u.frozen && !frozen_too) continue;
    const int64_t b = block_numel(u);
    const int64_t w0 = wire_bytes();
    works.push_back(shards().allgather(u.full.slice0(shards().rank() * b, (shards().rank() + 1) * b), u.full));
    stats_.bytes_sent += wire_bytes() - w0;
    ++stats_.collectives;
  }
  for (auto& w : works) w->wait();
  stats_.comm_wait_s += now_s() - t0;
}

DataParallel::GradientParts ShardedDataParallel::gradient_parts(const nn::Parameter& p) {
  const auto [unit, i] = find(p.name);
  GradientParts g{shape_numel(unit->shapes[i]), false, {}, device_};
  if (const auto it = piece_of_.find(&p); it != piece_of_.end())
    g.parts.push_back({piece_range_.at(p.name).front(), it->second->grad});
  return g;
}

double ShardedDataParallel::grad_norm() { return sharded_norm(shard_.grad, shards()); }  // replicas hold the same

// ---- compression -------------------------------------------------------------------------------

void ShardedDataParallel::exchange_compressed(Unit& u) {
  const int64_t before = hook_->bytes_sent();
  if (hook_->per_tensor()) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor g = u.grad.slice0(u.offset[i], u.offset[i] + shape_numel(u.shapes[i]));
      const int64_t rows = u.shapes[i].size() >= 2 ? u.shapes[i][0] : 1;
      compressed_works_.push_back(hook_->run(g, u.bucket[i], rows));
    }
  } else {
    compressed_works_.push_back(hook_->run(u.grad, static_cast<int>(&u - units_.data()), 0));
  }
  stats_.bytes_sent += hook_->bytes_sent() - before;
  stats_.bytes_reduced += static_cast<int64_t>(u.grad.nbytes());
  ++stats_.collectives;
  compressed_units_.push_back(&u);
}

void ShardedDataParallel::keep_compressed_blocks() {
  const double t0 = now_s();
  for (auto& w : compressed_works_) w->wait();
  const int64_t before = hook_->bytes_sent();
  hook_->finish_step();
  stats_.bytes_sent += hook_->bytes_sent() - before;
  stats_.comm_wait_s += now_s() - t0;
  compressed_works_.clear();
  for (Unit* u : compressed_units_) {
    const int64_t b = block_numel(*u);
    Tensor mine = grad_block(shard_.grad, *u);
    engine_for(device_).axpy(1.f, u->grad.slice0(shards().rank() * b, (shards().rank() + 1) * b), mine);
    free_grad(*u);
  }
  compressed_units_.clear();
}

std::map<std::string, Tensor> ShardedDataParallel::compression_state() const {
  return hook_ ? hook_->state() : std::map<std::string, Tensor>{};
}

void ShardedDataParallel::load_compression_state(const std::map<std::string, Tensor>& state) {
  if (hook_)
    hook_->load_state(state);
  else
    DataParallel::load_compression_state(state);
}

void ShardedDataParallel::set_step(int64_t step) {
  if (hook_) hook_->on_step(step, opt_.compression_warmup_steps);
}

// ---- whole values, for checkpoints and the start ---------------------------------------------------

void ShardedDataParallel::hold_whole_model(bool on) {
  if (on == hold_) return;
  if (on) {
    if (opt_.gather_dtype != DType::F32)
      for (Unit& u : units_) release(u);  // kept values may be bf16-rounded: gather the masters
    hold_ = true;                         // gathers in f32 from here
    for (Unit& u : units_) start_gather(u);
    for (Unit& u : units_) finish_gather(u);
    return;
  }
  reload_shard();  // values written meanwhile (a checkpoint's) become the masters
  hold_ = false;
  for (Unit& u : units_) release(u);
}

void ShardedDataParallel::reload_shard() {
  for (Unit& u : units_)
    if (whole(u)) take_shard(u);
}

// ZeRO-2's whole values are gathered from their blocks' owners (a resume loaded only its own
// pieces: load_pieces); at ZeRO-3 every rank's blocks came from the same seed or the set, and only
// held values travel.
void ShardedDataParallel::broadcast_state(int root) {
  if (opt_.zero == 2) allgather_values(true);
  std::vector<std::shared_ptr<comm::Work>> works;
  for (Unit& u : units_)
    if (opt_.zero == 3 && hold_) works.push_back(comm_.broadcast(u.full, root));
  broadcast_with_buffers(model_, comm_, device_, root, std::move(works));
  reload_shard();
}

std::map<std::string, int64_t> ShardedDataParallel::memory_bytes() const {
  int64_t whole_params = 0;
  if (opt_.zero == 2)
    for (const Unit& u : units_) whole_params += static_cast<int64_t>(u.full.nbytes());
  return {{"parameters", whole_params},
          {"master shard", shard_.value.defined() ? static_cast<int64_t>(shard_.value.nbytes()) : 0},
          {"gradient shard", static_cast<int64_t>(shard_.grad.nbytes())},
          {"gathered units (peak)", peak_gathered_bytes_},
          {"gradient buffers (peak)", peak_grad_bytes_}};
}

}  // namespace dtrain::parallel

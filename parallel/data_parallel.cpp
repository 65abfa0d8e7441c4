#include "dtrain/parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include "dtrain/core/timer.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::parallel {

DataParallel::~DataParallel() = default;

void DataParallel::load_compression_state(const std::map<std::string, Tensor>& state) {
  DT_INPUT_CHECK(state.empty(), "gradient compression state given to a run without --compression");
}

ReplicatedDataParallel::ReplicatedDataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt)
    : model_(model), comm_(comm), opt_(opt) {
  DT_INPUT_CHECK(opt.bucket_bytes > 0, "data parallel: bucket size must be positive");
  DT_CHECK(opt.zero == 0 || opt.zero == 1, "ReplicatedDataParallel takes ZeRO 0 or 1, not " << opt.zero);
  DT_INPUT_CHECK(opt.zero != 1 || opt.compression == "none" || opt.compression_scope == "all",
                 "option --compression-scope inter-node does not combine with --zero1");
  hook_ = make_grad_hook({opt.compression, opt.compression_scope, opt.seed}, comm);
  if (opt.momentum_correction > 0) hook_->set_momentum_correction(opt.momentum_correction);
  std::vector<nn::Parameter*> params = model.parameters();
  DT_CHECK(!params.empty(), "data parallel needs a model with parameters");
  Device dev = params.front()->value.device();
  int64_t trained = 0, frozen = 0;
  for (nn::Parameter* p : params) {
    DT_CHECK(p->value.dtype() == DType::F32 && p->value.device() == dev,
             "data parallel keeps f32 parameters on one device; " << p->name << " is " << p->value.str());
    (p->frozen ? frozen : trained) += p->value.numel();
  }
  const int64_t world = comm.size();
  const int64_t padded = (trained + world - 1) / world * world;
  // The trained parameters (padded), then the frozen ones, which have no gradient: the flat
  // gradient, its buckets and ZeRO-1's slices cover the trained part only.
  flat_param_ = zeros_on({padded + frozen}, dev);
  flat_grad_ = zeros_on({padded}, dev);
  int64_t frozen_at = padded;
  for (nn::Parameter* p : params) {
    if (!p->frozen) continue;
    Tensor v = flat_param_.slice0(frozen_at, frozen_at + p->value.numel()).reshape(p->value.shape());
    engine_for(dev).copy(p->value, v);
    p->value = v;
    p->grad = Tensor();
    offset_[p] = frozen_at;
    frozen_at += p->value.numel();
  }

  // Lay the trained parameters out last-first: backward finishes them roughly in this order, so
  // the first bucket fills first and goes out first.
  // A compressor that factorises tensors (PowerSGD, layer by layer as PyTorch's PowerSGD hook: each
  // weight as its [out, in*kh*kw] matrix; a square reshape of a flat bucket has no low-rank
  // structure to find) gets every tensor as its own bucket. (Top-k stays on flat buckets: measured
  // on Fashion-MNIST, a per-tensor 1 % starves the layers that matter most.)
  const bool layerwise = hook_->per_tensor();
  int64_t off = 0;
  Bucket cur;
  const int64_t bucket_elems = layerwise ? 1 : std::max<int64_t>(1, opt_.bucket_bytes / 4);
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    nn::Parameter* p = *it;
    if (p->frozen) continue;
    int64_t n = p->value.numel();
    Tensor v = flat_param_.slice0(off, off + n).reshape(p->value.shape());
    Tensor g = flat_grad_.slice0(off, off + n).reshape(p->value.shape());
    engine_for(dev).copy(p->value, v);
    engine_for(dev).copy(p->grad, g);
    p->value = v;
    p->grad = g;
    bucket_of_[p] = buckets_.size();
    offset_[p] = off;
    ++cur.params;
    off += n;
    cur.end = off;
    if (layerwise) cur.rows = p->value.dim() >= 2 ? p->value.size(0) : 1;
    if (cur.end - cur.begin >= bucket_elems) {
      buckets_.push_back(cur);
      cur = Bucket{off, off, 0, 0, 0, nullptr};
    }
  }
  if (cur.params) buckets_.push_back(cur);
  if (padded > off) {  // the padding travels in a bucket of its own (zeros, for reduce-scatter)
    buckets_.push_back(Bucket{off, padded, 0, 0, 0, nullptr});
  }

  if (zero1()) make_shard(trained);
  model_.set_grad_ready_hook([this](nn::Parameter& p) { on_grad_ready(p); });
}

ReplicatedDataParallel::~ReplicatedDataParallel() {
  model_.set_grad_ready_hook(nullptr);
  try {
    settle();  // nothing may still write into the buckets once they are freed
  } catch (const std::exception&) {
  }
}

std::map<std::string, Tensor> ReplicatedDataParallel::compression_state() const { return hook_->state(); }

void ReplicatedDataParallel::load_compression_state(const std::map<std::string, Tensor>& state) {
  // Every f32 entry of bucket i is the bucket's size, except PowerSGD's Q (its own shape).
  for (const auto& [key, t] : state) {
    const size_t dot = key.find('.');
    const std::string field = dot == std::string::npos ? "" : key.substr(dot + 1);
    const long id = key.rfind("bucket", 0) == 0 ? std::strtol(key.c_str() + 6, nullptr, 10) : -1;
    DT_INPUT_CHECK(id >= 0 && static_cast<size_t>(id) < buckets_.size(),
                   "compression state '" << key << "' names no bucket of this run (" << buckets_.size() << " buckets)");
    const Bucket& b = buckets_[static_cast<size_t>(id)];
    if (field == "residual" || field == "velocity")
      DT_INPUT_CHECK(t.numel() == b.end - b.begin, "compression state '" << key << "' holds " << t.numel()
                                                                         << " values, the bucket " << b.end - b.begin);
  }
  hook_->load_state(state);
}

void ReplicatedDataParallel::set_step(int64_t step) { hook_->on_step(step, opt_.compression_warmup_steps); }

void DataParallel::broadcast_with_buffers(nn::Module& model, comm::Communicator& comm, Device dev, int root,
                                          std::vector<std::shared_ptr<comm::Work>> works) {
  std::vector<std::pair<Tensor, Tensor*>> staged;  // host buffers (a dropout's RNG state) on a GPU's NCCL
  for (nn::Buffer* b : model.buffers()) {
    if (comm.supports(b->value.device())) {
      works.push_back(comm.broadcast(b->value, root));
      continue;
    }
    Tensor& there = staged.emplace_back(Tensor::empty(b->value.shape(), b->value.dtype(), dev), &b->value).first;
    copy_any(b->value, there);
    works.push_back(comm.broadcast(there, root));
  }
  for (auto& w : works) w->wait();
  for (auto& [there, host] : staged) copy_any(there, *host);
}

void ReplicatedDataParallel::broadcast_state(int root) {
  broadcast_with_buffers(model_, comm_, flat_param_.device(), root, {comm_.broadcast(flat_param_, root)});
  reload_shard();
}

void ReplicatedDataParallel::begin_backward(bool sync) {
  settle();
  syncing_ = sync && comm_.size() > 1;
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.work.reset();
  }
}

void ReplicatedDataParallel::on_grad_ready(nn::Parameter& p) {
  // ZeRO-1 without compression reduce-scatters the whole flat gradient in finish(); without
  // overlap, every bucket goes out there too.
  if (!syncing_ || (zero1() && !hook_->compresses()) || !opt_.overlap) return;
  auto it = bucket_of_.find(&p);
  DT_CHECK(it != bucket_of_.end(), "gradient of " << p.name << " is not in any data-parallel bucket");
  Bucket& b = buckets_[it->second];
  if (++b.ready == b.params) launch(b);
}

void ReplicatedDataParallel::launch(Bucket& b) {
  Tensor view = flat_grad_.slice0(b.begin, b.end);
  const int64_t before = hook_->bytes_sent();
  b.work = hook_->run(view, static_cast<int>(&b - buckets_.data()), b.rows);
  stats_.bytes_sent += hook_->bytes_sent() - before;
  stats_.bytes_reduced += static_cast<int64_t>(view.nbytes());
  ++stats_.collectives;
}

void ReplicatedDataParallel::finish() {
  if (!syncing_) {
    if (zero1() && comm_.size() == 1) engine_for(flat_grad_.device()).copy(flat_grad_, shard_.grad);
    return;
  }
  double t0 = now_s();
  if (zero1() && !hook_->compresses()) {
    comm_.reduce_scatter(flat_grad_, shard_.grad, comm::ReduceOp::Avg)->wait();
    stats_.bytes_reduced += static_cast<int64_t>(flat_grad_.nbytes());
    stats_.bytes_sent += static_cast<int64_t>(flat_grad_.nbytes());
    ++stats_.collectives;
  } else {
    // A bucket whose parameters this step's graph did not all touch never completed: send it now,
    // so every rank runs the same collectives in the same order.
    for (Bucket& b : buckets_)
      if (!b.work) launch(b);
    for (Bucket& b : buckets_) complete(b.work);
    const int64_t before = hook_->bytes_sent();
    hook_->finish_step();
    stats_.bytes_sent += hook_->bytes_sent() - before;
    // ZeRO-1 with compression: the compressed exchange (top-k's allgathers, PowerSGD's factors, ...)
    // leaves the averaged gradient everywhere; the sharded optimizer takes this rank's slice.
    if (zero1()) engine_for(flat_grad_.device()).copy(own_slice(flat_grad_), shard_.grad);
  }
  stats_.comm_wait_s += now_s() - t0;
  syncing_ = false;
}

void ReplicatedDataParallel::complete(const std::shared_ptr<comm::Work>& w) {
  if (opt_.device_stream && w->order_stream(opt_.device_stream))
    deferred_.push_back(w);
  else
    w->wait();
}

void ReplicatedDataParallel::settle() {
  if (deferred_.empty()) return;
  double t0 = now_s();
  std::vector<std::shared_ptr<comm::Work>> works;
  works.swap(deferred_);
  for (auto& w : works) w->wait();
  stats_.comm_wait_s += now_s() - t0;
}

std::pair<int64_t, int64_t> ReplicatedDataParallel::overlap(const nn::Parameter* p, int64_t begin, int64_t end) const {
  const int64_t off = offset_.at(p);
  return {std::max(begin, off), std::min(end, off + p->value.numel())};
}

// ZeRO-1: this rank's master slice and gradient slice, and the parameters' pieces in them.
void ReplicatedDataParallel::make_shard(int64_t model_numel) {
  // A slice of padding only would give its rank no optimizer state, and the state's collectives
  // (gather_state) would not match over the ranks.
  DT_INPUT_CHECK(flat_grad_.numel() - model_numel < shard_numel(),
                 "--zero1 over " << comm_.size() << " ranks: the model's " << model_numel
                                 << " trained parameters leave the last rank's slice empty");
  shard_.value = Tensor::empty({shard_numel()}, DType::F32, flat_param_.device());
  engine_for(flat_param_.device()).copy(own_slice(flat_param_), shard_.value);
  shard_.grad = zeros_on({shard_numel()}, flat_grad_.device());
  const int64_t begin = slice_begin(), end = begin + shard_numel();
  const std::vector<nn::Parameter*> params = model_.parameters();
  pieces_.reserve(params.size());
  for (nn::Parameter* p : params) {
    const auto [first, last] = overlap(p, begin, end);
    if (first >= last) continue;
    nn::Parameter& piece = pieces_.emplace_back();
    piece.name = p->name;
    piece.value = shard_.value.slice0(first - begin, last - begin);
    piece.grad = shard_.grad.slice0(first - begin, last - begin);
    piece_of_[p] = &piece;
    start_in_slice_[p->name] = first - begin;
  }
}

std::vector<optim::ParamGroup> ReplicatedDataParallel::optimizer_groups(
    const std::vector<optim::ParamGroup>& model_groups) {
  if (!zero1()) return model_groups;
  std::vector<optim::ParamGroup> groups;
  for (const optim::ParamGroup& g : model_groups) {
    optim::ParamGroup& mine = groups.emplace_back(g);
    mine.params.clear();
    for (nn::Parameter* p : g.params) {
      DT_CHECK(offset_.count(p), "optimizer_groups: " << p->name << " is not a parameter of the data-parallel model");
      if (auto it = piece_of_.find(p); it != piece_of_.end()) mine.params.push_back(it->second);
    }
  }
  return groups;
}

std::pair<int64_t, std::string> ReplicatedDataParallel::place_in_slice(const optim::StateTensor& st) const {
  const size_t dot = st.name.rfind('.');
  auto it = dot == std::string::npos ? start_in_slice_.end() : start_in_slice_.find(st.name.substr(0, dot));
  DT_CHECK(it != start_in_slice_.end(),
           "optimizer state " << st.name << " is of no parameter in this rank's ZeRO-1 slice (optimizer_groups)");
  return {it->second, st.name.substr(dot + 1)};
}

std::map<std::string, Tensor> ReplicatedDataParallel::gather_state(const std::vector<optim::StateTensor>& state) {
  if (!zero1()) return optim::state_by_name(state);  // whole parameters already
  // Each kind of state ("exp_avg", ...) as this rank's slice, assembled from its tensors (the
  // padding stays zero), then gathered whole; std::map orders the kinds alike on every rank.
  std::map<std::string, Tensor> slices;
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_slice(st);
    Tensor& slice = slices[kind];
    if (!slice.defined()) slice = zeros_on(shard_.value.shape(), shard_.value.device());
    Tensor part = slice.slice0(start, start + st.value->numel());
    copy_any(st.value->reshape({st.value->numel()}), part);
  }
  std::map<std::string, Tensor> full;
  for (const auto& [kind, slice] : slices) {
    const Tensor flat = to_host(gather_flat(slice));
    for (nn::Parameter* p : model_.parameters()) {
      if (p->frozen) continue;  // no state
      const int64_t off = offset_.at(p);
      full[p->name + "." + kind] = flat.slice0(off, off + p->value.numel()).reshape(p->value.shape()).clone();
    }
  }
  return full;
}

void ReplicatedDataParallel::load_state(const std::map<std::string, Tensor>& full,
                                        const std::vector<optim::StateTensor>& state) {
  if (!zero1()) {
    optim::load_state_by_name(full, state);
    return;
  }
  for (const optim::StateTensor& st : state) {
    const auto [start, kind] = place_in_slice(st);
    Tensor dst = st.value->reshape({st.value->numel()});
    const int64_t begin = slice_begin() + start, end = begin + dst.numel();  // in the flat buffers
    for (nn::Parameter* p : model_.parameters()) {
      const auto [first, last] = overlap(p, begin, end);
      if (first >= last) continue;
      const std::string name = p->name + "." + kind;
      auto it = full.find(name);
      DT_INPUT_CHECK(it != full.end(), "no optimizer state " << name);
      DT_INPUT_CHECK(it->second.shape() == p->value.shape(), "optimizer state " << name << " is " << it->second.str()
                                                                                << ", parameter " << p->name << " is "
                                                                                << p->value.str());
      const int64_t off = offset_.at(p);
      Tensor part = dst.slice0(first - begin, last - begin);
      copy_any(it->second.reshape({p->value.numel()}).slice0(first - off, last - off), part);
    }
  }
}

void ReplicatedDataParallel::reload_shard() {
  if (zero1()) engine_for(flat_param_.device()).copy(own_slice(flat_param_), shard_.value);
}

void ReplicatedDataParallel::after_step() {
  if (!zero1()) return;
  double t0 = now_s();
  Tensor trained = flat_param_.slice0(0, flat_grad_.numel());
  if (comm_.size() > 1) {
    comm_.allgather(shard_.value, trained)->wait();
    stats_.bytes_sent += static_cast<int64_t>(shard_.value.nbytes());
    ++stats_.collectives;
  } else {
    engine_for(trained.device()).copy(shard_.value, trained);
  }
  stats_.comm_wait_s += now_s() - t0;
}

Tensor ReplicatedDataParallel::gather_flat(const Tensor& slice) {
  Tensor full = zeros_on(flat_grad_.shape(), flat_grad_.device());
  if (comm_.size() > 1)
    comm_.allgather(slice, full)->wait();
  else
    engine_for(full.device()).copy(slice, full);
  return full;
}

Tensor ReplicatedDataParallel::own_slice(const Tensor& flat) const {
  return flat.slice0(slice_begin(), slice_begin() + shard_numel());
}

std::map<std::string, int64_t> ReplicatedDataParallel::memory_bytes() const {
  return {{"parameters", static_cast<int64_t>(flat_param_.nbytes())},
          {"gradients", static_cast<int64_t>(flat_grad_.nbytes())},
          {"master shard", zero1() ? static_cast<int64_t>(shard_.value.nbytes()) : 0},
          {"gradient shard", zero1() ? static_cast<int64_t>(shard_.grad.nbytes()) : 0}};
}

double ReplicatedDataParallel::grad_norm() {
  Engine& e = engine_for(flat_grad_.device());
  if (!zero1()) return std::sqrt(e.sum_squares(flat_grad_));
  return sharded_norm(shard_.grad, comm_);
}

DataParallel::GradientParts ReplicatedDataParallel::gradient_parts(const nn::Parameter& p) {
  GradientParts g{p.value.numel(), !zero1(), {}, flat_grad_.device()};
  if (!zero1()) {
    g.parts.push_back({0, p.grad});
  } else if (const auto it = piece_of_.find(&p); it != piece_of_.end()) {
    g.parts.push_back({start_in_slice_.at(p.name) + slice_begin() - offset_.at(&p), it->second->grad});
  }
  return g;
}

void DataParallel::add_copy_gradients(const nn::Parameter& p, comm::Communicator& copies) {
  GradientParts g = gradient_parts(p);
  if (g.whole) {
    copies.allreduce(g.parts.front().second)->wait();
    return;
  }
  Tensor all = zeros_on({g.numel}, g.device);
  Engine& e = engine_for(all.device());
  for (auto& [first, part] : g.parts) {
    Tensor at = all.slice0(first, first + part.numel());
    e.copy(part, at);
  }
  shard_group()->allreduce(all)->wait();  // the parts cover p once over the shard group: its whole gradient
  copies.allreduce(all)->wait();
  for (auto& [first, part] : g.parts) e.copy(all.slice0(first, first + part.numel()), part);
}

void DataParallel::load_pieces(const PieceSource&, const std::vector<optim::StateTensor>&) {
  DT_CHECK(false, "load_pieces: this data-parallel layout holds whole tensors; they load whole");
}

double DataParallel::sharded_norm(const Tensor& grad, comm::Communicator& shards) {
  // The slices' sums of squares added on their device (NCCL takes device memory only).
  Tensor ss = Tensor::empty({1}, DType::F32, grad.device());
  copy_any(Tensor::from({1}, {static_cast<float>(engine_for(grad.device()).sum_squares(grad))}), ss);
  if (shards.size() > 1) shards.allreduce(ss, comm::ReduceOp::Sum)->wait();
  return std::sqrt(static_cast<double>(to_host(ss).f32()[0]));
}

}  // namespace dtrain::parallel

namespace dtrain::parallel {

std::unique_ptr<DataParallel> make_data_parallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt) {
  DT_INPUT_CHECK(opt.zero >= 0 && opt.zero <= 3, "option --zero must be 0, 1, 2 or 3, got " << opt.zero);
  if (opt.zero <= 1) return std::make_unique<ReplicatedDataParallel>(model, comm, opt);
  return std::make_unique<ShardedDataParallel>(model, comm, opt);
}

}  // namespace dtrain::parallel

#include "dtrain/parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include "dtrain/core/timer.h"

namespace dtrain::parallel {

DataParallel::DataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt)
    : model_(model), comm_(comm), opt_(opt) {
  DT_INPUT_CHECK(opt.bucket_bytes > 0, "data parallel: bucket size must be positive");
  if (opt.compression != "none") {
    try {
      compressor_ = comm::make_compressor(opt.compression, opt.seed);
    } catch (const InputError& e) {
      throw InputError(std::string("option --compression: ") + e.what());
    }
  }
  DT_INPUT_CHECK(opt.compression_scope == "all" || opt.compression_scope == "inter-node",
                 "option --compression-scope must be all or inter-node, got '" << opt.compression_scope << "'");
  if (compressor_ && opt.compression_scope == "inter-node") setup_inter_node_scope();
  auto* topk = dynamic_cast<comm::TopKCompressor*>(compressor_.get());
  if (opt.momentum_correction > 0) {
    DT_INPUT_CHECK(topk, "momentum correction belongs to top-k compression, not --compression " << opt.compression);
    topk->set_momentum_correction(opt.momentum_correction);
  }
  std::vector<nn::Parameter*> params = model.parameters();
  DT_CHECK(!params.empty(), "data parallel needs a model with parameters");
  Device dev = params.front()->value.device();
  int64_t total = 0;
  for (nn::Parameter* p : params) {
    DT_CHECK(p->value.dtype() == DType::F32 && p->value.device() == dev,
             "data parallel keeps f32 parameters on one device; " << p->name << " is " << p->value.str());
    total += p->value.numel();
  }
  // On a GPU the buckets are device memory reduced by a device-capable communicator (NCCL, or a
  // CUDA-aware MPI); compression and ZeRO-1's host-side slices stay on the CPU engine.
  DT_INPUT_CHECK(dev.is_cpu() || ((!compressor_ || topk) && !opt.zero1),
                 "data parallel on " << dev.str()
                                     << ": --zero1 and --compression other than topk run on the CPU engine only");
  engine_topk_ = topk && (!dev.is_cpu() || opt.engine_topk);
  host_reads_device_ = !dev.is_cpu() && std::string(comm.backend()) != "nccl";
  const int64_t world = comm.size();
  const int64_t padded = (total + world - 1) / world * world;
  flat_param_ = zeros_on({padded}, dev);
  flat_grad_ = zeros_on({padded}, dev);

  // Lay parameters out last-first: backward finishes them roughly in this order, so the first
  // bucket fills first and goes out first.
  // PowerSGD works layer by layer, as PyTorch's PowerSGD hook does: each weight is factorised as its
  // [out, in*kh*kw] matrix and biases go uncompressed; a square reshape of a flat bucket has no
  // low-rank structure to find. So with it every tensor is its own bucket. (Top-k stays on flat
  // buckets: measured on Fashion-MNIST, a per-tensor 1 % starves the layers that matter most.)
  const bool layerwise = opt_.compression.rfind("powersgd", 0) == 0;
  int64_t off = 0;
  Bucket cur;
  const int64_t bucket_elems = layerwise ? 1 : std::max<int64_t>(1, opt_.bucket_bytes / 4);
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    nn::Parameter* p = *it;
    int64_t n = p->value.numel();
    Tensor v = flat_param_.slice0(off, off + n).reshape(p->value.shape());
    Tensor g = flat_grad_.slice0(off, off + n).reshape(p->grad.shape());
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

  if (engine_topk_) engine_topk_state_.resize(buckets_.size());
  if (opt_.zero1) make_shard(total);
  model_.set_grad_ready_hook([this](nn::Parameter& p) { on_grad_ready(p); });
}

DataParallel::~DataParallel() {
  model_.set_grad_ready_hook(nullptr);
  try {
    settle();  // nothing may still write into the buckets once they are freed
  } catch (const std::exception&) {
  }
}

std::map<std::string, Tensor> DataParallel::compression_state() const {
  if (compressor_ && !engine_topk_) return compressor_->state_tensors();
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < engine_topk_state_.size(); ++i) {
    const EngineTopK& st = engine_topk_state_[i];
    const std::string at = "bucket" + std::to_string(i) + ".";
    if (st.residual.defined()) out[at + "residual"] = to_host(st.residual).clone();
    if (st.velocity.defined()) out[at + "velocity"] = to_host(st.velocity).clone();
  }
  return out;
}

void DataParallel::load_compression_state(const std::map<std::string, Tensor>& state) {
  DT_INPUT_CHECK(compressor_ || state.empty(), "compression state given to a run without --compression");
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
  if (!engine_topk_) {
    compressor_->load_state_tensors(state);
    return;
  }
  const Device dev = flat_grad_.device();
  for (EngineTopK& st : engine_topk_state_) st.residual = st.velocity = Tensor();
  for (const auto& [key, t] : state) {
    const size_t dot = key.find('.');
    const std::string field = key.substr(dot + 1);
    DT_INPUT_CHECK(field == "residual" || field == "velocity",
                   "compression state '" << key << "' is not the engine top-k path's (residual, velocity)");
    EngineTopK& st = engine_topk_state_[static_cast<size_t>(std::strtol(key.c_str() + 6, nullptr, 10))];
    Tensor d = Tensor::empty({t.numel()}, DType::F32, dev);
    copy_any(t.reshape({t.numel()}), d);
    (field == "residual" ? st.residual : st.velocity) = d;
  }
}

void DataParallel::set_step(int64_t step) {
  const int64_t warmup = opt_.compression_warmup_steps;
  if (dynamic_cast<comm::PowerSgdCompressor*>(compressor_.get())) dense_phase_ = step < warmup;
  auto* topk = dynamic_cast<comm::TopKCompressor*>(compressor_.get());
  if (!topk) return;
  if (topk_target_ == 0) topk_target_ = topk->ratio();
  const double start = std::max(0.25, topk_target_);
  double r = topk_target_;
  if (step < warmup) r = start * std::pow(topk_target_ / start, static_cast<double>(step) / static_cast<double>(warmup));
  topk->set_ratio(r);
}

void DataParallel::broadcast_state(int root) {
  if (host_reads_device_) engine_for(flat_param_.device()).synchronize();
  std::vector<std::shared_ptr<comm::Work>> works{comm_.broadcast(flat_param_, root)};
  for (nn::Buffer* b : model_.buffers()) works.push_back(comm_.broadcast(b->value, root));
  for (auto& w : works) w->wait();
  if (opt_.zero1) shard_.value.copy_from(own_slice(flat_param_));
}

void DataParallel::setup_inter_node_scope() {
  DT_INPUT_CHECK(!opt_.zero1 && !opt_.engine_topk,
                 "option --compression-scope inter-node does not combine with --zero1 or --compression-on-engine");
  comm::NodeSplit split = comm::split_by_node(comm_);
  DT_INPUT_CHECK(split.uniform, "option --compression-scope inter-node needs as many data-parallel ranks on every "
                                "node; this job's nodes hold different counts");
  node_comm_ = std::move(split.node);
  cross_comm_ = std::move(split.cross);
  if (cross_comm_->size() == 1) compressor_.reset();  // one node: nothing crosses a network
}

void DataParallel::begin_backward(bool sync) {
  settle();
  syncing_ = sync && comm_.size() > 1;
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.work.reset();
  }
}

void DataParallel::on_grad_ready(nn::Parameter& p) {
  // ZeRO-1 without compression reduce-scatters the whole flat gradient in finish(); without
  // overlap, every bucket goes out there too.
  if (!syncing_ || (opt_.zero1 && !compressor_) || !opt_.overlap) return;
  auto it = bucket_of_.find(&p);
  DT_CHECK(it != bucket_of_.end(), "gradient of " << p.name << " is not in any data-parallel bucket");
  Bucket& b = buckets_[it->second];
  if (++b.ready == b.params) launch(b);
}

void DataParallel::launch(Bucket& b) {
  Tensor view = flat_grad_.slice0(b.begin, b.end);
  if (engine_topk_) {
    b.work = launch_engine_topk(b, engine_topk_state_[static_cast<size_t>(&b - buckets_.data())]);
  } else if (compressor_ && !dense_phase_ && cross_comm_) {
    b.work = node_comm_->allreduce(view, comm::ReduceOp::Avg);  // compressed between nodes in finish()
  } else if (compressor_ && !dense_phase_) {
    int64_t before = compressor_->stats().bytes_sent;
    b.work = compressor_->reduce(view, comm_, comm::ReduceOp::Avg, static_cast<int>(&b - buckets_.data()), b.rows);
    stats_.bytes_sent += compressor_->stats().bytes_sent - before;
  } else if (host_reads_device_) {
    engine_for(view.device()).synchronize();  // finish() divides by the world on the device
    b.work = comm_.allreduce(view, comm::ReduceOp::Sum);
    stats_.bytes_sent += static_cast<int64_t>(view.nbytes());
  } else {
    b.work = comm_.allreduce(view, comm::ReduceOp::Avg);
    stats_.bytes_sent += static_cast<int64_t>(view.nbytes());
  }
  stats_.bytes_reduced += static_cast<int64_t>(view.nbytes());
  ++stats_.collectives;
}

void DataParallel::finish() {
  if (!syncing_) {
    if (opt_.zero1 && comm_.size() == 1) shard_.grad.copy_from(flat_grad_);
    return;
  }
  double t0 = now_s();
  if (opt_.zero1 && !compressor_) {
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
    if (compressor_ && !dense_phase_ && cross_comm_) exchange_between_nodes();
    if (engine_topk_)
      for (Bucket& b : buckets_) finish_engine_topk(b, engine_topk_state_[static_cast<size_t>(&b - buckets_.data())]);
    else if (host_reads_device_)
      engine_for(flat_grad_.device()).scale(flat_grad_, 1.f / static_cast<float>(comm_.size()));
    // ZeRO-1 with compression: the compressed exchange (top-k's allgathers, PowerSGD's factors, ...)
    // leaves the averaged gradient everywhere; the sharded optimizer takes this rank's slice.
    if (opt_.zero1) shard_.grad.copy_from(own_slice(flat_grad_));
  }
  stats_.comm_wait_s += now_s() - t0;
  syncing_ = false;
}

// --compression-scope inter-node: the buckets hold their node's average; the compressor averages
// them over the nodes.
void DataParallel::exchange_between_nodes() {
  for (Bucket& b : buckets_) {
    Tensor view = flat_grad_.slice0(b.begin, b.end);
    const int64_t before = compressor_->stats().bytes_sent;
    b.work = compressor_->reduce(view, *cross_comm_, comm::ReduceOp::Avg, static_cast<int>(&b - buckets_.data()),
                                 b.rows);
    stats_.bytes_sent += compressor_->stats().bytes_sent - before;
  }
  for (Bucket& b : buckets_) complete(b.work);
}

void DataParallel::complete(const std::shared_ptr<comm::Work>& w) {
  if (opt_.device_stream && w->order_stream(opt_.device_stream))
    deferred_.push_back(w);
  else
    w->wait();
}

void DataParallel::settle() {
  if (deferred_.empty()) return;
  double t0 = now_s();
  std::vector<std::shared_ptr<comm::Work>> works;
  works.swap(deferred_);
  for (auto& w : works) w->wait();
  stats_.comm_wait_s += now_s() - t0;
}

// The same arithmetic as comm::TopKCompressor, in engine calls on the bucket's device: the
// residual (plus, with momentum correction, the momentum u = m u + g) takes the gradient, its k
// largest magnitudes leave it, and each rank's (index, value) pairs reach every rank by two
// allgathers. finish_engine_topk sums them in rank order, so all ranks hold the same bits.
std::shared_ptr<comm::Work> DataParallel::launch_engine_topk(Bucket& b, EngineTopK& st) {
  auto* topk = static_cast<comm::TopKCompressor*>(compressor_.get());
  Tensor view = flat_grad_.slice0(b.begin, b.end);
  const Device dev = view.device();
  Engine& e = engine_for(dev);
  const int64_t n = view.numel(), world = comm_.size();
  const int64_t k = std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(topk->ratio() * n))));
  if (!st.residual.defined()) st.residual = zeros_on({n}, dev);
  const float m = topk->momentum_correction();
  if (m > 0) {
    if (!st.velocity.defined()) st.velocity = zeros_on({n}, dev);
    e.scale(st.velocity, m);
    e.axpy(1.f, view, st.velocity);
    e.axpy(1.f, st.velocity, st.residual);
  } else {
    e.axpy(1.f, view, st.residual);
  }
  if (st.k != k) {  // the sparsity warm-up changes k from step to step
    st.k = k;
    st.idx = Tensor::empty({k}, DType::I32, dev);
    st.vals = Tensor::empty({k}, DType::F32, dev);
    st.all_idx = Tensor::empty({k * world}, DType::I32, dev);
    st.all_vals = Tensor::empty({k * world}, DType::F32, dev);
  }
  e.topk_abs(st.residual, k, st.idx);
  e.gather_and_clear(st.residual, st.idx, st.vals);
  if (m > 0) {
    Tensor none;
    e.gather_and_clear(st.velocity, st.idx, none);  // momentum factor masking
  }
  stats_.bytes_sent += 8 * k;
  if (host_reads_device_) e.synchronize();  // MPI reads the indices and values from the host's side
  st.idx_work = comm_.allgather(st.idx, st.all_idx);
  return comm_.allgather(st.vals, st.all_vals);
}

void DataParallel::finish_engine_topk(Bucket& b, EngineTopK& st) {
  complete(st.idx_work);
  Tensor view = flat_grad_.slice0(b.begin, b.end);
  Engine& e = engine_for(view.device());
  e.fill(view, 0.f);
  const int64_t world = comm_.size(), k = st.k;
  for (int64_t r = 0; r < world; ++r)
    e.scatter_add(st.all_idx.slice0(r * k, (r + 1) * k), st.all_vals.slice0(r * k, (r + 1) * k), view);
  e.scale(view, 1.f / static_cast<float>(world));
}

std::pair<int64_t, int64_t> DataParallel::overlap(const nn::Parameter* p, int64_t begin, int64_t end) const {
  const int64_t off = offset_.at(p);
  return {std::max(begin, off), std::min(end, off + p->value.numel())};
}

// ZeRO-1: this rank's master slice and gradient slice, and the parameters' pieces in them.
void DataParallel::make_shard(int64_t model_numel) {
  // A slice of padding only would give its rank no optimizer state, and the state's collectives
  // (gather_state) would not match over the ranks.
  DT_INPUT_CHECK(flat_param_.numel() - model_numel < shard_numel(),
                 "--zero1 over " << comm_.size() << " ranks: the model's " << model_numel
                                 << " parameters leave the last rank's slice empty");
  shard_.value = own_slice(flat_param_).clone();
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

std::vector<optim::ParamGroup> DataParallel::optimizer_groups(const std::vector<optim::ParamGroup>& model_groups) {
  if (!opt_.zero1) return model_groups;
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

std::pair<int64_t, std::string> DataParallel::place_in_slice(const optim::StateTensor& st) const {
  const size_t dot = st.name.rfind('.');
  auto it = dot == std::string::npos ? start_in_slice_.end() : start_in_slice_.find(st.name.substr(0, dot));
  DT_CHECK(it != start_in_slice_.end(),
           "optimizer state " << st.name << " is of no parameter in this rank's ZeRO-1 slice (optimizer_groups)");
  return {it->second, st.name.substr(dot + 1)};
}

std::map<std::string, Tensor> DataParallel::gather_state(const std::vector<optim::StateTensor>& state) {
  if (!opt_.zero1) return optim::state_by_name(state);  // whole parameters already
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
      const int64_t off = offset_.at(p);
      full[p->name + "." + kind] = flat.slice0(off, off + p->value.numel()).reshape(p->value.shape()).clone();
    }
  }
  return full;
}

void DataParallel::load_state(const std::map<std::string, Tensor>& full, const std::vector<optim::StateTensor>& state) {
  if (!opt_.zero1) {
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

void DataParallel::reload_shard() {
  if (opt_.zero1) shard_.value.copy_from(own_slice(flat_param_));
}

void DataParallel::after_step() {
  if (!opt_.zero1) return;
  double t0 = now_s();
  if (comm_.size() > 1) {
    comm_.allgather(shard_.value, flat_param_)->wait();
    stats_.bytes_sent += static_cast<int64_t>(shard_.value.nbytes());
    ++stats_.collectives;
  } else {
    flat_param_.copy_from(shard_.value);
  }
  stats_.comm_wait_s += now_s() - t0;
}

Tensor DataParallel::gather_flat(const Tensor& slice) {
  Tensor full = zeros_on(flat_param_.shape(), flat_param_.device());
  if (comm_.size() > 1)
    comm_.allgather(slice, full)->wait();
  else
    full.copy_from(slice);
  return full;
}

Tensor DataParallel::own_slice(const Tensor& flat) const {
  return flat.slice0(slice_begin(), slice_begin() + shard_numel());
}

double DataParallel::grad_norm() {
  Engine& e = engine_for(flat_grad_.device());
  if (!opt_.zero1) return std::sqrt(e.sum_squares(flat_grad_));
  Tensor ss = Tensor::from({1}, {static_cast<float>(e.sum_squares(shard_.grad))});
  if (comm_.size() > 1) comm_.allreduce(ss, comm::ReduceOp::Sum)->wait();
  return std::sqrt(static_cast<double>(ss.f32()[0]));
}

}  // namespace dtrain::parallel

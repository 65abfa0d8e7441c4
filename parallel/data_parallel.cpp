#include "dtrain/parallel/data_parallel.h"

#include <cstring>

#include "dtrain/core/timer.h"

namespace dtrain::parallel {

DataParallel::DataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt)
    : model_(model), comm_(comm), opt_(opt) {
  DT_INPUT_CHECK(opt.bucket_bytes > 0, "data parallel: bucket size must be positive");
  // Backward makes gradients ready roughly in reverse parameter order, so buckets are filled from
  // the last parameter backwards: the first bucket completes first and goes out first.
  std::vector<nn::Parameter*> params = model.parameters();
  Bucket cur;
  int64_t cur_bytes = 0;
  auto close = [&]() {
    if (cur.params.empty()) return;
    int64_t n = cur.offsets.back() + cur.params.back()->grad.numel();
    cur.flat = Tensor::zeros({n}, DType::F32, cur.params.front()->grad.device());
    buckets_.push_back(std::move(cur));
    cur = Bucket{};
    cur_bytes = 0;
  };
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    nn::Parameter* p = *it;
    DT_CHECK(p->grad.dtype() == DType::F32, "data parallel reduces f32 gradients, " << p->name << " is "
                                                                                    << p->grad.str());
    int64_t off = cur.params.empty() ? 0 : cur.offsets.back() + cur.params.back()->grad.numel();
    where_[p] = {buckets_.size(), cur.params.size()};
    cur.params.push_back(p);
    cur.offsets.push_back(off);
    cur_bytes += static_cast<int64_t>(p->grad.nbytes());
    if (cur_bytes >= opt_.bucket_bytes) close();
  }
  close();
  model_.set_grad_ready_hook([this](nn::Parameter& p) { on_grad_ready(p); });
}

DataParallel::~DataParallel() { model_.set_grad_ready_hook(nullptr); }

void DataParallel::broadcast_state(int root) {
  std::vector<std::shared_ptr<comm::Work>> works;
  for (nn::Parameter* p : model_.parameters()) works.push_back(comm_.broadcast(p->value, root));
  for (nn::Buffer* b : model_.buffers()) works.push_back(comm_.broadcast(b->value, root));
  for (auto& w : works) w->wait();
}

void DataParallel::begin_backward(bool sync) {
  syncing_ = sync && comm_.size() > 1;
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.work.reset();
  }
}

void DataParallel::on_grad_ready(nn::Parameter& p) {
  if (!syncing_) return;
  auto it = where_.find(&p);
  DT_CHECK(it != where_.end(), "gradient of " << p.name << " is not in any data-parallel bucket");
  Bucket& b = buckets_[it->second.first];
  size_t slot = it->second.second;
  std::memcpy(b.flat.f32() + b.offsets[slot], p.grad.raw(), p.grad.nbytes());
  if (++b.ready == static_cast<int64_t>(b.params.size())) launch(b);
}

void DataParallel::launch(Bucket& b) {
  b.work = comm_.allreduce(b.flat, comm::ReduceOp::Avg);
  stats_.bytes_reduced += static_cast<int64_t>(b.flat.nbytes());
  ++stats_.buckets;
}

void DataParallel::finish() {
  if (!syncing_) return;
  double t0 = now_s();
  for (Bucket& b : buckets_) {
    if (!b.work) {
      // A parameter this step's graph did not touch never fired its hook: send what we have
      // (its gradient as it stands), so every rank runs the same collectives.
      for (size_t i = 0; i < b.params.size(); ++i)
        std::memcpy(b.flat.f32() + b.offsets[i], b.params[i]->grad.raw(), b.params[i]->grad.nbytes());
      launch(b);
    }
  }
  for (Bucket& b : buckets_) {
    b.work->wait();
    for (size_t i = 0; i < b.params.size(); ++i)
      std::memcpy(b.params[i]->grad.raw(), b.flat.f32() + b.offsets[i], b.params[i]->grad.nbytes());
  }
  stats_.comm_wait_s += now_s() - t0;
  syncing_ = false;
}

}  // namespace dtrain::parallel

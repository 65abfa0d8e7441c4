#pragma once
// DataParallel: every rank holds the whole model; gradients are averaged over the data-parallel
// communicator. Gradients are packed into buckets (in the order backward produces them) and a
// bucket's allreduce starts as soon as its last gradient is ready, so communication overlaps the
// rest of backward; finish() waits only for what is still in flight.
#include <memory>
#include <unordered_map>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/nn/module.h"

namespace dtrain::parallel {

struct DataParallelOptions {
  int64_t bucket_bytes = 25ll << 20;  // as PyTorch DDP's default 25 MiB
};

struct DataParallelStats {
  double comm_wait_s = 0;     // time finish() blocked on allreduces (not hidden behind backward)
  int64_t bytes_reduced = 0;  // payload bytes passed to allreduce
  int64_t buckets = 0;
};

class DataParallel {
 public:
  DataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt = {});
  ~DataParallel();

  // Copies rank `root`'s parameters and buffers to every rank (call once before training).
  void broadcast_state(int root = 0);
  // Arms the grad-ready hooks for the backward that follows. With sync == false (an accumulation
  // micro-step) nothing is sent and gradients keep accumulating locally.
  void begin_backward(bool sync = true);
  // Waits for every bucket and writes the averaged gradients back into the parameters.
  void finish();

  int world() const { return comm_.size(); }
  size_t bucket_count() const { return buckets_.size(); }
  DataParallelStats& stats() { return stats_; }

 private:
  struct Bucket {
    Tensor flat;                         // f32, all its gradients back to back
    std::vector<nn::Parameter*> params;  // in the order their gradients become ready
    std::vector<int64_t> offsets;
    int64_t ready = 0;
    std::shared_ptr<comm::Work> work;
  };
  void on_grad_ready(nn::Parameter& p);
  void launch(Bucket& b);

  nn::Module& model_;
  comm::Communicator& comm_;
  DataParallelOptions opt_;
  std::vector<Bucket> buckets_;
  std::unordered_map<nn::Parameter*, std::pair<size_t, size_t>> where_;  // param -> (bucket, slot)
  bool syncing_ = false;
  DataParallelStats stats_;
};

}  // namespace dtrain::parallel

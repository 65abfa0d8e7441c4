#pragma once
// A two-rank DataParallel in one process, without MPI, for the checkpoint target and the seed maker:
// a tiny MLP whose gradients go through a compressor over a MirroredCommunicator, so a checkpoint's
// per-rank compression part can be loaded into it and a step run with it. (DataParallel over one
// rank exchanges nothing, so it would never touch the compressor.)
#include <memory>
#include <string>

#include "dtrain/comm/communicator.h"
#include "dtrain/nn/module.h"
#include "dtrain/parallel/data_parallel.h"

namespace dtrain::fuzz {

// A world of `size` ranks that all hold what this rank holds, played by this process alone: a sum
// over the ranks is `size` times the own tensor, a gather `size` copies of it. f32 (and, where
// nothing is summed, any dtype): what DataParallel and the compressors send.
class MirroredCommunicator final : public comm::Communicator {
 public:
  MirroredCommunicator(int rank, int size) : Communicator(rank, size, "mirrored") {}
  const char* backend() const override { return "mirrored"; }
  bool supports(Device device) const override { return device.is_cpu(); }

 protected:
  std::shared_ptr<comm::Work> do_allreduce(Tensor& t, comm::ReduceOp op) override;
  std::shared_ptr<comm::Work> do_broadcast(Tensor& t, int root) override;
  std::shared_ptr<comm::Work> do_allgather(const Tensor& in, Tensor& out) override;
  std::shared_ptr<comm::Work> do_reduce_scatter(const Tensor& in, Tensor& out, comm::ReduceOp op) override;
  std::shared_ptr<comm::Work> do_send(const Tensor& t, int peer, int tag) override;
  std::shared_ptr<comm::Work> do_recv(Tensor& t, int peer, int tag) override;
  std::shared_ptr<comm::Work> do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;
};

// An MLP [1, 2, 2] -> 24 -> 20 -> 3 under DataParallel with `compression` ("topk:0.5", "powersgd:1", ...),
// as rank `rank` of two.
struct LocalDataParallel {
  explicit LocalDataParallel(const std::string& compression, int rank = 0);
  void step();  // forward, backward and the gradient exchange of one batch of two samples

  std::string compression;
  MirroredCommunicator comm;
  nn::ModulePtr model;
  std::unique_ptr<parallel::DataParallel> dp;
};

}  // namespace dtrain::fuzz

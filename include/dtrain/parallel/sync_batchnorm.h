#pragma once
// SyncBatchNorm: BatchNorm2d whose batch statistics (and their gradients) are taken over the whole
// data-parallel batch, all ranks together, instead of each rank's share.
#include "dtrain/comm/communicator.h"
#include "dtrain/nn/layers.h"

namespace dtrain::parallel {

class SyncBatchNorm : public nn::Module {
 public:
  SyncBatchNorm(int64_t channels, comm::Communicator& comm, float eps = 1e-5f, float momentum = 0.1f);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string kind() const override { return "SyncBatchNorm(" + std::to_string(c_) + ")"; }

 private:
  void place(Device device);           // the [C] vectors on the input's device
  Tensor sum_over_ranks(float count);  // allreduce of stats_, returned as host values
  int64_t c_;
  comm::Communicator& comm_;
  float eps_, momentum_;
  nn::Parameter *gamma_, *beta_;
  nn::Buffer *running_mean_, *running_var_;
  Tensor xc_, y_, dx_, tmp_;  // xc_: the input minus the (first-pass) global mean
  // [2C+1] on the host: the inverse std, the mean of xc_ (the second pass's correction) and the
  // samples per channel over all ranks; a slot, as xc_ is, so each micro-batch of a pipeline has its own.
  Tensor saved_;
  // On the input's device: [C] each (the maps' coefficients; backward reuses them), stats_ [2C+1]
  // for the allreduce.
  Tensor scale_, shift_, stats_;
  Tensor ones_, zeros_, neg_mean_;
};

// Replaces every BatchNorm2d below `root` (inside Sequential containers) by a SyncBatchNorm with the
// same parameters and statistics, under the same names. Returns how many were replaced.
int convert_sync_batchnorm(nn::Module& root, comm::Communicator& comm);

// The same conversion while a model is drawn (the sink of its top-level Sequential): each layer is
// converted as it is added, then handed to `next` (ZeRO-3's blocks, a pipeline stage's draw), so
// no whole model is built first.
class SyncBatchNormSink final : public nn::UnitSink {
 public:
  SyncBatchNormSink(comm::Communicator& comm, nn::UnitSink* next) : comm_(comm), next_(next) {}
  void layer_added(nn::ModulePtr& layer) override;
  void unit_built(const std::vector<nn::Module*>& entries) override;

 private:
  comm::Communicator& comm_;
  nn::UnitSink* next_;
};

}  // namespace dtrain::parallel

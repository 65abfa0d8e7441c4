#pragma once
// The gradient exchange of a data-parallel bucket, as a hook that owns its state (the shape of
// PyTorch c10d's communication hooks). DataParallel keeps the flat buffers and the buckets and hands
// each bucket to its one hook as soon as the bucket's gradients are final; it never asks which kind
// of hook it holds. A hook averages the bucket over the data-parallel ranks, on the device that
// holds it (the compressors run through the bucket's Engine), and keeps whatever it needs between
// steps: error-feedback residuals, PowerSGD's factors, top-k's momentum, QSGD's count of draws.
//   allreduce   a plain average (no --compression)
//   compress    one comm::Compressor over all data-parallel ranks (--compression topk:0.01, ...)
//   inter-node  the exact average within each node, then a compressor between the nodes
//               (--compression-scope inter-node; on one node nothing crosses a network: allreduce)
// ZeRO-1 is not a hook but a strategy of DataParallel's over whatever hook runs: without compression
// the whole flat gradient is reduce-scattered in finish(); with it, each rank keeps its slice of the
// hook's average.
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/tensor.h"

namespace dtrain::parallel {

class GradHook {
 public:
  virtual ~GradHook();
  virtual std::string name() const = 0;  // "allreduce", "topk(0.01)", "topk(0.01) between nodes"
  // Starts averaging `bucket` (a flat f32 view on any device) in place over the data-parallel ranks.
  // `index` keys the bucket's state; `rows` > 0 says the bucket is one tensor of that many rows (see
  // per_tensor). The bucket holds the average once the Work completes and finish_step() returned.
  virtual std::shared_ptr<comm::Work> run(Tensor& bucket, int index, int64_t rows) = 0;
  // After every bucket's Work completed: a hook of two phases runs its second here (blocking).
  virtual void finish_step() {}
  // The optimizer step the next backward belongs to, and the warm-up's length in steps.
  virtual void on_step(int64_t step, int64_t warmup_steps) { (void)step, (void)warmup_steps; }
  // Whether the hook wants every tensor as its own bucket (PowerSGD factorises tensors).
  virtual bool per_tensor() const { return false; }
  // Whether it compresses (and so keeps per-rank state that a checkpoint must carry).
  virtual bool compresses() const { return false; }
  // This rank's state for a checkpoint, as host tensors named "bucket<index>.<field>"; and back.
  virtual std::map<std::string, Tensor> state() const { return {}; }
  virtual void load_state(const std::map<std::string, Tensor>& state);
  // SGD's momentum moved into the exchange (top-k's momentum correction); InputError where the hook
  // cannot take it.
  virtual void set_momentum_correction(float m);
  // Bytes this rank put on the wire so far.
  virtual int64_t bytes_sent() const = 0;
};

struct GradHookOptions {
  std::string compression = "none";       // "none", "fp16", "bf16", "topk:0.01", "powersgd:2", "onebit", "qsgd:16"
  std::string compression_scope = "all";  // "all" or "inter-node"
  uint64_t seed = 0x5eed;                 // PowerSGD's first factors, QSGD's draws
};

// The hook for these options over the data-parallel communicator `dp` (collective over dp for the
// inter-node scope, which splits it by node). The only place that reads --compression and
// --compression-scope; InputError naming the option for a bad value.
std::unique_ptr<GradHook> make_grad_hook(const GradHookOptions& options, comm::Communicator& dp);

}  // namespace dtrain::parallel

#pragma once
// Data parallelism over the data-parallel communicator, as one interface (DataParallel) the
// trainers drive without asking which layout runs (make_data_parallel picks it from --zero):
//   ReplicatedDataParallel  ZeRO 0 and 1 (below): every rank holds the whole model and gradient
//   ShardedDataParallel     ZeRO 2 and 3 (zero/sharded_data_parallel.h): gradients, and at 3 the
//                           parameters, are sharded unit by unit
//
// ReplicatedDataParallel: every rank holds the whole model; gradients are averaged.
//
// All parameters and gradients are moved into two flat buffers, laid out in the order backward
// produces gradients (last layer first), and each parameter's value and grad become views into
// them. A bucket is a contiguous slice of the flat gradient, so its exchange runs in place, and it
// starts the moment the bucket's last gradient is ready (the grad-ready hook): communication
// overlaps the rest of backward, and finish() waits only for what is still in flight. What a
// bucket's exchange is (a plain average, a compressor, the inter-node scope) is its GradHook's
// (grad_hook.h): DataParallel hands every bucket to its one hook and never asks which kind it is.
// Everything runs on the device that holds the parameters, through its Engine and the Communicator.
//
// ZeRO stage 1 (zero1): optimizer state is sharded. finish() reduce-scatters the flat gradient so
// each rank holds the averaged gradient of its 1/world slice; the optimizer updates only that slice
// (optimizer_groups()), and after_step() all-gathers the updated slices into every rank's parameters.
// The optimizer sees the slice as the pieces of the parameters that fall into it, each in its
// parameter's group (a decayed matrix and an undecayed bias may share a slice), and checkpoints see
// its state per whole parameter in the one-rank layout (gather_state, load_state).
// With gradient compression the buckets go through the compressor as without ZeRO-1 (a compressed
// reduce-scatter does not exist for top-k or PowerSGD), and each rank then keeps its slice of the
// averaged gradient: the communication of the compressor, the optimizer memory of ZeRO-1.
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/nn/module.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/parallel/grad_hook.h"

namespace dtrain::parallel {

class ShardedInit;

struct DataParallelOptions {
  int64_t bucket_bytes = 25ll << 20;  // as PyTorch DDP's default 25 MiB
  // ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 gradients too, 3 parameters too.
  int zero = 0;
  // ZeRO-3: a unit's parameters are freed after its forward and gathered again for its backward
  // (false: kept from forward to backward, ZeRO-2's parameter memory during the pass).
  bool reshard_after_forward = true;
  // ZeRO-3: the next unit's all-gather starts while the current one computes.
  bool prefetch = true;
  // ZeRO-3: the dtype parameters travel in for the all-gathers (F32, or BF16: half the bytes; the
  // master shards stay f32 and the gathered values are the bf16-rounded masters).
  DType gather_dtype = DType::F32;
  // ZeRO-2/3: "all" shards over every data-parallel rank; "node" over each node's ranks, replicated
  // across nodes (the all-gathers stay within the node; the blocks' gradients are averaged between
  // nodes).
  std::string shard_scope = "all";
  bool overlap = true;  // false: every bucket goes out after backward (to measure what overlap hides)
  // Gradient compression per bucket ("none", "fp16", "bf16", "topk:0.01", "powersgd:2", "onebit",
  // "qsgd:16"; see comm/compression.h). With zero1 too (see above).
  std::string compression = "none";
  // Compression warm-up over these many optimizer steps (0: compress from the start). Top-k: the
  // kept fraction falls exponentially from 25 % to the target (Lin et al., Deep Gradient
  // Compression). PowerSGD: the gradients go uncompressed until then (as PyTorch's PowerSGD hook
  // does for its first start_powerSGD_iter steps), so the factorisation starts from trained layers.
  int64_t compression_warmup_steps = 0;
  // "all": the compressor runs over every data-parallel rank. "inter-node": the gradients are
  // averaged exactly within each node, then the compressor runs between the ranks of the same local
  // rank on every node (each local rank holds the node's average, so all of them exchange the same
  // compressed messages in parallel); on one node nothing is compressed.
  std::string compression_scope = "all";
  // Top-k only: SGD's momentum coefficient, moved into the compressor (DGC's momentum correction;
  // see comm::TopKCompressor). The optimizer must then run without momentum. 0: off.
  float momentum_correction = 0.f;
  uint64_t seed = 0x5eed;
  // Buckets on a GPU: the engine's compute stream (a cudaStream_t). Where the communicator can
  // order a stream after its work (NCCL), finish() makes this stream wait for the exchange by
  // events instead of blocking the host, which goes on queueing the optimizer step; the host then
  // checks the exchange (errors, timeouts) in settle(), which the trainers call once the step is
  // queued, before anything that waits for the GPU (which would hang on a stuck collective instead
  // of timing out); begin_backward() calls it too. Null: finish() waits on the host.
  void* device_stream = nullptr;
  // ZeRO-3: the blocks this rank kept while the model was built (zero/sharded_init.h), which the
  // shard takes over (each block is freed once copied); null: the model is whole and each rank
  // takes its blocks of it.
  ShardedInit* built = nullptr;
};

struct DataParallelStats {
  double comm_wait_s = 0;     // time finish()/after_step() blocked on communication (not hidden)
  int64_t bytes_reduced = 0;  // f32 gradient bytes handed to the exchange
  int64_t bytes_sent = 0;     // bytes this rank put on the wire (after compression)
  int64_t collectives = 0;
};

// A piece of a tensor of the one-rank layout, by key ("param/<name>", "optim/<name>.<kind>"): elements
// [from, from + values.numel()) of a tensor of `shape`.
using PieceTaker = std::function<void(const std::string& key, int64_t from, const Shape& shape, const Tensor& values)>;
// Whether a piece (key, elements [from, from + count) of a tensor of `shape`) holds any element
// this rank loads.
using PieceWanted = std::function<bool(const std::string& key, int64_t from, int64_t count, const Shape& shape)>;
// Hands every piece to the taker; may leave out the pieces nothing wants (unread).
using PieceSource = std::function<void(const PieceTaker& take, const PieceWanted& wants)>;

// What trainers call, in step order: begin_backward before each micro-batch's backward, finish
// after the last, then the optimizer over optimizer_groups, then after_step.
class DataParallel {
 public:
  virtual ~DataParallel();
  DataParallel() = default;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  virtual void broadcast_state(int root = 0) = 0;
  virtual void begin_backward(bool sync = true) = 0;
  virtual void finish() = 0;
  virtual void settle() {}
  virtual std::vector<optim::ParamGroup> optimizer_groups(const std::vector<optim::ParamGroup>& model_groups) = 0;
  virtual std::map<std::string, Tensor> gather_state(const std::vector<optim::StateTensor>& state) = 0;
  virtual void load_state(const std::map<std::string, Tensor>& full, const std::vector<optim::StateTensor>& state) = 0;
  virtual void after_step() = 0;
  virtual void reload_shard() = 0;
  // The tensors a copy of this rank's training state takes (population-based training hands a
  // trainer's to another of the same layout): the whole parameters, or under ZeRO-2/3 the
  // optimizer's pieces (`pieces`: its parameters). state_replaced() then brings the rest in line.
  virtual std::vector<Tensor*> parameter_state(const std::vector<nn::Parameter*>& model_params,
                                               const std::vector<nn::Parameter*>& pieces) {
    (void)pieces;
    std::vector<Tensor*> out;
    for (nn::Parameter* p : model_params) out.push_back(&p->value);
    return out;
  }
  virtual void state_replaced() { reload_shard(); }
  virtual double grad_norm() = 0;
  // Every parameter's whole value in its Parameter (on: ZeRO-3 gathers every unit and keeps them;
  // off: frees them again, after taking each rank's shard from them, so values written meanwhile,
  // a checkpoint's, hold). A no-op where the parameters are always whole. Collective.
  virtual void hold_whole_model(bool on) { (void)on; }
  // This rank's pieces of the parameters and of the optimizer's state, for a checkpoint written
  // shard by shard (train/checkpoint.h, write_shard_part): host copies keyed "param/<name>" and
  // "optim/<name>.<kind>", each with "range/<key>" (first element, count, then the whole tensor's
  // dimensions). Empty where the parameters are whole on every rank (the set is then gathered).
  virtual std::map<std::string, Tensor> shard_pieces(const std::vector<optim::StateTensor>& state) const {
    (void)state;
    return {};
  }
  virtual std::map<std::string, Tensor> compression_state() const { return {}; }
  virtual void load_compression_state(const std::map<std::string, Tensor>& state);
  virtual void set_step(int64_t step) { (void)step; }
  virtual void set_compression_warmup(int64_t steps) { (void)steps; }
  virtual int zero_stage() const = 0;
  virtual bool compresses() const { return false; }
  virtual size_t bucket_count() const = 0;
  // The ranks over which the optimizer's pieces are spread (each holds other elements of every
  // parameter), for norms over them; null where every rank holds the whole gradient.
  virtual comm::Communicator* shard_group() { return nullptr; }
  // Bytes this rank holds for the model, by kind: "parameters" and "gradients" (whole, held across
  // the step), "master shard" and "gradient shard" (ZeRO), "gathered units (peak)" and "gradient
  // buffers (peak)" (ZeRO-2/3: the most held at once during a pass). Optimizer state is the
  // optimizer's.
  virtual std::map<std::string, int64_t> memory_bytes() const = 0;
  DataParallelStats& stats() { return stats_; }

  // Where this rank holds p's averaged gradient after finish(): the whole gradient (`whole`), or
  // the parts of it in this rank's ZeRO slice or shard, each with its first element in p (none when
  // p lies outside them). `numel`: p's, also where its value is empty between passes (ZeRO-3);
  // `device`: where the layout holds gradients.
  struct GradientParts {
    int64_t numel = 0;
    bool whole = false;
    std::vector<std::pair<int64_t, Tensor>> parts;
    Device device = Device::cpu();
  };
  virtual GradientParts gradient_parts(const nn::Parameter& p) = 0;
  // After finish(): adds into this rank's share of p's averaged gradient the averaged gradient of
  // p's copy that the other ranks of `copies` hold (GPT-2's tied embedding on the first and last
  // pipeline stage: `copies` joins the ranks of the same data-parallel and tp position). A sharded
  // layout assembles the whole gradient over its shard group first, then takes its parts back.
  // Collective over the shard group and `copies`.
  void add_copy_gradients(const nn::Parameter& p, comm::Communicator& copies);
  // ZeRO-2/3: loads this rank's pieces of the parameters and of the optimizer's `state` from pieces
  // of the one-rank layout's tensors, which `for_each_piece` hands one by one to the taker it gets
  // (a set's shard parts written at any rank count: train::for_each_shard_piece, which reads only
  // the parts holding a piece `wants`), so no whole tensor is assembled; at ZeRO-2 the whole values
  // too, which every rank holds. Not collective.
  // InputError naming a tensor of another shape than its parameter, or one whose elements this
  // rank holds and no piece gave. Layouts of whole tensors (ZeRO 0/1) load whole ones instead.
  virtual void load_pieces(const PieceSource& for_each_piece, const std::vector<optim::StateTensor>& state);

 protected:
  // The L2 norm of a gradient each rank of `shards` holds a distinct slice of (`grad`: this rank's).
  static double sharded_norm(const Tensor& grad, comm::Communicator& shards);
  // Waits for `works` (the layout's parameter broadcasts) and broadcasts `model`'s buffers from
  // `root` beside them (host buffers staged through `dev` where the communicator takes no host
  // memory).
  static void broadcast_with_buffers(nn::Module& model, comm::Communicator& comm, Device dev, int root,
                                     std::vector<std::shared_ptr<comm::Work>> works);
  DataParallelStats stats_;
};

// hold_whole_model(true) for a scope (no-op for a null DataParallel); release is collective, so an
// exception leaves the values held rather than start a collective other ranks may never reach.
class WholeModel {
 public:
  explicit WholeModel(DataParallel* dp) : dp_(dp) {
    if (dp_) dp_->hold_whole_model(true);
  }
  ~WholeModel() {
    if (dp_ && std::uncaught_exceptions() == 0) dp_->hold_whole_model(false);
  }
  WholeModel(const WholeModel&) = delete;
  WholeModel& operator=(const WholeModel&) = delete;

 private:
  DataParallel* dp_;
};

// The layout --zero asks for (InputError naming the option for a model or option it cannot take).
std::unique_ptr<DataParallel> make_data_parallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt);

class ReplicatedDataParallel final : public DataParallel {
 public:
  ReplicatedDataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt = {});
  ~ReplicatedDataParallel() override;

  // Copies rank `root`'s parameters and buffers to every rank (call once before training).
  void broadcast_state(int root = 0) override;
  // Arms the grad-ready hooks for the backward that follows. With sync == false (a gradient
  // accumulation micro-step) nothing is sent and gradients keep accumulating locally.
  void begin_backward(bool sync = true) override;
  // Waits for the gradient exchange: plain DP leaves the averaged gradients in every parameter's
  // grad; ZeRO-1 leaves this rank's averaged slice in the grads of optimizer_groups' pieces.
  void finish() override;
  // Waits on the host for exchanges finish() left to the device stream (see device_stream), and
  // throws their error; a no-op when none is outstanding.
  void settle() override;
  // The optimizer's parameter groups in this layout, from groups over the model's parameters (form
  // them on the model: optim::decay_groups decides by shape and name). Without ZeRO-1 they come
  // back as they are. With ZeRO-1 each parameter's part inside this rank's slice takes its place: a
  // 1-D Parameter named as the parameter (so state stays "<param>.exp_avg", ...) whose value and
  // grad are views into the slice; a parameter outside the slice drops out (a group may end up
  // empty), the padding is in no group, every group keeps its settings. The pieces live as long as
  // this DataParallel. Optimizers with per-tensor trust ratios (LARS, LAMB) would take them per
  // piece: ZeRO-1 is for element-wise optimizers (SGD, Adam/AdamW).
  std::vector<optim::ParamGroup> optimizer_groups(const std::vector<optim::ParamGroup>& model_groups) override;
  // Optimizer state in the one-rank layout, for checkpoints: every parameter's whole tensor of each
  // kind, named "<param>.<kind>", as host copies on every rank (under ZeRO-1 a collective over the
  // communicator: each slice is all-gathered). `state` is the optimizer's, built from
  // optimizer_groups.
  std::map<std::string, Tensor> gather_state(const std::vector<optim::StateTensor>& state) override;
  // The inverse: each rank takes its part of `full` (any ZeRO-1 layout's gather_state, or a one-rank
  // run's state by name); InputError naming the tensor when one is missing or has another shape.
  void load_state(const std::map<std::string, Tensor>& full, const std::vector<optim::StateTensor>& state) override;
  // ZeRO-1: gathers the updated slices into every rank's parameters. Plain DP: nothing.
  void after_step() override;
  // After the parameters changed outside the optimizer (pruning masks applied to the whole
  // weights): ZeRO-1's slice is taken from them again, so the next update starts from there.
  void reload_shard() override;
  // L2 norm of the averaged gradient over the whole model (a collective under ZeRO-1).
  double grad_norm() override;

  // Checkpointing the gradient compression state of this rank (the compressor's buckets, copied to
  // the host), as named host tensors; empty without compression state. load_compression_state puts such a set back onto
  // this rank's buckets: InputError when it does not fit them (another compression or bucket layout).
  std::map<std::string, Tensor> compression_state() const override;
  void load_compression_state(const std::map<std::string, Tensor>& state) override;
  // Tells the exchange which optimizer step the next backward belongs to (compression warm-up).
  void set_step(int64_t step) override;
  void set_compression_warmup(int64_t steps) override { opt_.compression_warmup_steps = steps; }

  int world() const { return comm_.size(); }
  int zero_stage() const override { return opt_.zero; }
  bool compresses() const override { return hook_->compresses(); }
  const GradHook& hook() const { return *hook_; }
  size_t bucket_count() const override { return buckets_.size(); }
  comm::Communicator* shard_group() override { return zero1() ? &comm_ : nullptr; }
  std::map<std::string, int64_t> memory_bytes() const override;
  GradientParts gradient_parts(const nn::Parameter& p) override;

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // element range in the flat gradient
    int64_t params = 0, ready = 0;
    int64_t rows = 0;  // one-tensor buckets: the tensor's rows (its matrix view), for compression
    std::shared_ptr<comm::Work> work;
  };
  void on_grad_ready(nn::Parameter& p);
  void launch(Bucket& b);
  void complete(const std::shared_ptr<comm::Work>& w);  // on the device stream where it can, else on the host
  bool zero1() const { return opt_.zero == 1; }
  int64_t shard_numel() const { return flat_grad_.numel() / comm_.size(); }  // a rank's ZeRO-1 slice
  int64_t slice_begin() const { return comm_.rank() * shard_numel(); }        // in the flat buffers
  Tensor own_slice(const Tensor& flat) const;  // this rank's slice of a flat (padded) vector
  // The whole flat (padded) gradient-sized vector from every rank's slice of it (a collective over
  // the communicator).
  Tensor gather_flat(const Tensor& slice);
  // The elements of the flat buffers in [begin, end) that parameter p holds, as a range (empty
  // when first >= second).
  std::pair<int64_t, int64_t> overlap(const nn::Parameter* p, int64_t begin, int64_t end) const;
  void make_shard(int64_t model_numel);
  // Where optimizer state "<param>.<kind>" starts in this rank's slice, and its kind.
  std::pair<int64_t, std::string> place_in_slice(const optim::StateTensor& st) const;

  nn::Module& model_;
  comm::Communicator& comm_;
  DataParallelOptions opt_;
  // The trained parameters padded to a multiple of world (for reduce-scatter), then the frozen ones
  // (values only: flat_grad_ covers the trained part).
  Tensor flat_param_, flat_grad_;
  std::vector<Bucket> buckets_;
  std::unordered_map<nn::Parameter*, size_t> bucket_of_;
  std::unordered_map<const nn::Parameter*, int64_t> offset_;
  bool syncing_ = false;
  // ZeRO-1 shard of this rank: master copy of its parameters and its averaged gradient (the
  // buffers behind the pieces; reduce-scatter fills the grad, after_step all-gathers the value).
  nn::Parameter shard_;
  // The parameters' parts inside the shard (1-D views into it, named as their parameters), what
  // optimizer_groups hands out; reserved once, so the pointers stay valid.
  std::vector<nn::Parameter> pieces_;
  std::unordered_map<const nn::Parameter*, nn::Parameter*> piece_of_;
  // Where each piece (by its parameter's name) starts in the shard.
  std::map<std::string, int64_t> start_in_slice_;
  std::unique_ptr<GradHook> hook_;  // each bucket's exchange (grad_hook.h); its state on the buckets' device
  std::vector<std::shared_ptr<comm::Work>> deferred_;  // exchanges the device stream waits for
};

}  // namespace dtrain::parallel

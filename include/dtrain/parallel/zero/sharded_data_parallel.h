#pragma once
// ShardedDataParallel: ZeRO stages 2 and 3 (Rajbhandari et al., ZeRO; PyTorch FSDP's units).
//
// The model is cut into units (Module::shard_units: a Sequential's layers with parameters, the
// GPT's blocks and its embedding with the tied head). Each unit's parameters form one flat vector,
// padded to a multiple of the data-parallel size; rank r owns block r of every unit's vector: its
// f32 master values and its averaged gradient (the shard), which the optimizer updates through
// pieces, 1-D views named as their parameters (as ZeRO-1's: optimizer state stays per parameter).
// Pass hooks on each unit's modules (nn::PassHooks) do the rest, unit by unit:
//   stage 2  parameters stay whole on every rank. Before a unit's backward its gradient buffer is
//            made; after it the gradient is reduce-scattered into the owners' shards and the buffer
//            freed, so no rank holds the whole gradient across the step. after_step all-gathers
//            the updated shards into the units' values.
//   stage 3  parameters are sharded too: a unit's values are all-gathered just before its forward
//            and freed after it (reshard_after_forward; else kept to its backward), gathered again
//            before its backward, its gradient reduce-scattered right after. With prefetch, the
//            next unit's all-gather (forward order in forward, the reverse in backward) runs while
//            the current one computes. Between passes a Parameter's value is empty (of its
//            rank, all sizes 0), as is its gradient outside the unit's backward.
// Frozen parameters (--freeze, LoRA's base weights) have no gradient: a unit holding some is cut in
// two with the same modules, its trained part and a frozen part whose values are sharded, gathered
// and freed alike but which has no gradient buffer, no block of the gradient shard and no exchange.
// Every micro-batch's backward reduce-scatters (gradient accumulation adds into the shard), so
// begin_backward's sync flag changes nothing here.
//
// --shard-scope node shards over each node's ranks only and replicates across nodes: a unit's
// gradient is reduce-scattered within the node, then each block averaged between the ranks of the
// same local rank on every node; the all-gathers never leave the node.
//
// With --compression the unit's gradient goes through the GradHook instead (grad_hook.h: top-k,
// PowerSGD per tensor, ..., the inter-node scope), which leaves the average on every rank; each
// rank then keeps its block. The gradient buffers then live until finish() (a hook may have a
// second phase there) and accumulate locally over micro-batches, as data parallel's do: the
// compressor's bytes with ZeRO's optimizer (and, at 3, parameter) memory.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/parallel/data_parallel.h"

namespace dtrain::parallel {

// The ranks ZeRO-2/3 shard over: with --shard-scope node and several nodes, this node's
// data-parallel ranks (node) and the ranks of this local rank on every node (cross); else none
// (the whole data-parallel group). Collective over `dp`.
struct ShardGroups {
  std::unique_ptr<comm::Communicator> node, cross;
};
ShardGroups shard_groups(comm::Communicator& dp, const std::string& scope);

class ShardedDataParallel final : public DataParallel {
 public:
  // InputError when the model has parameters in no unit (it cannot be cut) or a unit's parameters
  // leave a rank's block of it empty.
  ShardedDataParallel(nn::Module& model, comm::Communicator& comm, DataParallelOptions opt);
  ~ShardedDataParallel() override;

  void broadcast_state(int root = 0) override;
  void begin_backward(bool sync = true) override;
  void finish() override;
  std::vector<optim::ParamGroup> optimizer_groups(const std::vector<optim::ParamGroup>& model_groups) override;
  std::map<std::string, Tensor> gather_state(const std::vector<optim::StateTensor>& state) override;
  void load_state(const std::map<std::string, Tensor>& full, const std::vector<optim::StateTensor>& state) override;
  void after_step() override;
  void reload_shard() override;
  double grad_norm() override;
  void hold_whole_model(bool on) override;
  std::vector<Tensor*> parameter_state(const std::vector<nn::Parameter*>& model_params,
                                       const std::vector<nn::Parameter*>& pieces) override;
  void state_replaced() override;
  std::map<std::string, Tensor> shard_pieces(const std::vector<optim::StateTensor>& state) const override;
  int zero_stage() const override { return opt_.zero; }
  bool compresses() const override { return hook_ != nullptr; }
  std::map<std::string, Tensor> compression_state() const override;
  void load_compression_state(const std::map<std::string, Tensor>& state) override;
  void set_step(int64_t step) override;
  void set_compression_warmup(int64_t steps) override { opt_.compression_warmup_steps = steps; }
  size_t bucket_count() const override { return units_.size(); }
  comm::Communicator* shard_group() override { return &shards(); }
  std::map<std::string, int64_t> memory_bytes() const override;
  GradientParts gradient_parts(const nn::Parameter& p) override;
  void load_pieces(const PieceSource& for_each_piece, const std::vector<optim::StateTensor>& state) override;

 private:
  struct Unit {
    std::vector<nn::Parameter*> params;  // forward order
    std::vector<int64_t> offset;         // of each parameter in the unit's flat vector
    std::vector<Shape> shapes;           // of each parameter (its value is empty between passes)
    std::vector<int> bucket;             // each parameter's key with a per-tensor compressor
    int64_t numel = 0, padded = 0;       // padded: a multiple of the data-parallel size
    int64_t shard_begin = 0;             // where this rank's block starts in the shard's values
    int64_t grad_begin = 0;              // and in its gradient (a trained unit's)
    bool frozen = false;                 // its parameters are frozen: values only, no gradient
    std::vector<int> entries;            // positions in order_ of the unit's modules
    Tensor full;                         // the gathered values (stage 2: always)
    Tensor wire;                         // the gather's buffer when it travels in another dtype
    Tensor wire_block;                   // this rank's block in that dtype
    std::shared_ptr<comm::Work> gathering;
    bool fresh = false;               // gathered (or on its way) since the parameters last pointed at `full`
    Tensor grad;                      // the whole gradient, from before the unit's backward to its reduce-scatter
    int forwards = 0, backwards = 0;  // entries passed in the current forward / backward
    bool in_shard = false;            // this step's gradient already reduce-scattered into the shard
  };
  struct Pending {  // a reduce-scatter in flight
    Unit* unit;
    Tensor block;  // this rank's averaged block: the shard's own (the step's first) or added into it when done
    std::shared_ptr<comm::Work> work;  // the reduce-scatter, then the average between nodes
    bool crossed;                      // the latter was issued
    bool into_shard;                   // `block` is the shard's
  };

  // The ranks the units are sharded over: the data-parallel group, or this node's part of it.
  comm::Communicator& shards() const { return node_ ? *node_ : comm_; }
  int64_t wire_bytes() const { return shards().wire_bytes_sent(); }
  int64_t block_numel(const Unit& u) const { return u.padded / shards().size(); }
  void cut_into_units();
  void split_frozen();
  void lay_out_units();
  void make_pieces();
  Tensor shard_block(const Tensor& shard, const Unit& u) const;  // u's block in the shard's values
  Tensor grad_block(const Tensor& shard, const Unit& u) const;   // in a gradient-shaped shard
  void install_hooks();
  void before_forward(Unit& u, int entry);  // the passes of the module at `entry`, for each of its units
  void after_forward(Unit& u, int entry);
  void before_backward(Unit& u, int entry);
  void after_backward(Unit& u, int entry);
  void start_gather(Unit& u);
  void finish_gather(Unit& u);  // waits for u's values and points its parameters at them
  void release(Unit& u);        // stage 3: frees u's values
  void prefetch(int entry);     // starts the gather of the unit at position `entry` of order_
  bool advance(Pending& p, bool wait);
  void retire(Pending& p);  // adds a finished reduce-scatter into the shard's gradient
  void retire_finished(bool wait_all);
  Tensor take_buffer(int64_t numel);  // a spare of that size, or a new one
  void give_buffer(Tensor& t);        // kept as the spare (or freed); t is left empty
  void free_grad(Unit& u);            // u's gradient buffer back, its parameters' gradients empty again
  void empty_grads(Unit& u);          // its parameters' gradients empty (none when frozen)
  void allgather_values(bool frozen_too);  // ZeRO-2: the owners' blocks into every rank's whole values
  void exchange_compressed(Unit& u);  // the unit's gradient through the hook
  void keep_compressed_blocks();      // after the hook's works: each rank's block into its shard
  static Tensor view(const Tensor& flat, const Unit& u, size_t i);  // parameter i's part of a unit vector
  void point_values(Unit& u);                                       // the parameters' values as views into u.full
  void take_shard(Unit& u);  // this rank's block of u's (whole) values into the shard master
  bool whole(const Unit& u) const { return u.full.defined() && !u.gathering; }
  std::pair<const Unit*, size_t> find(const std::string& param) const;  // a parameter's unit and index
  std::pair<int64_t, std::string> place_in_shard(const optim::StateTensor& st) const;

  nn::Module& model_;
  comm::Communicator& comm_;
  DataParallelOptions opt_;
  Device device_;
  std::vector<Unit> units_;
  std::vector<nn::Module*> order_;  // the units' modules in forward order
  std::vector<std::vector<Unit*>> units_at_;  // per position in order_: its units (trained, frozen)
  nn::Parameter shard_;  // this rank's blocks of every unit: f32 masters and (trained units') gradients
  std::vector<nn::Parameter> pieces_;
  std::map<const nn::Parameter*, nn::Parameter*> piece_of_;
  std::map<std::string, int64_t> start_in_shard_;            // per piece, by its parameter's name
  std::map<std::string, std::vector<int64_t>> piece_range_;  // per piece: first element, count, the shape
  std::vector<Pending> pending_;
  std::unique_ptr<GradHook> hook_;  // with --compression only
  // --shard-scope node over several nodes: this node's data-parallel ranks, and the ranks of this
  // local rank on every node (null otherwise).
  std::unique_ptr<comm::Communicator> node_, cross_;
  std::vector<std::shared_ptr<comm::Work>> compressed_works_;
  std::vector<Unit*> compressed_units_;  // whose gradients the hook is averaging
  bool syncing_ = true;
  bool step_open_ = false;  // the shard's gradient holds this step's first micro-batch already
  bool hold_ = false;       // hold_whole_model(true)
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
  int64_t grad_bytes_ = 0, peak_grad_bytes_ = 0;
  std::vector<Tensor> spare_;
  int64_t spare_bytes_ = 0;
};

}  // namespace dtrain::parallel

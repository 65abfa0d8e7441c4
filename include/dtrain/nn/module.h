#pragma once
// Module: hand-written forward and backward per layer (no tape). A module keeps what its backward
// needs from the last forward. Parameter gradients accumulate; when a module's backward has made a
// parameter's gradient final it fires the grad-ready hook, so data parallel can start sending.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/nn/placement.h"

namespace dtrain::nn {

struct Parameter {
  std::string name;  // dotted path, e.g. "features.0.weight"
  Tensor value;      // the f32 master
  Tensor grad;
  // Mixed precision: a weight that GEMMs read whole (Linear, the GPT's tied embedding) gets a
  // bf16/f16 working copy of `value`, made once per step by update_working_copies, which those
  // GEMMs read instead of rounding the master on every call. Undefined in fp32.
  bool gemm_weight = false;
  Tensor working{};
  // Frozen (--freeze, LoRA's base weights): it has no gradient (`grad` undefined), so no buffer,
  // bucket or shard holds one; layers skip computing it (or write it to scratch, Module::grad_into)
  // and the optimizer leaves it out.
  bool frozen = false;
  Placement placement{};  // where it lies in the one-rank model (placement.h)
};

// Makes (or drops, in fp32) the working copies of the GEMM weights among `params` for math
// precision `p` from their current masters. Trainers call it before every step's first forward and
// before evaluation, after anything has changed a master (an optimizer step, a load, a broadcast).
// DTRAIN_WORKING_COPIES=0 turns the copies off (GEMMs then round the masters on every call).
void update_working_copies(const std::vector<Parameter*>& params, MathPrecision p);

// The operand an m x n GEMM reads for weight `w`: the working copy where the engine would round the
// master to the copy's precision anyway (the same products), else the master.
const Tensor& gemm_operand(const Engine& e, const Parameter& w, int64_t m, int64_t n);

// A named tensor that is state but not trained (BatchNorm running statistics).
struct Buffer {
  std::string name;
  Tensor value;
  bool host = false;  // state the host reads (a dropout RNG): stays on the CPU when the module moves
};

using GradReadyHook = std::function<void(Parameter&)>;

// What runs around a module's passes when its container calls it through run_forward and
// run_backward: ZeRO-3 gathers a unit's parameters before its forward and backward and frees them
// after, ZeRO-2/3 reduce-scatter its gradients after its backward. Each may be empty.
struct PassHooks {
  std::function<void()> before_forward, after_forward, before_backward, after_backward;
};

class Module;
// A model cut into units for sharding (ZeRO-2/3): the modules that use parameters, in the order
// forward runs them, each with its unit. A unit may have several entries (the GPT's embedding and
// its head share the tied weight), and owns every parameter below its entries.
struct ShardUnits {
  std::vector<Module*> entries;
  std::vector<int> unit_of;                           // per entry
  std::vector<std::vector<Module*>> by_unit() const;  // each unit's entries, in forward order
};

// Takes a model's units as its constructor completes each one (the units of shard_units, each
// given by its entries in forward order): ZeRO-3 keeps this rank's block of the unit's values and
// frees the rest (parallel::ShardedInit), so no rank holds the whole model while it is built.
// A Sequential with a sink hands it every layer as it is added (`layer_added`), and the sink may
// swap the layer for another (SyncBatchNorm for BatchNorm) or keep less of it (a pipeline stage's
// draw empties the other layers' values); by default a layer with parameters is a unit of its own.
class UnitSink {
 public:
  virtual ~UnitSink() = default;
  virtual void unit_built(const std::vector<Module*>& entries) = 0;
  virtual void layer_added(std::unique_ptr<Module>& layer);
};

// Empties a parameter's value and gradient (each of its rank, as between ZeRO-3's passes), so a
// model drawn in parts holds only what it keeps.
void drop_values(Parameter& p);

// Which pass is running on this thread. Buffers a module first makes inside a backward pass are
// scratch (every micro-batch reuses them); those made in forward hold activations, which a
// pipeline stashes per micro-batch and activation checkpointing frees. The default is forward.
enum class Phase { Forward, Backward };
class PhaseScope {
 public:
  explicit PhaseScope(Phase p);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
  static Phase current();

 private:
  Phase prev_;
};

// The activations of one forward pass, moved out of the modules that made them.
using ActivationStash = std::vector<std::pair<Tensor*, Tensor>>;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  virtual Tensor backward(const Tensor& dy) = 0;
  virtual std::string kind() const = 0;

  // Parameters and buffers with dotted names, in forward order.
  std::vector<Parameter*> parameters();
  std::vector<Buffer*> buffers();
  int64_t parameter_count();

  // Moves every parameter, gradient and buffer to `device` (through the engines' copy) and drops
  // the activation buffers, which the next forward makes on the input's device.
  void to(Device device);

  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }
  void set_grad_ready_hook(GradReadyHook hook);  // on this module and all below it

  // forward/backward between this module's pass hooks (set by a sharding strategy; none by
  // default). Containers call their children through these.
  Tensor run_forward(const Tensor& x);
  Tensor run_backward(const Tensor& dy);
  void set_pass_hooks(std::shared_ptr<const PassHooks> hooks) { pass_hooks_ = std::move(hooks); }
  // This model's units for ZeRO-2/3: a Sequential's layers with parameters, the GPT's blocks and
  // its embedding with its head. Empty: the model cannot be cut (ZeRO-2/3 refuse it).
  virtual ShardUnits shard_units() { return {}; }
  // Cached decoding (inference): start_decoding keeps, from now on, what a later position needs of
  // the ones before it (attention's keys and values, for up to `capacity` positions; capacity 0
  // stops and frees it); decode_at says the next forward's input starts at `position` (0: a new
  // sequence). Every module passes both to its children; attention and position embeddings act.
  virtual void start_decoding(int64_t capacity);
  virtual void decode_at(int64_t position);
  // Whether backward must produce d(input). The model's first layer need not (its input is the
  // data): for a first convolution that is a whole backward-data pass saved.
  virtual void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  // Marks the output buffer as a temporary: the consumer uses it up within the same pass (a
  // residual add, a permute), so it is scratch, shared between blocks, not a kept activation.
  void set_output_temporary(bool temporary) { output_temporary_ = temporary; }

  // Renames the parameter this module registered as `from` (a layer named as another framework
  // names it: torch's MultiheadAttention's "in_proj_weight").
  void rename_parameter(const std::string& from, const std::string& to);

  // Children, for traversal (containers override). A child named "" is transparent: its
  // parameters take the parent's prefix (wrappers that must not change parameter names).
  virtual std::vector<std::pair<std::string, Module*>> children() { return {}; }
  // The name prefix of child `name` under `prefix` ("blocks." + "3" -> "blocks.3.").
  static std::string child_prefix(const std::string& prefix, const std::string& name) {
    return name.empty() ? prefix : prefix + name + ".";
  }

  // Activation slots (this module and all below it). stash moves every activation tensor out,
  // leaving the slots empty, so the next forward makes (or, after restore of a spent stash,
  // reuses) other buffers; restore puts a stash back for the backward of its micro-batch.
  ActivationStash stash_activations();
  void restore_activations(ActivationStash&& stash);
  void release_activations();  // empties the activation slots (their memory goes when unshared)
  // By position instead of by slot: the activation (or, scratch = true, the backward scratch)
  // tensors in slot order, moved out; and given to a module of the same structure (another block
  // of a model), which then reuses them instead of allocating. Extra or missing tensors are fine.
  std::vector<Tensor> take_buffers(bool scratch);
  void give_buffers(std::vector<Tensor>&& buffers, bool scratch);
  // Bytes of distinct storage held by activation slots (below this module) or by a stash.
  size_t activation_bytes();
  static size_t stash_bytes(const ActivationStash& stash);

 protected:
  // Leaf modules register their own tensors once, in the constructor.
  Parameter& add_parameter(const std::string& name, Tensor value);
  Buffer& add_buffer(const std::string& name, Tensor value, bool host = false);
  void grad_ready(Parameter& p) {
    if (hook_ && !p.frozen) hook_(p);
  }
  // Where a backward writes p's gradient: p.grad, or for a frozen p (which has none) `scratch`, a
  // member made temporary of p's shape, for kernels that give it with the input's gradient.
  Tensor& grad_into(Parameter& p, Tensor& scratch) {
    return p.frozen ? ensure_temp(scratch, p.value.shape(), p.value.device()) : p.grad;
  }
  Engine& engine(const Tensor& t) { return engine_for(t.device()); }
  // Reuses `buf` when it already has shape `s`, so steady-state steps allocate nothing. `buf` must
  // be a member: it becomes one of this module's slots (activation or scratch, by the phase).
  Tensor& ensure(Tensor& buf, const Shape& s, Device device = Device::cpu(), DType dtype = DType::F32);
  // A buffer used only within the current pass (scratch even when made in forward).
  Tensor& ensure_temp(Tensor& buf, const Shape& s, Device device = Device::cpu(), DType dtype = DType::F32);
  // The module's output buffer: an activation, or scratch after set_output_temporary(true).
  Tensor& ensure_output(Tensor& buf, const Shape& s, Device device) {
    return output_temporary_ ? ensure_temp(buf, s, device) : ensure(buf, s, device);
  }
  // Keeps `t` (an input backward needs) in member slot `slot`.
  void keep(Tensor& slot, const Tensor& t) {
    track(slot);
    slot = t;
  }
  // Member `slot` as one of this module's slots, left as it is: for state an engine call makes
  // (the max pool's argmax), which a pipeline must stash with the micro-batch's other activations.
  Tensor& engine_state(Tensor& slot) {
    track(slot);
    return slot;
  }

  bool training_ = true;
  bool needs_input_grad_ = true;
  bool output_temporary_ = false;

 private:
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* bufs);
  void track(Tensor& slot, bool scratch = false);
  void activation_slots(std::vector<Tensor*>& out);
  void slots_of(bool scratch, std::vector<Tensor*>& out);
  std::vector<Tensor*> activation_slots_;  // made in forward
  std::vector<Tensor*> scratch_slots_;     // made in backward
  std::vector<std::unique_ptr<Parameter>> params_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::string> param_names_, buffer_names_;  // local names ("weight")
  GradReadyHook hook_;
  std::shared_ptr<const PassHooks> pass_hooks_;
};

using ModulePtr = std::unique_ptr<Module>;

// Where `m`'s parameters are (the CPU for a module without any): where its inputs must be made.
Device device_of(Module& m);

}  // namespace dtrain::nn

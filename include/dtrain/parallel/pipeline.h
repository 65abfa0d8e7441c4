#pragma once
// Pipeline parallelism: a model cut into consecutive stages, one per rank of the pipeline
// communicator (stage = rank in it). A step splits the batch into micro-batches; each stage runs
// forward and backward of every micro-batch in the order of its schedule, receiving activations
// from the stage before and gradients from the stage after by point-to-point messages
// (non-blocking sends, so neither schedule can deadlock; a receive waits only for its own data).
//
// Schedules, for S stages and M micro-batches:
//   GPipe: all M forwards, then all M backwards. Stage memory holds M micro-batches' activations.
//   1F1B:  S-1-s warm-up forwards on stage s, then alternate one forward and one backward, then
//          the remaining backwards. At most S-s micro-batches are in flight on stage s.
// Both have the same bubble, (S-1)/(M+S-1) of the step in the ideal case; 1F1B needs less memory.
//
// A module keeps the activations of its last forward only, so after each forward the stage moves
// them out (nn::Module::stash_activations) and puts them back for that micro-batch's backward.
// Spent stashes are kept and handed to later forwards, so steady-state steps allocate nothing.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/nn/models.h"
#include "dtrain/nn/module.h"

namespace dtrain::parallel {

enum class PipelineSchedule { GPipe, OneFOneB };
PipelineSchedule pipeline_schedule_from_name(const std::string& name);  // "gpipe", "1f1b"
const char* pipeline_schedule_name(PipelineSchedule s);

struct PipelineOp {
  bool forward;
  int micro_batch;
};
// The order stage `stage` of `stages` runs the forwards and backwards of `micro_batches`.
std::vector<PipelineOp> pipeline_ops(PipelineSchedule s, int stage, int stages, int micro_batches);
// The ideal bubble: the fraction of a step each stage idles, (S-1)/(M+S-1).
double pipeline_ideal_bubble(int stages, int micro_batches);

// Cuts `costs` (per layer, in order) into `stages` consecutive non-empty groups minimising the
// largest group's cost. Returns the first layer of each stage, plus costs.size() at the end.
std::vector<int> balance_stages(const std::vector<double>& costs, int stages);

// --pp-split as given ("2,4": how many layers each stage holds, GPT blocks or image model layers),
// in balance_stages' form: the first layer of each stage, plus `layers` at the end. Throws
// InputError naming --pp-split unless the text is `stages` whole numbers >= 1 adding up to `layers`.
std::vector<int> parse_pp_split(const std::string& text, int stages, int layers);

// An image model's layers as a pipeline cuts them, found while `spec`'s model is drawn one layer
// at a time, each layer's values dropped once it has run (so no rank holds the whole model):
// boundaries[i] is the activation shape before layer i for a micro-batch of shape `input`
// (boundaries.back() the output); seconds[i] the layer's forward + backward time, the least of
// `repeats` timed passes after an untimed one (oneDNN and cuDNN build their primitives on a
// shape's first call; all 0 with repeats 0). Measured, not estimated from FLOPs: a CNN's layer
// times follow memory traffic and how well the kernels fill the machine at that channel count as
// much as arithmetic (ResNet-20's blocks have equal FLOPs at 16, 32 and 64 channels, yet on a CPU
// the 16-channel ones take about 1.3 times as long), and a GPU's small layers cost their launches.
struct LayerProbe {
  std::vector<Shape> boundaries;
  std::vector<double> seconds;
};
LayerProbe probe_layers(nn::ModelSpec spec, const Shape& input, Device device, int repeats = 3);

// The least of each layer's seconds over the ranks of `comm` (collective): noise (a descheduled
// rank, another process) only ever adds time, and every rank gets the same costs, so cuts the
// same stages.
std::vector<double> least_over_ranks(const std::vector<double>& seconds, comm::Communicator& comm);

// Layers [begin, end) of `spec`'s model as a stage of their own, named as in the whole model
// (Sequential::stage_of), with the values a whole draw gives them; every other layer's values are
// dropped as it is added, so a rank holds at most its stage and one layer more. spec.sink, if
// any, takes the stage's layers as they are drawn (SyncBatchNorm, ZeRO-3's blocks).
std::unique_ptr<nn::Sequential> draw_stage(nn::ModelSpec spec, int begin, int end);

struct PipelineStats {
  double step_s = 0;                 // wall time of the last train_step
  double recv_wait_s = 0;            // of which waiting for another stage's activations or gradients
  double bubble = 0;                 // recv_wait_s / step_s: the measured bubble of this stage
  size_t peak_activation_bytes = 0;  // most bytes of stashed activations at once, this stage
  int64_t bytes_sent = 0;            // activations and gradients sent in the last step
};

// The shapes (f32) of one micro-batch's activation at a pipeline stage's edges: `in` is received
// from the stage before (unused on the first stage), `out` sent to the next (unused on the last);
// their gradients travel back in the same shapes. A GPT passes [B, T, width] everywhere; an image
// model's stages each have their own (nn::layer_boundary_shapes: {shapes[begin], shapes[end]}).
struct StageShapes {
  Shape in, out;
};

class PipelineStage {
 public:
  // The stage is `module`; `pp` the pipeline communicator (its size is the number of stages).
  PipelineStage(nn::Module& module, comm::Communicator& pp, PipelineSchedule schedule, int micro_batches);

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  int micro_batches() const { return micro_batches_; }

  // The first stage's input of micro-batch mb.
  using InputFn = std::function<Tensor(int mb)>;
  // The last stage's loss: given the output of micro-batch mb, returns d(loss)/d(output).
  using LossFn = std::function<Tensor(const Tensor& out, int mb)>;
  // Runs before each micro-batch's backward (data parallel: communicate on the last one only).
  using BeforeBackwardFn = std::function<void(int mb, bool last)>;
  // Runs before each micro-batch's forward, on every stage.
  using BeforeForwardFn = std::function<void(int mb)>;

  // One training step's forwards and backwards; gradients accumulate in the module's parameters.
  // `input` is called once per micro-batch and must give each its own tensor (under GPipe every
  // forward runs before the first backward, which reads its input again): slices of the batch.
  void train_step(const InputFn& input, const LossFn& loss, const StageShapes& shapes,
                  const BeforeBackwardFn& before_backward = nullptr, const BeforeForwardFn& before_forward = nullptr);
  // Forwards only (evaluation); the last stage gets each micro-batch's output.
  void forward_only(const InputFn& input, const std::function<void(const Tensor& out, int mb)>& consume,
                    const StageShapes& shapes, int micro_batches, const BeforeForwardFn& before_forward = nullptr);

  const PipelineStats& stats() const { return stats_; }

 private:
  Tensor recv_from(int peer, Tensor& buf, int tag);
  void send_to(const Tensor& t, int peer, int tag, std::shared_ptr<comm::Work>& slot);
  void wait(std::shared_ptr<comm::Work>& w);

  nn::Module& module_;
  comm::Communicator& pp_;
  PipelineSchedule schedule_;
  int stage_, stages_, micro_batches_;
  Device device_;  // the stage's parameters' device: received activations and gradients go there
  std::vector<nn::ActivationStash> stash_;  // per micro-batch in flight
  std::vector<nn::ActivationStash> spent_;  // buffers for later forwards
  std::vector<Tensor> act_in_;              // received activations, per micro-batch
  std::vector<Tensor> dout_;                // d(output) per micro-batch (last stage: from the loss)
  Tensor grad_in_;                          // received gradient
  std::vector<std::shared_ptr<comm::Work>> act_sends_;
  std::shared_ptr<comm::Work> grad_send_;
  PipelineStats stats_;
};

}  // namespace dtrain::parallel

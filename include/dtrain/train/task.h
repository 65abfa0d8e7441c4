#pragma once
// What differs between the models dtrain trains, behind the one step loop (train::Trainer): where
// the data comes from, how this rank's part of the model is built, the loss and what it counts,
// validation, and the model's own checkpoint fields. Everything else (device, layout, gradient
// exchange, loss scaling, clipping, optimizer, the agreed loss reads and divergence stop,
// preemption, trace, progress, metrics, the checkpoint file set) is the loop's, written once.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/nn/module.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/zero/sharded_init.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/config.h"
#include "dtrain/train/metrics.h"

namespace dtrain::parallel {
class ProcessGrid;
}  // namespace dtrain::parallel

namespace dtrain::train {

// What the loop has decided when a task builds its part of the run.
struct TaskSetup {
  const TrainConfig& cfg;
  parallel::ProcessGrid& grid;  // dp x tp x pp over the run's ranks
  Device device;                // where the model trains
  int64_t batch = 0;            // this rank's rows per micro-batch of --accumulate (the global batch split)
  int parts = 1;                // micro-batches per step: --accumulate, or the pipeline's --micro-batches
  int ranks_on_node = 1;        // the ranks sharing this one's node (they split --data-cache-mb)
  // ZeRO-3: the sink of the model's units as they are built (in setup, or in connect for a
  // pipeline's stage that needs the cut); a model with no units leaves it empty.
  parallel::ShardedInit* built = nullptr;
};

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
};

// One validation pass: its figures, the words of its log line and the fields of its metrics line.
struct Validation {
  EvalResult result;
  std::string text;
  JsonFields fields;
};

// Where a resumed run continues: the epoch and the steps of it already done.
struct ResumePoint {
  int64_t epoch = 0, steps_done = 0;
  std::string note;  // what of the order is not exact in this layout ("" when nothing)
};

class Task {
 public:
  virtual ~Task() = default;

  // Reads the data and builds this rank's part of the model on s.device (every rank draws the model
  // from the seed layer by layer and keeps its part, so any layout starts from the one-rank
  // weights). Runs inside the ranks' agreement on inputs: throw InputError naming the file or option.
  virtual void setup(const TaskSetup& s) = 0;
  // Collective set-up once the ranks agreed on setup (an image pipeline's cut and stage).
  virtual void connect() {}
  virtual nn::Module& model() = 0;
  // "model simple_cnn (61706 parameters), data DIR": the run's first log line starts with it.
  virtual std::string describe() = 0;
  // The loss and throughput count these ("samples", "tokens"); the pipeline report names stage
  // pieces so ("layers", "blocks").
  virtual std::string unit() const = 0;
  virtual std::string piece() const = 0;
  // The first piece of each pipeline stage, and stages + 1 entries in all (the last is the count).
  virtual std::vector<int> stage_starts() const { return {0, 1}; }
  // The activations one micro-batch of `rows` receives and sends at this rank's pipeline stage.
  virtual parallel::StageShapes stage_shapes(int64_t rows) const = 0;

  // Optimizer steps in an epoch; 0: the task has no epochs (the run is --steps long, one "epoch").
  virtual int64_t steps_per_epoch() const = 0;
  virtual void start_epoch(int64_t epoch, int64_t steps_done) = 0;
  // The optimizer's parameter groups over `params` (each with its weight decay).
  virtual std::vector<optim::ParamGroup> param_groups(const std::vector<nn::Parameter*>& params,
                                                      float weight_decay) const = 0;

  // Whether magnitude pruning may zero `p` (conv and Linear weights; not embedding tables).
  virtual bool prunable(const nn::Parameter& p) const { return p.value.dim() >= 2; }

  // Reads step `step`'s data (all its micro-batches) onto the device; false when the epoch ran out
  // first. `wait_s`: seconds spent waiting for the data.
  virtual bool load_step(int64_t step, double& wait_s) = 0;
  // Micro-batch k of `parts` of the loaded step: the model's input, and its loss, whose sum, hits
  // and bad-label flag are added into `stats` (an XentStats row on the device); returns
  // d(loss)/d(output) times `grad_scale`.
  virtual Tensor micro_input(int k, int parts) = 0;
  // Before micro-batch k's forward, on every pipeline stage (a model whose last layer scores the
  // targets itself takes them here, where the loss's stage runs its forward).
  virtual void before_forward(int k, int parts) {
    (void)k;
    (void)parts;
  }
  virtual Tensor micro_loss(const Tensor& out, int k, int parts, Tensor& stats, float grad_scale) = 0;
  virtual int64_t step_units() const = 0;                           // this rank's samples or tokens of the loaded step
  virtual std::string bad_label(int64_t step, int rank) const = 0;  // the message for an out-of-range label

  // After the gradient exchange, before the step: gradients the layout keeps twice (a tied weight
  // on two stages) are summed, wherever `dp` holds them (null: no data parallelism, whole
  // gradients); `duplicate` is that second copy, left out of the clipping norm.
  virtual void after_exchange(parallel::DataParallel* dp) { (void)dp; }
  virtual const nn::Parameter* duplicate() const { return nullptr; }

  // Whether a validation pass is due after `step` (epoch_end: the epoch or the run just ended).
  virtual bool validation_due(int64_t step, bool epoch_end) const = 0;
  virtual Validation validate(parallel::PipelineStage* pipe) = 0;

  // Checkpoints: the model's own fields, the check that a checkpoint holds this model, and where a
  // resume continues (image tasks: the epoch and sample; the GPT: the step's own data stream).
  // The task's figures for the run's summary line in the metrics file (how the data was read).
  virtual JsonFields summary_fields() const { return {}; }
  virtual void write_fields(CheckpointState& s) const = 0;
  virtual void check_checkpoint(CheckpointState& s) const = 0;
  virtual ResumePoint resume_point(CheckpointState& s, int64_t step) = 0;
  // --init-from: pretrained weights into this rank's part of the model (whole parameters, also
  // under ZeRO-3); returns the line the log says. Only the language models take the option.
  virtual std::string init_from(const std::string& where) {
    DT_INPUT_CHECK(false, "option --init-from is for --model gpt and llama, not " << where);
  }
};

// The task of `cfg.model`: "gpt", or an image classifier (mlp, simple_cnn, resnet20).
std::unique_ptr<Task> make_image_task();
std::unique_ptr<Task> make_gpt_task();

// The rows of micro-batch k of `parts` from a step's chunks: chunk k when there are `parts` of
// them (--accumulate), else rows k/parts of the one chunk (pipeline micro-batches).
Tensor micro_rows(const std::vector<Tensor>& chunks, int k, int parts);

// A step's data on the model's device, as chunks of (inputs, labels). On a GPU the uploads go
// through page-locked staging buffers on the copy stream, and two sets alternate, so the next
// step's data can be uploaded beside this step's compute.
class StagedSteps {
 public:
  void put(int64_t step, const std::vector<std::pair<Tensor, Tensor>>& chunks, Device device);
  bool has(int64_t step) const { return sets_[step & 1].step == step; }
  // The chunks of `step` (which must have been put) on the device.
  void take(int64_t step, std::vector<Tensor>& inputs, std::vector<Tensor>& labels);
  void clear() { sets_[0].step = sets_[1].step = -1; }

 private:
  struct Set {
    int64_t step = -1;
    std::vector<StagedTensor> inputs, labels;
  };
  Set sets_[2];
};

}  // namespace dtrain::train

#pragma once
// The one training loop, for every model: a Task (image classifier or GPT) supplies data, model,
// loss and validation; the loop owns the rest: device, dp x tp x pp layout, gradient exchange,
// loss scaling and its agreed skip, clipping, optimizer, the agreed loss reads and divergence stop,
// preemption, trace, progress, metrics and the checkpoint set.
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/forensics.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/dataset.h"
#include "dtrain/nn/models.h"
#include "dtrain/nn/module.h"
#include "dtrain/optim/loss_scaler.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/optim/pruning.h"
#include "dtrain/optim/schedule.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/zero/sharded_init.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/checkpoint_owner.h"
#include "dtrain/train/config.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/task.h"
#include "dtrain/train/trace.h"

namespace dtrain::train {

struct TrainResult {
  int64_t steps = 0;                // the step the run ended at (fewer than asked when preempted)
  double final_loss = 0;            // the last step's training loss (this rank's dp group)
  double train_loss = 0;            // mean over the last log interval and the ranks
  std::vector<double> step_losses;  // every step's training loss (this rank's dp group), for comparisons
  EvalResult last_eval;             // the last validation (test set, or the GPT's validation windows)
  double units_per_s = 0;           // samples or tokens, global, over the steady state (after the first step)
  double first_step_at_s = 0;       // seconds from process start to the end of the first step
  int preempted_by = 0;             // the signal that stopped the run early after a checkpoint, or 0
  std::string checkpoint;           // the last checkpoint written, when any
  double checkpoint_stall_s = 0;    // the loop's time in checkpoints (with --checkpoint-async: the snapshots)
  // Pipeline (pp > 1), this rank's stage: measured bubble (mean over steps), the ideal one, and the
  // most activation bytes held at once.
  double pp_bubble = 0, pp_ideal_bubble = 0;
  size_t pp_peak_activation_bytes = 0;
  // fp16: the loss scale after the last step and the steps skipped for inf/NaN gradients.
  double loss_scale = 1;
  int64_t skipped_steps = 0;
  double sparsity = 0;  // --prune-sparsity: the pruned fraction of the pruned weights at the end
  // On a GPU: the caching allocator's peak allocation and reservation (cache included) at the end,
  // and the cudaMalloc calls it made after the second step (0 when the steps allocate nothing new).
  double gpu_peak_allocated_mib = 0, gpu_reserved_mib = 0;
  int64_t gpu_mallocs_after_warmup = -1;
  // This rank's model state at the end by kind, in bytes, as the memory report gives it
  // ("parameters", "gradients", ZeRO's shards and peaks, "optimizer state").
  std::map<std::string, int64_t> model_state_bytes;
};

class Trainer {
 public:
  // `world`: the ranks of this run (default: the runtime's world); they form the dp x tp x pp grid.
  Trainer(const TrainConfig& cfg, comm::Runtime& rt, comm::Communicator* world = nullptr);
  ~Trainer();
  TrainResult run();

  nn::Module& model() { return task_->model(); }
  // The data-parallel layout (null on one rank without ZeRO or compression). Under ZeRO-3 the
  // model's parameters are whole only inside a parallel::WholeModel of it.
  parallel::DataParallel* data_parallel() { return dp_.get(); }
  int64_t per_rank_batch() const { return batch_; }

  // Population-based training (train/sweep.cpp) works on a run between its steps: `hook` runs on
  // every rank after each `every`-th step (not after the last).
  void set_step_hook(int64_t every, std::function<void(int64_t step)> hook);
  EvalResult evaluate();  // the task's validation as it is now, evaluation time excluded (collective)
  // This rank's parameters, buffers and optimizer state, in an order every run of this model,
  // optimizer and layout shares.
  std::vector<Tensor*> state_tensors();
  // After state_tensors were overwritten (another trainer's state received): what is derived from
  // them (ZeRO's masters or whole values) is brought in line.
  void state_received() {
    if (dp_) dp_->state_replaced();
  }
  // The learning rate the schedule scales (--lr), and SGD's momentum (false: the optimizer has none).
  float base_lr() const { return cfg_.lr * lr_scale_; }
  void set_base_lr(float lr) { lr_scale_ = lr / cfg_.lr; }
  float momentum() const { return momentum_; }
  bool set_momentum(float m);

 private:
  void choose_device();             // threads, device and precision (agreed: a host short of GPUs fails all)
  std::string choose_comm() const;  // --comm: "nccl" or "mpi (host-staged)" for the device chosen
  void check_layout();              // the batch and the grid's combinations
  void setup_exchange();            // data parallel (NCCL), pipeline, optimizer, schedule, metrics
  void refuse_what_cannot_fit();    // the model state this rank would hold against its memory
  void report_memory();             // at the end: what each kind of state took
  std::map<std::string, int64_t> model_state_bytes();
  void freeze_parameters();
  void build_optimizer();
  void build_pruner();
  float topk_momentum_correction() const;
  void say(const std::string& s);
  void announce();
  bool step_once(double& wait_s);  // false when the epoch ran out before the step
  void forward_backward(float loss_scale);
  void exchange();
  bool update(float lr);
  void clip_gradients();
  void read_losses(bool before_save);
  void log_interval(int64_t epoch, int64_t batch_in_epoch, float lr);
  void validate(int64_t epoch, double epoch_s);
  bool preempted(int64_t epoch, int64_t batch_in_epoch, bool saved);
  void check_replicas();
  void flip_bit_if_asked();
  void delay_read_if_asked() const;
  void find_stragglers();
  void test_delay(const char* section) const;
  void parse_test_hooks();
  void finish();
  void report_pipeline();
  // Checkpoints: the optimizer state per parameter in the one-rank layout, the set of files.
  std::vector<std::string> state_kinds();
  std::map<std::string, Tensor> optimizer_state_full(const std::map<std::string, Tensor>& reuse);
  void load_optimizer_state(CheckpointState& s);
  // A checkpoint of step_ (collective). `wait`: written before returning (preemption, the end);
  // otherwise, with --checkpoint-async, the state is snapshotted and written in the background.
  void save(int64_t epoch, int64_t batch_in_epoch, bool wait = false);
  CheckpointState checkpoint_state(int64_t epoch, int64_t batch_in_epoch, const std::map<std::string, Tensor>& reuse);
  // The stage parts, then the manifest of every part (this rank's compression part: `rank_part`, or
  // null), then the main file (collective).
  void write_checkpoint_set(const std::string& file, CheckpointState& s, const SavedFile* rank_part,
                            const SavedFile* shard_part, bool wait);
  // Whether checkpoints keep the parameters and optimizer state as every rank's shard instead of
  // gathering them into the main file: at ZeRO-2/3 every rank writes its pieces (under pp its
  // stage's, under tp as runs of the one-rank tensors, by their names in the whole model) and loads
  // its pieces from a set's shard parts, never assembling whole tensors.
  bool writes_shards() const { return reads_shards(); }
  bool reads_shards() const { return dp_ && dp_->zero_stage() >= 2; }
  // Waits for the background write and makes the ranks agree on its outcome (collective).
  void finish_pending_checkpoint();
  void take_checkpoint_folder();  // at the start: --checkpoint-dir's owner, leftovers of a killed write
  ResumePoint restore(const std::string& where);
  void set_aside_later_line();  // after a resume: --checkpoint-dir's later sets (set_aside_later_sets)
  CheckpointState load_verified_set(const std::string& main_file, CheckpointState& part);  // collective
  void load_model_state(CheckpointState& s, const std::string& file);  // parameters, buffers, optimizer state
  std::map<std::string, Tensor> own_pieces() const;                    // for this rank's shard part
  bool same_layout(CheckpointState& s) const;
  void say_if_slow(const std::string& file, double seconds);  // a checkpoint write near the timeout
  // The world's waits under --checkpoint-timeout for a scope (the writers write meanwhile).
  class CheckpointWaits {
   public:
    CheckpointWaits(comm::Communicator& world, double timeout_s);
    ~CheckpointWaits();
    CheckpointWaits(const CheckpointWaits&) = delete;
    CheckpointWaits& operator=(const CheckpointWaits&) = delete;

   private:
    comm::Communicator& world_;
    double before_;
  };

  TrainConfig cfg_;
  comm::Runtime& rt_;
  comm::Communicator& world_;
  comm::StepPhaseScope phases_;  // the desync check's step phases on world_ and its splits
  std::unique_ptr<Task> task_;
  std::unique_ptr<parallel::ProcessGrid> grid_;
  int rank_ = 0;
  int64_t run_id_ = 0;  // drawn by rank 0 at start: every file of this run's checkpoint sets carries it
  // The set a resume started from, "<main file name> run <its run id>": every set of this run
  // records it as its "parent" (its line of sets); empty for a run from step 0.
  std::string parent_set_;
  std::unique_ptr<FolderOwner> owner_;  // world rank 0, with --checkpoint-dir: the folder's (checkpoint_owner.h)
  int64_t batch_ = 0;
  int parts_ = 1;                             // micro-batches of a step: --accumulate, or the pipeline's
  Device device_ = Device::cpu();             // where the model trains (--device)
  std::string comm_ = "mpi";                  // how device tensors travel: "nccl" or "mpi (host-staged)" (choose_comm)
  std::unique_ptr<comm::Communicator> nccl_;  // data parallel on GPUs (declared before dp_, which uses it)
  std::unique_ptr<parallel::DataParallel> dp_;
  // ZeRO-3: this rank's blocks of the model's values, kept as the model was built; handed to dp_.
  std::unique_ptr<parallel::ShardedInit> built_;
  std::unique_ptr<parallel::PipelineStage> pipe_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::unique_ptr<optim::LrSchedule> sched_;
  std::unique_ptr<optim::LossScaler> scaler_;       // fp16 only
  std::unique_ptr<optim::MagnitudePruner> pruner_;  // --prune-sparsity
  std::unique_ptr<MetricsWriter> metrics_;
  JsonFields provenance_;  // the metrics file's first line and every checkpoint's "provenance"
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<ChromeTrace> trace_;
  // The checkpoint the writer rank writes in the background (--checkpoint-async); every rank keeps
  // its name and when it started, to agree on it at the next checkpoint or the end.
  struct PendingCheckpoint {
    std::string file;
    CheckpointState snapshot;  // what the writer thread writes
    std::thread writer;
    std::exception_ptr error;
    double stall_s = 0;  // the loop's time taking the snapshot
    double write_s = 0;  // the background write's duration
    ~PendingCheckpoint() {
      if (writer.joinable()) writer.join();
    }
  };
  std::unique_ptr<PendingCheckpoint> pending_;
  // With --checkpoint-async, the last snapshot's host tensors, kept between checkpoints (memory:
  // one host copy of the parameters and optimizer state) so the next snapshot is only a copy.
  std::map<std::string, Tensor> snapshot_arena_;
  int64_t step_ = 0, start_step_ = 0, steps_per_epoch_ = 0, total_steps_ = 0, epochs_ = 0;
  bool has_epochs_ = true;
  TrainResult result_;
  // The loss rows of the steps since the last read (on the model's device) and their units; the
  // interval's sums since the last log line.
  Tensor rows_;
  std::vector<int64_t> row_units_;
  struct Interval {
    double loss = 0, wait = 0, comm = 0, fwd = 0, bwd = 0, opt = 0, t0 = 0;
    int64_t steps = 0, hits = 0, units = 0, bytes0 = 0;
  } iv_;
  // The step-time split since the last straggler comparison: data wait, forward, backward, exchange
  // wait, optimizer (seconds summed over the steps).
  std::vector<double> split_ = std::vector<double>(5, 0.0);
  std::string slow_section_;  // DTRAIN_TEST_SLOW on this rank: the section it sleeps in
  int slow_ms_ = 0;
  int64_t stop_after_ = -1;  // DTRAIN_TEST_STOP on this rank: the step after which it stops (SIGSTOP)
  double train_t0_ = 0, eval_total_s_ = 0, run_t0_ = 0, run_eval0_s_ = 0, run_cpu0_ = 0, ema_step_s_ = 0,
         bubble_sum_ = 0;
  int64_t run_units_ = 0, step_mallocs_ = 0;
  std::map<int64_t, int64_t> steps_per_batch_units_;  // steps run at each batch size (samples or tokens)
  JsonFields last_validation_;
  float lr_scale_ = 1.f, momentum_ = 0.f;  // set_base_lr's factor on the schedule; SGD's momentum
  int64_t hook_every_ = 0;
  std::function<void(int64_t)> step_hook_;
};

// Loss and accuracy of `model` over all of `ds`, its samples split over the ranks of `comm` (null:
// one rank). Inputs are normalised with `mean`/`std` (the training set's; empty: ds's own).
EvalResult evaluate_model(nn::Module& model, std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                          bool normalize, comm::Communicator* comm, const std::vector<float>& mean = {},
                          const std::vector<float>& std = {});

// The same over any host forward (x f32 batch -> logits f32): an int8 model, or an fp32 one timed
// beside it. `forward_s`, when given, receives the seconds spent inside `forward`.
using HostForward = std::function<Tensor(const Tensor&)>;
EvalResult evaluate_forward(const HostForward& forward, std::shared_ptr<const data::ShardedHdf5Dataset> ds,
                            int64_t batch, comm::Communicator* comm, const std::vector<float>& mean,
                            const std::vector<float>& std, double* forward_s = nullptr);

// An image classifier rebuilt from a checkpoint `path` (loaded as `s`): the model with its
// parameters and buffers, in evaluation mode, and the training set's input normalisation.
struct ImageCheckpoint {
  nn::ModelSpec spec;
  std::unique_ptr<nn::Sequential> model;
  std::vector<float> mean, std;  // empty when the checkpoint has none
};
ImageCheckpoint image_model_from_checkpoint(const std::string& path, CheckpointState& s);
// The inverse: a checkpoint of only the model (spec fields, parameters, buffers, normalisation),
// which image_model_from_checkpoint, `dtrain eval` and `dtrain quantize` read (prune-export's output).
CheckpointState image_model_checkpoint(const ImageCheckpoint& c);
// The training set's input normalisation a checkpoint keeps ("meta/norm_mean", "meta/norm_std");
// mean and std stay empty when it has none.
void checkpoint_normalisation(const CheckpointState& s, std::vector<float>& mean, std::vector<float>& std);

// Seconds since this process started (from /proc), for the time-to-first-step figure.
double process_age_s();

}  // namespace dtrain::train

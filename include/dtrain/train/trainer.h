#pragma once
// The training loop: data (sharded HDF5 or synthetic) -> model forward/backward -> data-parallel
// gradient exchange -> optimizer, with evaluation, metrics, progress and checkpoints.
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "dtrain/comm/runtime.h"
#include "dtrain/data/loader.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/loss_scaler.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/optim/schedule.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/config.h"
#include "dtrain/train/metrics.h"

namespace dtrain::train {

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
};

struct TrainResult {
  int64_t steps = 0;
  double final_loss = 0;
  EvalResult last_eval;
  double samples_per_s = 0;    // global, over the run's steady state (after the first step)
  double first_step_at_s = 0;  // seconds from process start to the end of the first step
  int preempted_by = 0;        // the signal that stopped the run early after a checkpoint, or 0
  // On a GPU: the caching allocator's peak allocation and reservation (cache included) at the end,
  // and the cudaMalloc calls it made after the second step (0 when the steps allocate nothing new).
  double gpu_peak_allocated_mib = 0, gpu_reserved_mib = 0;
  int64_t gpu_mallocs_after_warmup = -1;
};

class Trainer {
 public:
  // `dp` is the data-parallel communicator (default: the runtime's world).
  Trainer(const TrainConfig& cfg, comm::Runtime& rt, comm::Communicator* dp = nullptr);
  ~Trainer();
  TrainResult run();
  EvalResult evaluate(const data::ShardedHdf5Dataset& ds);

  nn::Module& model() { return *model_; }
  int64_t per_rank_batch() const { return batch_; }

 private:
  void setup();           // options, data, model: the ranks agree on its outcome
  void setup_exchange();  // data parallel (NCCL), optimizer, schedule, metrics: agreed in turn
  void build_optimizer();
  float topk_momentum_correction() const;
  void save(int64_t epoch, int64_t batch_in_epoch);
  void write_main(const std::filesystem::path& path, std::map<std::string, Tensor>& optim_state, bool no_parts,
                  int64_t epoch, int64_t batch_in_epoch);  // rank 0: the checkpoint itself, then pruning
  void restore(const std::string& path, int64_t& epoch, int64_t& skip);
  void resume_position(int64_t then_world, int64_t then_global, int64_t& skip);
  void say(const std::string& s);

  TrainConfig cfg_;
  comm::Runtime& rt_;
  comm::Communicator& comm_;
  int rank_ = 0, world_ = 1;
  int64_t batch_ = 0;
  Device device_ = Device::cpu();  // where the model trains (--device)
  std::shared_ptr<data::ShardedHdf5Dataset> train_ds_, test_ds_;
  std::unique_ptr<data::DataLoader> loader_;
  nn::ModelSpec spec_;
  nn::ModulePtr model_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::unique_ptr<optim::LrSchedule> sched_;
  // Data parallel on GPUs: gradients go through NCCL (declared before dp_, which uses it).
  std::unique_ptr<comm::Communicator> nccl_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::unique_ptr<optim::LossScaler> scaler_;  // fp16 only
  std::unique_ptr<MetricsWriter> metrics_;
  JsonFields provenance_;  // the metrics file's first line and every checkpoint's "provenance"
  std::unique_ptr<Progress> progress_;
  int64_t step_ = 0, steps_per_epoch_ = 0, total_steps_ = 0, epochs_ = 0;
};

// Loss and accuracy of `model` over all of `ds`, its samples split over the ranks of `comm` (null:
// one rank). Inputs are normalised with `mean`/`std` (the training set's; empty: ds's own).
EvalResult evaluate_model(nn::Module& model, std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                          bool normalize, comm::Communicator* comm, const std::vector<float>& mean = {},
                          const std::vector<float>& std = {});

// Seconds since this process started (from /proc), for the time-to-first-step figure.
double process_age_s();

}  // namespace dtrain::train

#pragma once
// Language-model training of the GPT on byte-token streams (dtrain convert text): AdamW, cosine
// schedule with warm-up, global-norm clipping, periodic validation loss and bits per byte, data
// parallel over the given communicator, HDF5 checkpoints that `dtrain generate` reads.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

struct LmConfig {
  std::string data;  // directory holding train.h5 and val.h5
  nn::GptConfig model;
  int64_t batch_size = 8;  // sequences per rank per step
  int64_t seq_len = 0;     // 0: the model's context
  int64_t steps = 1000;
  float lr = 1e-3f, min_lr = 1e-4f, weight_decay = 0.1f, clip_grad_norm = 1.f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;  // AdamW
  int64_t warmup_steps = 100;
  int64_t eval_every = 200;   // steps between validation passes (0: only at the end)
  int64_t eval_batches = 16;  // validation batches per pass (0: the whole validation stream)
  int64_t log_every = 20;
  int tp = 1;                           // tensor-parallel ranks (dp is the rest of the world)
  int pp = 1;                           // pipeline stages
  std::string pp_split;                 // blocks per stage, e.g. "2,4" (empty: balanced by cost)
  int64_t micro_batches = 0;            // pipeline micro-batches per step (0: 2 * pp); must divide batch_size
  std::string schedule = "1f1b";        // pipeline schedule: "1f1b" or "gpipe"
  bool checkpoint_activations = false;  // recompute each block's activations in backward
  std::string precision = "fp32";       // "fp32", "bf16", "fp16" (GEMM inputs rounded, f32 accumulation), "tf32" (GPU)
  int64_t loss_scale_interval = 2000;   // fp16: finite steps in a row before the loss scale doubles
  float loss_scale_init = 65536.f;      // fp16: the first loss scale
  std::string device = "cpu";           // "cpu" or "cuda" (one GPU per rank; the GPT: tp = pp = 1)
  int threads = 0;                      // 0: leave the engine's setting
  uint64_t seed = 1;
  std::string metrics;           // JSON-lines file (rank 0)
  std::string checkpoint_dir;    // ckpt-step<N>.h5 every checkpoint_every steps and at the end, when set
  int64_t checkpoint_every = 0;  // 0: at the end only
  int keep_checkpoints = 2;      // the newest kept in checkpoint_dir
  std::string resume;            // checkpoint file, or directory of the newest, written in any layout
  // Preemption, as the image trainer: these signals on any rank stop every rank after the same
  // step, behind a checkpoint; the run returns preempted_by (dtrain exits with kExitPreempted).
  std::string preempt_signals = "TERM,USR1";
  int64_t preempt_check_every = 1;
  std::string config_ini;  // the whole `dtrain train` configuration (config_ini), for the provenance
  // Data parallel, as for image models: gradient compression over the dp group (PowerSGD per weight
  // matrix; vectors go uncompressed), its warm-up (-1: --warmup-steps), buckets and overlap.
  std::string compression = "none";
  int64_t compression_warmup = -1;
  bool compression_on_engine = false;
  double bucket_mb = 25;
  bool overlap = true;
  int64_t accumulate = 1;  // micro-batches of batch_size per optimizer step (not with pp > 1)
  std::string trace;       // Chrome trace of each rank's steps (needs `world`)
  int64_t trace_steps = 1000;
  std::string progress = "auto";  // a progress bar with ETA on rank 0's terminal
  bool quiet = false;
};

struct LmResult {
  int64_t steps = 0;  // the step the run ended at (fewer than LmConfig::steps when preempted)
  double train_loss = 0;  // mean over the last log interval, nats per token
  double val_loss = 0;    // nats per token
  double val_bpb = 0;     // bits per byte (= val_loss / ln 2 for byte tokens)
  double tokens_per_s = 0;
  std::string checkpoint;  // the file written, when any
  // Pipeline (pp > 1), this rank's stage: measured bubble (time waiting for other stages over step
  // time, mean over steps), the ideal one, and the most activation bytes held at once.
  double pp_bubble = 0, pp_ideal_bubble = 0;
  size_t pp_peak_activation_bytes = 0;
  // On a GPU: cudaMalloc calls of the caching allocator inside the steps after the first two
  // (0 when the steps allocate nothing new; validation not counted); -1 on the CPU or for runs of
  // two steps or fewer.
  int64_t gpu_step_mallocs = -1;
  std::vector<double> step_losses;  // every step's training loss (rank 0), for comparisons
  // fp16: the loss scale after the last step and the steps skipped for inf/NaN gradients.
  double loss_scale = 1;
  int64_t skipped_steps = 0;
  int preempted_by = 0;  // the signal that stopped the run after a checkpoint, or 0
};

// The language-model part of `dtrain train`'s one configuration (model = gpt).
LmConfig lm_config(const TrainConfig& cfg);

// `world` may be null (one rank). Every rank of `world` must call it: the ranks form a dp x tp x pp
// grid (parallel::ProcessGrid); each dp group draws its own windows, the tp ranks and stages of a
// group the same. Step s draws from a stream seeded by (seed, dp rank, s), so a resumed run sees
// the windows the uninterrupted one would have.
LmResult train_lm(const LmConfig& cfg, comm::Communicator* world);

// Mean cross-entropy (nats per token) of `model` over up to `max_batches` (0: all) consecutive
// non-overlapping windows of `tokens`.
double evaluate_lm(nn::Gpt& model, const std::string& val_file, int64_t batch, int64_t seq_len, int64_t max_batches);

// Checkpoint <-> GPT: parameters under "param/" in the one-rank layout (tensor-parallel shards
// are gathered first, parallel::gather_full_parameters), the config as an int list. Under a
// pipeline each stage writes its own part, with its place in the grid (pp_stage, pp_stages,
// first_block, end_block, tp): stage 0 ckpt-N.h5, stage s ckpt-N.stage<s>.h5 beside it.
// load_gpt_checkpoint reads ckpt-N.h5 and merges the other stages' parts into one state. The AdamW
// moments are saved the same way ("optim/<param>.exp_avg", ".exp_avg_sq"), so LmConfig::resume
// continues a run in any other dp x tp x pp layout.
CheckpointState load_gpt_checkpoint(const std::string& file);
CheckpointState gpt_checkpoint_state(const nn::GptConfig& cfg, const std::map<std::string, Tensor>& full_params,
                                     int64_t step);
std::unique_ptr<nn::Gpt> gpt_from_checkpoint(const CheckpointState& s);

}  // namespace dtrain::train

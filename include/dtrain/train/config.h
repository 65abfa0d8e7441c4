#pragma once
// The training job's configuration: an INI file (`key = value`, same names as the long options)
// plus command-line overrides, parsed by Boost.Program_options.
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/data/augment.h"

namespace dtrain::train {

// The language models (trained by the LM task: token files, --steps, validation loss); the rest
// are image classifiers.
inline bool is_language_model(const std::string& model) { return model == "gpt" || model == "llama"; }

struct TrainConfig {
  std::string config_file;
  // trainer groups (train/sweep.h): the world split into `trainers` groups, each training
  // configurations of the --sweep grid ("lr=0.01,0.1"), each in its folder under sweep_dir
  int trainers = 1;
  std::vector<std::string> sweep;
  std::string sweep_dir = "runs/sweep";
  int sweep_random = 0;        // > 0: that many configurations drawn from the --sweep specs' lists and ranges
  int64_t pbt_every = 0;       // population-based training: steps between the trainers' tournaments (0: off)
  double target_accuracy = 0;  // trainer groups: the summary's time to this test accuracy (percent; 0: off)
  // data
  std::string data, test_data;
  bool synthetic = false;
  std::vector<int64_t> synthetic_shape{1, 28, 28};
  int64_t synthetic_classes = 10;
  bool normalize = true;
  data::AugmentOptions augment;
  int loader_threads = -1, prefetch = -1;
  std::string data_mode = "auto";  // how the training set is read: auto, cache or stream (data::choose_reading)
  int64_t data_cache_mb = 2048;    // memory for cached shards per node, split among its ranks
  // model
  std::string model = "simple_cnn";
  std::string model_file;  // an image model described in a file (nn/model_file.h), instead of --model
  std::vector<int64_t> hidden{256, 128};
  float dropout = 0.f;
  // schedule
  int64_t epochs = 1;
  int64_t steps = 0;              // > 0: stop after this many steps (overrides epochs when smaller)
  int64_t batch_size = 64;        // per rank
  int64_t global_batch_size = 0;  // > 0: per-rank batch = global / ranks
  bool drop_last = false;
  // optimizer
  std::string optimizer = "sgd";
  float lr = 0.05f, momentum = 0.9f, weight_decay = 0.f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  bool nesterov = false;
  float lars_eta = 0.001f;
  std::string lr_scaling = "none";  // none | linear: lr * global batch / base_batch_size
  int64_t base_batch_size = 64;
  std::string lr_schedule = "cosine";
  int64_t warmup_steps = 0, lr_step_size = 1000;
  float lr_gamma = 0.1f, min_lr = 0.f;
  float clip_grad_norm = 0.f;
  // precision: fp32, or bf16/fp16 GEMM and convolution inputs with fp32 accumulation and fp32
  // master weights; fp16 adds dynamic loss scaling
  std::string precision = "fp32";
  std::string device = "cpu";  // "cpu", "cuda" or "sim" (Device::sim: the device code path on CPU ranks)
  std::string comm = "auto";   // device tensors between ranks: "nccl", "mpi" (host-staged) or "auto"
  int64_t loss_scale_interval = 2000;
  float loss_scale_init = 65536.f;  // fp16: the first loss scale
  // runtime
  int threads = 0;  // 0: the node's cores / ranks on the node
  uint64_t seed = 42;
  int64_t log_every = 50;
  std::string progress = "auto";
  std::string metrics;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // steps; 0: at the end of each epoch only
  bool checkpoint_async = true;  // snapshot, then write in a background thread (one pipeline stage)
  int keep_checkpoints = 2;
  double checkpoint_timeout = 3600;  // s the ranks wait for a checkpoint's writers (0: no limit)
  std::string resume;
  // Preemption: these signals make every rank stop at a common step boundary, checkpoint and exit
  // with kPreemptedExitCode (42); ranks agree by an allreduce every `preempt_check_every` steps.
  std::string preempt_signals = "TERM,USR1";
  int64_t preempt_check_every = 1;
  std::string trace;           // Chrome trace JSON of each rank's steps (empty: none)
  int64_t trace_steps = 1000;  // steps recorded in the trace
  bool eval_each_epoch = true;
  double bucket_mb = 25;  // data-parallel gradient bucket size in MiB
  std::string allreduce;  // auto, mpi, shm, hier (comm::AllreduceAlgorithm); empty: DTRAIN_ALLREDUCE
  bool overlap = true;    // start each bucket's allreduce during backward
  std::string compression = "none";
  std::string compression_scope = "all";  // all, inter-node (exact within a node, compressed between nodes)
  int64_t compression_warmup = -1;        // top-k sparsity / PowerSGD uncompressed warm-up steps; -1: one epoch
  bool momentum_correction = true;        // top-k under SGD momentum: the compressor keeps the momentum (DGC)
  int64_t accumulate = 1;                 // micro-batches per optimizer step (gradients communicated on the last)
  bool zero1 = false;                     // --zero1 true: a spelling of --zero 1
  int zero = 0;                           // ZeRO stage (parallel::DataParallelOptions::zero)
  bool reshard_after_forward = true;      // ZeRO-3: free a unit's values after its forward
  bool zero_prefetch = true;              // ZeRO-3: gather the next unit while this one computes
  std::string zero_gather_dtype = "f32";  // ZeRO-3: the dtype of the parameters' all-gathers
  std::string shard_scope = "all";        // ZeRO-2/3: shard over all ranks, or within each node
  double memory_per_rank_mb = 0;          // the model state a rank may hold (0: its share of the node or GPU)
  bool memory_report = false;             // every rank reports its memory at the end
  bool sync_batchnorm = false;
  int64_t straggler_every = 100;     // steps between the ranks' comparisons of their step times (0: off)
  double straggler_threshold = 0.2;  // a rank busier than the median by more than this fraction is named
  int64_t check_replicas = 0;        // > 0: every this many steps the dp replicas compare parameter hashes
  int64_t desync_check_every = 20;   // steps between comparisons of the ranks' collective sequences (0: off)
  // magnitude pruning (optim::MagnitudePruner): the final sparsity, reached by a cubic ramp
  float prune_sparsity = 0.f;                                  // 0: off
  int64_t prune_start = 0, prune_end = -1, prune_every = 100;  // prune_end -1: at 80 % of the run
  bool prune_structured = false;
  std::string prune_scope = "global";  // global | layer (unstructured)
  // knowledge distillation (image models): loss = w T^2 KL(soft teacher || soft student) + (1 - w) CE
  std::string teacher;  // checkpoint of the teacher (empty: no distillation)
  std::string freeze;   // parameters (a regular expression over their names) that are not trained
  float distill_temperature = 2.f, distill_weight = 0.5f;
  // language model (model = gpt or llama): its shape, validation and dp x tp x pp layout
  int64_t layers = 4, heads = 4, width = 128, context = 128, vocab = 0;  // vocab 0: the token files'
  int64_t kv_heads = 0;    // key/value heads (0: --heads; fewer: grouped-query attention)
  int64_t mlp_width = 0;   // the MLP's hidden width (0: 4 C for gpt, Llama's 8/3 C rounded up to 32)
  float rope_base = 1e4f;  // llama: the rotary frequencies' base
  std::string init_from;   // pretrained weights (safetensors file or folder) to start from
  int64_t lora_rank = 0;   // LoRA adapters of this rank (0: none); then only they train
  float lora_alpha = 16.f;
  std::string lora_targets = "q,v";
  int64_t seq_len = 0;            // tokens per sequence (0: the context)
  int64_t eval_every = 200;       // steps between validation passes (0: at the end only)
  int64_t eval_batches = 16;      // validation batches per pass (0: the whole validation stream)
  int tp = 1, pp = 1;             // tensor-parallel ranks and pipeline stages (dp is the rest)
  std::string pp_split;           // blocks per stage, e.g. "2,4" (empty: balanced by cost)
  int64_t micro_batches = 0;      // pipeline micro-batches per step (0: 2 x pp)
  std::string schedule = "1f1b";  // pipeline schedule: 1f1b or gpipe
  bool checkpoint_activations = false;
  bool print_config = false;  // print the effective configuration as INI and exit
  bool quiet = false;         // no log lines (tests; not an option)
};

// The defaults of `model`'s options: the shared options have one default, except where a model's
// recipe needs another (the GPT: AdamW's lr, batch, warm-up, decay, clipping; `--help` shows them
// with --model gpt).
TrainConfig model_defaults(const std::string& model);

// Parses `dtrain train` arguments (argv[0] is "train") with the defaults of the model they name.
// Returns false after printing --help. Throws InputError naming the option (or the config file and
// line) for anything wrong, and naming both options for a combination that does not work.
bool parse_train_config(int argc, char** argv, TrainConfig& cfg);

// Every option of `cfg` as `key = value` lines (an INI file that `--config` reads back into the
// same configuration), under a comment naming the model's sections.
std::string config_ini(const TrainConfig& cfg);

}  // namespace dtrain::train

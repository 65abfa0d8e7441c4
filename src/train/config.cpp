#include "dtrain/train/config.h"

#include <boost/program_options.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <sstream>
#include <type_traits>

#include "dtrain/core/error.h"
#include "dtrain/nn/model_file.h"
#include "dtrain/train/options.h"
#include "dtrain/train/signals.h"

namespace po = boost::program_options;

namespace dtrain::train {

namespace {

// "1,28,28" or "1x28x28" -> {1, 28, 28}
std::vector<int64_t> parse_dims(const std::string& s, const char* option) {
  std::vector<int64_t> out;
  std::string tok;
  std::string norm = s;
  for (char& c : norm)
    if (c == 'x' || c == ',') c = ' ';
  std::istringstream in(norm);
  while (in >> tok) {
    try {
      size_t used = 0;
      long long v = std::stoll(tok, &used);
      DT_INPUT_CHECK(used == tok.size() && v >= 0, "option --" << option << ": '" << s << "' is not a list of sizes");
      out.push_back(v);
    } catch (const std::logic_error&) {
      throw InputError(std::string("option --") + option + ": '" + s + "' is not a list of sizes");
    }
  }
  return out;
}

std::string join_dims(const std::vector<int64_t>& d) {
  std::string s;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(d[i]);
  }
  return s;
}

// A value as INI text that reads back as the same value (floats: the shortest such decimal).
template <class T>
std::string ini_text(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v;
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[40];
    for (int digits = 6;; ++digits) {
      std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(v));
      if (digits >= 17 || static_cast<T>(std::strtod(buf, nullptr)) == v) return buf;
    }
  } else {
    return std::to_string(v);
  }
}

// Every `dtrain train` option, bound to the fields of one TrainConfig, in three sections, with
// each option's value as INI text (--print-config, the provenance line of metrics and checkpoints).
class TrainOptions {
 public:
  TrainOptions(TrainConfig& c, const TrainConfig& def);

  po::options_description common{"Options of every model"};
  po::options_description image{"Image models (mlp, simple_cnn, resnet20); not with the language models"};
  po::options_description lm{"Language models (--model gpt, llama)"};
  std::string synthetic_shape, hidden;  // parsed into the config's lists after the options

  po::options_description all() const {
    po::options_description a;
    a.add(common).add(image).add(lm);
    return a;
  }
  // The options of `model`'s sections (a config file with another model's options is refused). An
  // empty value is left out where it is the default (a path not given), written as `name = ` where
  // it is not, so that it does not read back as the default.
  std::string ini(const std::string& model) const {
    const po::options_description& other = is_language_model(model) ? image : lm;
    std::string out;
    for (const auto& [name, value, def] : values_) {
      const std::string v = value();
      if ((!v.empty() || !def.empty()) && !other.find_nothrow(name, false)) out += name + " = " + v + "\n";
    }
    return out;
  }

 private:
  template <class T>
  void add(po::options_description& g, const char* name, T* field, const T& def, const char* help) {
    g.add_options()(name, po::value<T>(field)->default_value(def, ini_text(def)), help);
    values_.push_back({name, [field] { return ini_text(*field); }, ini_text(def)});
  }
  void add_path(po::options_description& g, const char* name, std::string* field, const char* help) {
    g.add_options()(name, po::value<std::string>(field), help);
    values_.push_back({name, [field] { return *field; }, ""});
  }
  // A switch: `--name` alone means true; `--name=false` and `name = false` in a config file work too.
  void add_switch(po::options_description& g, const char* name, bool* field, bool def, const char* help) {
    g.add_options()(name, po::value<bool>(field)->default_value(def, ini_text(def))->implicit_value(true, "true"),
                    help);
    values_.push_back({name, [field] { return ini_text(*field); }, ini_text(def)});
  }

  struct Value {
    std::string name;
    std::function<std::string()> text;
    std::string default_text;
  };
  std::vector<Value> values_;
};

TrainOptions::TrainOptions(TrainConfig& c, const TrainConfig& def)
    : synthetic_shape(join_dims(c.synthetic_shape)), hidden(join_dims(c.hidden)) {
  // clang-format off
  add(common, "model", &c.model, def.model, "model: mlp, simple_cnn, resnet20 or gpt (its defaults: --model gpt --help)");
  add_path(common, "data", &c.data, "training data: a directory of HDF5 shards (dtrain convert), or of train.h5 and val.h5 for the gpt (dtrain convert text)");
  add(common, "steps", &c.steps, def.steps, "optimizer steps (image models: 0 runs all epochs; stops early when smaller)");
  add(common, "batch-size", &c.batch_size, def.batch_size, "samples (gpt: sequences) per step (micro-step with --accumulate) per rank");
  add(common, "lr", &c.lr, def.lr, "base learning rate");
  add(common, "min-lr", &c.min_lr, def.min_lr, "cosine schedule: final learning rate");
  add(common, "warmup-steps", &c.warmup_steps, def.warmup_steps, "linear learning-rate warm-up steps");
  add(common, "weight-decay", &c.weight_decay, def.weight_decay, "weight decay (decoupled for adamw; the gpt decays matrices only)");
  add(common, "beta1", &c.beta1, def.beta1, "Adam beta1");
  add(common, "beta2", &c.beta2, def.beta2, "Adam beta2");
  add(common, "eps", &c.eps, def.eps, "Adam epsilon");
  add(common, "clip-grad-norm", &c.clip_grad_norm, def.clip_grad_norm, "clip the global gradient norm to this (0: off)");
  add(common, "precision", &c.precision, def.precision, "fp32, bf16 or fp16 (GEMM/conv inputs; fp32 accumulation and master weights; fp16 with dynamic loss scaling); tf32 on a GPU");
  add(common, "device", &c.device, def.device, "cpu, cuda (a GPU per rank, or ranks sharing one through --comm mpi), or sim (the CPU engine on memory marked as a device's: runs the device code path on CPU ranks, host reads of device memory throw)");
  add(common, "comm", &c.comm, def.comm, "how device tensors travel between ranks: nccl, mpi (host-staged), or auto (nccl where every rank of a node has its own GPU, else mpi)");
  add(common, "loss-scale-interval", &c.loss_scale_interval, def.loss_scale_interval, "fp16: finite steps in a row before the loss scale doubles");
  add(common, "loss-scale-init", &c.loss_scale_init, def.loss_scale_init, "fp16: the first loss scale (halved on every step with inf/NaN gradients)");
  add(common, "threads", &c.threads, def.threads, "compute threads per rank (0: node cores / ranks on the node)");
  add(common, "seed", &c.seed, def.seed, "seed for initialisation, data order, augmentation, dropout");
  add(common, "log-every", &c.log_every, def.log_every, "steps between log and metrics lines");
  add_path(common, "metrics", &c.metrics, "JSON-lines metrics file (written by rank 0; its first line is the run's provenance)");
  add_path(common, "checkpoint-dir", &c.checkpoint_dir, "write HDF5 checkpoints here");
  add_switch(common, "checkpoint-async", &c.checkpoint_async, def.checkpoint_async, "write checkpoints in a background thread: the loop stalls only to copy the state (with --pp: written in the loop)");
  add(common, "checkpoint-every", &c.checkpoint_every, def.checkpoint_every, "steps between checkpoints (0: image models at each epoch end, the gpt at the end)");
  add(common, "keep-checkpoints", &c.keep_checkpoints, def.keep_checkpoints, "checkpoints kept in --checkpoint-dir");
  add(common, "checkpoint-timeout", &c.checkpoint_timeout, def.checkpoint_timeout, "seconds the ranks wait for a checkpoint's writers (instead of the communication timeout: a slow file system is not a lost rank); 0: without limit");
  add_path(common, "resume", &c.resume, "resume from this checkpoint file (or the newest in this directory)");
  add(common, "preempt-signals", &c.preempt_signals, def.preempt_signals, "signals that checkpoint at the next step and exit with code 42: comma list of TERM, USR1, USR2, INT, HUP, CONT, or none");
  add(common, "preempt-check-every", &c.preempt_check_every, def.preempt_check_every, "steps between the ranks' agreement on a received preemption signal");
  common.add_options()("print-config", po::bool_switch(&c.print_config), "print the effective configuration as an INI file that --config reads back, and exit");
  add(common, "trainers", &c.trainers, def.trainers, "trainer groups: the ranks split into this many groups, each training its share of the --sweep configurations (each group a dp x tp x pp grid of its ranks)");
  common.add_options()("sweep", po::value<std::vector<std::string>>(&c.sweep)->composing(), "OPTION=V1,V2,...: train every value (repeated: every combination), each a trainer with its own seed (--seed + its index) and folder under --sweep-dir; a summary ranks them");
  values_.push_back({"sweep", [&c] { std::string t; for (const auto& v : c.sweep) t += (t.empty() ? "" : "\nsweep = ") + v; return t; }, ""});
  add(common, "sweep-random", &c.sweep_random, def.sweep_random, "trainer groups: draw this many configurations instead of the grid, each --sweep value from its list (V1,V2,...) or range (LO:HI uniform, LO:HI:log log-uniform; integers when both ends are), seeded by --seed (0: the grid)");
  add(common, "pbt-every", &c.pbt_every, def.pbt_every, "population-based training over the trainers (one per --sweep configuration, all at once): every this many steps they pair up, compare the validation metric, and the loser takes the winner's weights, optimizer state, learning rate and momentum, then multiplies the learning rate and 1 - momentum by 0.8 or 1.25 (0: off; needs --steps)");
  add(common, "target-accuracy", &c.target_accuracy, def.target_accuracy, "trainer groups: the summary gives each trainer's training time (evaluation excluded) to its first validation at this test accuracy, in percent (a batch-size search: --sweep batch-size=... --lr-scaling linear); 0: off");
  add(common, "sweep-dir", &c.sweep_dir, def.sweep_dir, "trainer groups: the run folders (trainer-<i>/: metrics, checkpoints) and summary.json");

  add_path(common, "model-file", &c.model_file, "a model described in a JSON or INI file (docs/models.md; examples/models/), instead of --model: an image model's layers and blocks, or a language model's shape (its language_model section: gpt2.json, llama.json)");
  add_path(image, "test-data", &c.test_data, "test data evaluated after each epoch (directory of shards)");
  add_switch(image, "synthetic", &c.synthetic, def.synthetic, "train on random batches of the model's input shape; reads no data");
  image.add_options()("synthetic-shape", po::value<std::string>(&synthetic_shape)->default_value(join_dims(def.synthetic_shape)), "per-sample shape C,H,W for --synthetic");
  values_.push_back({"synthetic-shape", [this] { return synthetic_shape; }, join_dims(def.synthetic_shape)});
  add(image, "synthetic-classes", &c.synthetic_classes, def.synthetic_classes, "classes for --synthetic");
  add_path(common, "teacher", &c.teacher, "knowledge distillation: a checkpoint of a trained model of the same task (an image model with the same classes and inputs; a language model, gpt or llama, with the same vocabulary and tokenizer); the student also learns its softened outputs on the same batches");
  add(common, "distill-temperature", &c.distill_temperature, def.distill_temperature, "distillation: the temperature T that softens both models' outputs");
  add(common, "distill-weight", &c.distill_weight, def.distill_weight, "distillation: loss = w T^2 KL(teacher || student) + (1 - w) cross-entropy with the labels (a language model's: the next tokens)");
  add(image, "normalize", &c.normalize, def.normalize, "normalise inputs by the training set's per-channel mean/std");
  add(image, "augment-crop", &c.augment.crop_padding, def.augment.crop_padding, "random crop after zero padding by this many pixels (0: off)");
  add(image, "augment-flip", &c.augment.hflip, def.augment.hflip, "random horizontal flip");
  add(image, "augment-rotate", &c.augment.rotate_deg, def.augment.rotate_deg, "random rotation within +-degrees (0: off)");
  add(image, "loader-threads", &c.loader_threads, def.loader_threads, "loader threads per rank (-1: DTRAIN_LOADER_THREADS)");
  add(image, "prefetch", &c.prefetch, def.prefetch, "batches prepared ahead (-1: DTRAIN_PREFETCH)");
  add(image, "data-mode", &c.data_mode, def.data_mode, "how the training set is read: cache (whole shards in memory up to --data-cache-mb, the rest read per request), store (the shards spread over the data-parallel ranks, each holding its share in memory; every batch gathers its rows by an all-to-all: for data that fits the job's memory but not a node's), stream (shards in a per-epoch order, each read whole once, rows shuffled within windows of shards that fit the budget; for data larger than memory), auto (cache when it fits a node, store when it fits the job, else stream); the first log line says which and why");
  add(image, "data-cache-mb", &c.data_cache_mb, def.data_cache_mb, "memory for cached shards per node (split among the node's ranks)");
  image.add_options()("hidden", po::value<std::string>(&hidden)->default_value(join_dims(def.hidden)), "MLP hidden widths, comma separated");
  values_.push_back({"hidden", [this] { return hidden; }, join_dims(def.hidden)});
  add(image, "dropout", &c.dropout, def.dropout, "MLP dropout probability");
  add(image, "epochs", &c.epochs, def.epochs, "passes over the training data");
  add(image, "global-batch-size", &c.global_batch_size, def.global_batch_size, "samples per optimizer step over all ranks and micro-steps (0: batch-size x ranks x accumulate); must divide evenly");
  add(image, "drop-last", &c.drop_last, def.drop_last, "drop the last partial batch of each epoch");
  add(image, "optimizer", &c.optimizer, def.optimizer, "sgd, adam, adamw, lars or lamb (the gpt: adamw)");
  add(image, "lars-eta", &c.lars_eta, def.lars_eta, "LARS trust coefficient");
  add(image, "lr-scaling", &c.lr_scaling, def.lr_scaling, "none, or linear: lr x global batch / --base-batch-size");
  add(image, "base-batch-size", &c.base_batch_size, def.base_batch_size, "the global batch --lr is given for (with --lr-scaling linear)");
  add(image, "momentum", &c.momentum, def.momentum, "SGD momentum");
  add(image, "nesterov", &c.nesterov, def.nesterov, "Nesterov momentum");
  add(image, "lr-schedule", &c.lr_schedule, def.lr_schedule, "constant, step or cosine (per step, to --min-lr at the end; the gpt: cosine)");
  add(image, "lr-step-size", &c.lr_step_size, def.lr_step_size, "step schedule: steps between decays");
  add(image, "lr-gamma", &c.lr_gamma, def.lr_gamma, "step schedule: decay factor");
  add(common, "progress", &c.progress, def.progress, "progress bar on rank 0: on, off, or auto (a bar where a person watches a terminal: not in a SLURM or PBS job, nor where the launcher writes to a file; plain lines there)");
  add_path(common, "trace", &c.trace, "write a Chrome trace (Perfetto) of each rank's data wait, compute, communication wait and optimizer to this JSON file");
  add(common, "trace-steps", &c.trace_steps, def.trace_steps, "steps recorded by --trace, from the first");
  add(image, "eval", &c.eval_each_epoch, def.eval_each_epoch, "evaluate on --test-data after each epoch");
  add(common, "bucket-mb", &c.bucket_mb, def.bucket_mb, "data-parallel gradient bucket size (MiB)");
  add(common, "overlap", &c.overlap, def.overlap, "start each bucket's allreduce while backward runs");
  add(common, "allreduce", &c.allreduce, def.allreduce, "allreduce algorithm of the MPI backend: auto (by size and layout), mpi, shm (one node's shared memory), hier (shm within nodes, MPI between them); empty: DTRAIN_ALLREDUCE, mpi");
  add(common, "compression", &c.compression, def.compression, "gradient compression: none, fp16, bf16, topk:RATIO, powersgd:RANK, onebit, qsgd:LEVELS");
  add(common, "compression-scope", &c.compression_scope, def.compression_scope, "where --compression applies: all (every data-parallel exchange), inter-node (gradients averaged exactly within each node, compressed only between nodes; on one node nothing is compressed)");
  add(common, "compression-warmup", &c.compression_warmup, def.compression_warmup, "compression warm-up steps (-1: one epoch, the gpt: --warmup-steps; 0: none): top-k's kept fraction falls from 25 % to the target; PowerSGD sends uncompressed gradients until then");
  add(image, "momentum-correction", &c.momentum_correction, def.momentum_correction, "top-k with SGD momentum: accumulate momentum, not raw gradients, in the compressor (Deep Gradient Compression); the optimizer then runs without momentum");
  add(common, "accumulate", &c.accumulate, def.accumulate, "micro-batches per optimizer step (gradient accumulation)");
  add(common, "zero", &c.zero, def.zero, "ZeRO stage over the data-parallel ranks: 0 replicated; 1 optimizer state sharded (each parameter's piece keeps its optimizer group); 2 gradients sharded too (reduce-scattered unit by unit in backward); 3 parameters too (gathered per unit for its forward and backward)");
  add(common, "zero1", &c.zero1, def.zero1, "true: --zero 1");
  add(common, "reshard-after-forward", &c.reshard_after_forward, def.reshard_after_forward, "--zero 3: free a unit's parameters after its forward and gather them again for its backward (false: keep them, ZeRO-2's memory during the pass)");
  add(common, "zero-prefetch", &c.zero_prefetch, def.zero_prefetch, "--zero 3: start the next unit's all-gather while the current one computes");
  add(common, "memory-per-rank-mb", &c.memory_per_rank_mb, def.memory_per_rank_mb, "memory a rank may fill with the model's training state (parameters, gradients, optimizer state, ZeRO's shards and gathered units); a run that needs more is refused before its first step, naming what would fit (0: the GPU's memory, or the node's divided among its ranks)");
  add_switch(common, "memory-report", &c.memory_report, def.memory_report, "every rank reports its memory at the end (rank 0 always does): model state by kind, activations, ZeRO's peaks, peak RSS");
  add(common, "shard-scope", &c.shard_scope, def.shard_scope, "--zero 2 and 3: all (shard over every data-parallel rank) or node (shard within each node, replicate across nodes: the all-gathers never leave the node, each block's gradient is averaged between nodes)");
  add(common, "zero-gather-dtype", &c.zero_gather_dtype, def.zero_gather_dtype, "--zero 3: dtype of the parameters' all-gathers, f32 or bf16 (half the bytes; the master shards stay f32)");
  add(image, "sync-batchnorm", &c.sync_batchnorm, def.sync_batchnorm, "batch statistics over all data-parallel ranks");

  add(lm, "layers", &c.layers, def.layers, "transformer blocks");
  add(lm, "heads", &c.heads, def.heads, "attention heads (divide --width)");
  add(lm, "width", &c.width, def.width, "model width C");
  add(lm, "context", &c.context, def.context, "longest sequence (position table rows)");
  add(lm, "kv-heads", &c.kv_heads, def.kv_heads, "key/value heads (0: --heads; fewer, dividing --heads: grouped-query attention)");
  add(lm, "mlp-width", &c.mlp_width, def.mlp_width, "the MLP's hidden width (0: 4 x --width for gpt, 8/3 x --width rounded up to 32 for llama)");
  add(lm, "rope-base", &c.rope_base, def.rope_base, "llama: the base of the rotary position frequencies");
  add(lm, "lora-rank", &c.lora_rank, def.lora_rank, "LoRA adapters of this rank on the projections of --lora-targets; the base weights (and everything else) are frozen, only the adapters train (0: none)");
  add(lm, "lora-alpha", &c.lora_alpha, def.lora_alpha, "LoRA: the adapters' output is scaled by alpha / rank");
  add(lm, "lora-targets", &c.lora_targets, def.lora_targets, "LoRA: the projections adapted, of q, k, v, o, gate, up, down (GPT-2's MLP: up, down)");
  add_path(lm, "init-from", &c.init_from, "pretrained weights to start from: a safetensors file, or a folder of shards with model.safetensors.index.json (f32, bf16 or f16; Hugging Face's Llama or GPT-2 names, or dtrain's); strict: every missing, unexpected or misshapen tensor is named. A --resume (also a requeued job's) takes precedence");
  add(lm, "vocab", &c.vocab, def.vocab, "vocabulary (0: the token files', 256 for bytes)");
  add(lm, "seq-len", &c.seq_len, def.seq_len, "tokens per sequence (0: --context)");
  add(lm, "eval-every", &c.eval_every, def.eval_every, "steps between validation passes (0: at the end only)");
  add(lm, "eval-batches", &c.eval_batches, def.eval_batches, "validation batches per pass (0: all)");
  add(lm, "tp", &c.tp, def.tp, "tensor-parallel ranks (heads and MLP split; dp is the rest)");
  add(common, "straggler-every", &c.straggler_every, def.straggler_every, "every this many steps the ranks compare their step-time split (data wait, forward, backward, optimizer); a rank slower than the median is named in the log and metrics with the section that makes it slow (0: off)");
  add(common, "straggler-threshold", &c.straggler_threshold, def.straggler_threshold, "a straggler's busy time (step time without the exchange wait) exceeds the median rank's by more than this fraction (and by 1 ms per step)");
  add(common, "check-replicas", &c.check_replicas, def.check_replicas, "every this many steps the data-parallel replicas compare a hash of each parameter; a mismatch (silent corruption) names the ranks and the first differing parameter and stops the run before its next checkpoint (0: off)");
  add(common, "desync-check-every", &c.desync_check_every, def.desync_check_every, "every this many steps each rank compares its sequence of collectives (kind, size, dtype, op, step) on every communicator with a neighbour rank's, on the comm control thread; a rank that skipped, added or changed a collective is named on every rank before the mismatch can hang the run (0: off; a stalled wait checks anyway)");
  add_path(common, "freeze", &c.freeze, "parameters not to train: a regular expression (ECMAScript) matching their whole dtrain names, e.g. 'wte|blocks\\.[0-3]\\..*' (dtrain export --names dtrain lists them); they have no gradients (no memory, no communication) and the optimizer holds no state for them");
  add(common, "prune-sparsity", &c.prune_sparsity, def.prune_sparsity, "magnitude pruning: the fraction of conv/Linear weights (with --prune-structured: of each layer's output channels) set to zero, in [0, 1) (0: off)");
  add(common, "prune-start", &c.prune_start, def.prune_start, "pruning: the step the sparsity ramp starts at");
  add(common, "prune-end", &c.prune_end, def.prune_end, "pruning: the step the ramp (cubic) reaches --prune-sparsity (-1: at 80 % of the run)");
  add(common, "prune-every", &c.prune_every, def.prune_every, "pruning: steps between mask updates on the ramp");
  add(common, "prune-structured", &c.prune_structured, def.prune_structured, "pruning: whole output channels / rows of each layer (not the output layer) instead of single weights");
  add(common, "prune-scope", &c.prune_scope, def.prune_scope, "unstructured pruning: global (one magnitude threshold) or layer (each layer the same fraction)");
  add(common, "pp", &c.pp, def.pp, "pipeline stages: the model's layers (the gpt: blocks) cut into this many stages, balanced by measured layer costs (the gpt: by a cost model)");
  add_path(common, "pp-split", &c.pp_split, "layers (the gpt: blocks) per pipeline stage, e.g. 2,4 (default: balanced by cost)");
  add(common, "micro-batches", &c.micro_batches, def.micro_batches, "pipeline micro-batches per step (0: 2 x --pp; divides the per-rank batch)");
  add(common, "schedule", &c.schedule, def.schedule, "pipeline schedule: 1f1b or gpipe");
  add_switch(lm, "checkpoint-activations", &c.checkpoint_activations, def.checkpoint_activations, "recompute each block's activations in backward (less memory)");
  // clang-format on
}

// Options given (on the command line or in the config file) that `model` does not use: one message
// naming both.
void refuse_options_of_other_models(const po::variables_map& vm, const TrainOptions& o, const std::string& model) {
  const bool lm = is_language_model(model);
  for (const auto& opt : (lm ? o.image : o.lm).options()) {
    const std::string& name = opt->long_name();
    if (vm.count(name) && !vm[name].defaulted())
      throw InputError("option --" + name + " does not combine with --model " + model +
                       (lm ? " in this version (image models only)" : " (it is for --model gpt and llama)"));
  }
}

void check_ranges(const TrainConfig& c) {
  DT_INPUT_CHECK(c.batch_size > 0, "option --batch-size must be > 0, got " << c.batch_size);
  DT_INPUT_CHECK(c.global_batch_size >= 0, "option --global-batch-size must be >= 0");
  DT_INPUT_CHECK(c.epochs >= 1 || c.steps > 0, "option --epochs must be >= 1 (or give --steps), got " << c.epochs);
  DT_INPUT_CHECK(c.steps >= 0, "option --steps must be >= 0, got " << c.steps);
  DT_INPUT_CHECK(c.lr > 0.f, "option --lr must be > 0, got " << c.lr);
  DT_INPUT_CHECK(c.momentum >= 0.f && c.momentum < 1.f, "option --momentum must be in [0, 1), got " << c.momentum);
  DT_INPUT_CHECK(c.weight_decay >= 0.f, "option --weight-decay must be >= 0");
  DT_INPUT_CHECK(c.threads >= 0 && c.threads <= 1024, "option --threads must be in [0, 1024], got " << c.threads);
  DT_INPUT_CHECK(c.trainers >= 1, "option --trainers must be >= 1, got " << c.trainers);
  DT_INPUT_CHECK(c.pbt_every >= 0, "option --pbt-every must be >= 0, got " << c.pbt_every);
  DT_INPUT_CHECK(c.sweep_random >= 0, "option --sweep-random must be >= 0, got " << c.sweep_random);
  DT_INPUT_CHECK(c.sweep_random == 0 || !c.sweep.empty(), "option --sweep-random needs --sweep specs to draw from");
  DT_INPUT_CHECK(
      c.log_every >= 1 || (is_language_model(c.model) && c.log_every == 0),
      "option --log-every must be >= 1 (a language model also takes 0: one line at the end), got " << c.log_every);
  DT_INPUT_CHECK(c.preempt_check_every >= 1 && c.preempt_check_every <= 1000000,
                 "option --preempt-check-every must be in [1, 1000000], got " << c.preempt_check_every);
  parse_signal_list(c.preempt_signals, "preempt-signals");
  DT_INPUT_CHECK(c.trace_steps >= 1 && c.trace_steps <= 10000000,
                 "option --trace-steps must be in [1, 10000000], got " << c.trace_steps);
  DT_INPUT_CHECK(c.dropout >= 0.f && c.dropout < 1.f, "option --dropout must be in [0, 1)");
  DT_INPUT_CHECK(c.progress == "auto" || c.progress == "on" || c.progress == "off",
                 "option --progress must be auto, on or off, got '" << c.progress << "'");
  DT_INPUT_CHECK(c.optimizer == "sgd" || c.optimizer == "adam" || c.optimizer == "adamw" || c.optimizer == "lars" ||
                     c.optimizer == "lamb",
                 "option --optimizer must be sgd, adam, adamw, lars or lamb, got '" << c.optimizer << "'");
  DT_INPUT_CHECK(c.lr_scaling == "none" || c.lr_scaling == "linear",
                 "option --lr-scaling must be none or linear, got '" << c.lr_scaling << "'");
  DT_INPUT_CHECK(c.base_batch_size > 0, "option --base-batch-size must be > 0");
  DT_INPUT_CHECK(c.device == "cpu" || c.device == "cuda" || c.device == "sim",
                 "option --device must be cpu, cuda or sim, got '" << c.device << "'");
  DT_INPUT_CHECK(c.comm == "auto" || c.comm == "nccl" || c.comm == "mpi",
                 "option --comm must be auto, nccl or mpi, got '" << c.comm << "'");
  DT_INPUT_CHECK(
      c.precision == "fp32" || c.precision == "bf16" || c.precision == "fp16" ||
          (c.precision == "tf32" && c.device == "cuda"),
      "option --precision must be fp32, bf16 or fp16 (or tf32 with --device cuda), got '" << c.precision << "'");
  DT_INPUT_CHECK(c.loss_scale_interval >= 1, "option --loss-scale-interval must be >= 1");
  DT_INPUT_CHECK(c.loss_scale_init >= 1.f && c.loss_scale_init <= 16777216.f,
                 "option --loss-scale-init must be in [1, 2^24], got " << c.loss_scale_init);
  DT_INPUT_CHECK(c.accumulate >= 1, "option --accumulate must be >= 1, got " << c.accumulate);
  DT_INPUT_CHECK(c.zero >= 0 && c.zero <= 3, "option --zero must be 0, 1, 2 or 3, got " << c.zero);
  DT_INPUT_CHECK(c.shard_scope == "all" || c.shard_scope == "node",
                 "option --shard-scope must be all or node, got '" << c.shard_scope << "'");
  DT_INPUT_CHECK(c.shard_scope == "all" || c.zero >= 2,
                 "option --shard-scope node needs --zero 2 or 3, got --zero " << c.zero);
  DT_INPUT_CHECK(c.memory_per_rank_mb >= 0, "option --memory-per-rank-mb must be >= 0, got " << c.memory_per_rank_mb);
  DT_INPUT_CHECK(c.zero_gather_dtype == "f32" || c.zero_gather_dtype == "bf16",
                 "option --zero-gather-dtype must be f32 or bf16, got '" << c.zero_gather_dtype << "'");
  const std::string zero = "option --zero " + std::to_string(c.zero);
  DT_INPUT_CHECK(c.zero == 0 || (c.optimizer != "lars" && c.optimizer != "lamb"),
                 zero << " does not combine with --optimizer " << c.optimizer
                      << " (its per-layer trust ratios need whole tensors)");
  DT_INPUT_CHECK(c.zero < 3 || c.prune_sparsity == 0.f,
                 zero << " does not combine with --prune-sparsity (the masks read whole weights)");
  DT_INPUT_CHECK(c.zero < 3 || c.check_replicas == 0,
                 zero << " does not combine with --check-replicas (no rank holds a whole replica)");
  DT_INPUT_CHECK(c.straggler_every >= 0 && c.straggler_threshold > 0,
                 "option --straggler-every must be >= 0 and --straggler-threshold > 0");
  DT_INPUT_CHECK(c.check_replicas >= 0, "option --check-replicas must be >= 0, got " << c.check_replicas);
  DT_INPUT_CHECK(c.desync_check_every >= 0, "option --desync-check-every must be >= 0, got " << c.desync_check_every);
  DT_INPUT_CHECK(c.prune_sparsity >= 0.f && c.prune_sparsity < 1.f,
                 "option --prune-sparsity must be in [0, 1), got " << c.prune_sparsity);
  DT_INPUT_CHECK(c.prune_start >= 0 && c.prune_every >= 1 && (c.prune_end == -1 || c.prune_end >= c.prune_start),
                 "options --prune-start >= 0, --prune-every >= 1 and --prune-end >= --prune-start (or -1) are needed");
  DT_INPUT_CHECK(c.prune_scope == "global" || c.prune_scope == "layer",
                 "option --prune-scope must be global or layer, got '" << c.prune_scope << "'");
  DT_INPUT_CHECK(c.prune_sparsity == 0.f || (c.tp == 1 && c.pp == 1),
                 "option --prune-sparsity does not combine with --" << (c.tp > 1 ? "tp" : "pp")
                                                                    << " in this version (the magnitudes would be "
                                                                       "split over ranks)");
  DT_INPUT_CHECK(c.distill_temperature > 0.f && c.distill_weight >= 0.f && c.distill_weight <= 1.f,
                 "options --distill-temperature must be > 0 and --distill-weight in [0, 1], got "
                     << c.distill_temperature << " and " << c.distill_weight);
  DT_INPUT_CHECK(c.clip_grad_norm >= 0.f, "option --clip-grad-norm must be >= 0");
  DT_INPUT_CHECK(c.augment.crop_padding >= 0 && c.augment.crop_padding <= 64,
                 "option --augment-crop must be in [0, 64]");
  DT_INPUT_CHECK(c.augment.rotate_deg >= 0.f && c.augment.rotate_deg <= 180.f,
                 "option --augment-rotate must be in [0, 180]");
  DT_INPUT_CHECK(c.keep_checkpoints >= 1, "option --keep-checkpoints must be >= 1");
  DT_INPUT_CHECK(c.checkpoint_timeout >= 0, "option --checkpoint-timeout must be >= 0 (0: without limit)");
  DT_INPUT_CHECK(c.bucket_mb > 0, "option --bucket-mb must be > 0");
  DT_INPUT_CHECK(c.allreduce.empty() || c.allreduce == "auto" || c.allreduce == "mpi" || c.allreduce == "shm" ||
                     c.allreduce == "hier",
                 "option --allreduce must be auto, mpi, shm or hier, got '" << c.allreduce << "'");
  DT_INPUT_CHECK(c.synthetic || !c.data.empty() || !c.sweep.empty(),  // a sweep may give each its config
                 "no training data: give --data DIR (or --synthetic)");
  DT_INPUT_CHECK(c.synthetic_shape.size() == 3 || c.synthetic_shape.size() == 1,
                 "option --synthetic-shape needs C,H,W (or one size for flat inputs)");
  for (auto [name, v] : {std::pair<const char*, int64_t>{"layers", c.layers},
                         {"heads", c.heads},
                         {"width", c.width},
                         {"context", c.context},
                         {"tp", c.tp},
                         {"pp", c.pp}})
    DT_INPUT_CHECK(v >= 1, "option --" << name << " must be >= 1, got " << v);
  DT_INPUT_CHECK(c.vocab >= 0, "option --vocab must be >= 0 (0: the token files' vocabulary), got " << c.vocab);
  DT_INPUT_CHECK(c.kv_heads >= 0 && (c.kv_heads == 0 || c.heads % c.kv_heads == 0),
                 "option --kv-heads must divide --heads " << c.heads << " (0: as many), got " << c.kv_heads);
  DT_INPUT_CHECK(c.mlp_width >= 0, "option --mlp-width must be >= 0 (0: the model's default), got " << c.mlp_width);
  DT_INPUT_CHECK(c.rope_base > 1.f, "option --rope-base must be > 1, got " << c.rope_base);
  DT_INPUT_CHECK(c.lora_rank >= 0 && c.lora_alpha > 0.f, "options --lora-rank must be >= 0 and --lora-alpha > 0");
  DT_INPUT_CHECK(c.lora_rank == 0 || c.freeze.empty(),
                 "option --freeze does not combine with --lora-rank (LoRA freezes every weight but its adapters)");
  DT_INPUT_CHECK(c.seq_len >= 0 && c.eval_every >= 0 && c.eval_batches >= 0 && c.micro_batches >= 0,
                 "options --seq-len, --eval-every, --eval-batches and --micro-batches must be >= 0");
  DT_INPUT_CHECK(c.schedule == "1f1b" || c.schedule == "gpipe",
                 "option --schedule must be 1f1b or gpipe, got '" << c.schedule << "'");
}

}  // namespace

TrainConfig model_defaults(const std::string& model) {
  TrainConfig d;
  if (is_language_model(model)) {  // AdamW with GPT-2's beta2, cosine to 1e-4 after a warm-up, decay and clipping
    d.batch_size = 8;
    d.steps = 1000;
    d.lr = 1e-3f;
    d.min_lr = 1e-4f;
    d.warmup_steps = 100;
    d.weight_decay = 0.1f;
    d.beta2 = 0.95f;
    d.clip_grad_norm = 1.f;
    d.log_every = 20;
    d.optimizer = "adamw";
  }
  d.model = model;
  return d;
}

namespace {

// A relative path of a config file is relative to the file when it does not name a file from here
// but does from there. Without throwing: a path the system cannot look up (a name too long) stays
// as given, and opening it later names it.
std::string relative_to_config(const std::string& p, const std::string& config_file) {
  const std::filesystem::path base = std::filesystem::path(config_file).parent_path();
  std::error_code ec;
  if (!p.empty() && std::filesystem::path(p).is_relative() && !std::filesystem::exists(p, ec) &&
      std::filesystem::exists(base / p, ec))
    return (base / p).string();
  return p;
}

}  // namespace

bool parse_train_config(int argc, char** argv, TrainConfig& c) {
  const std::string usage = "usage: dtrain train --config FILE [options]";
  // Pass 1 finds the model (from the command line or the config file): its defaults are those of
  // pass 2, which parses everything again and prints them under --help.
  std::string model;
  {
    TrainConfig scratch;
    TrainOptions o(scratch, scratch);
    po::variables_map vm;
    parse_options(argc, argv, o.all(), usage, vm, true, false);
    model = scratch.model;
    // A language model's file makes the run a language model's, with its defaults and options.
    if (!scratch.model_file.empty()) {
      const std::string where = vm.count("config")
                                    ? relative_to_config(scratch.model_file, vm["config"].as<std::string>())
                                    : scratch.model_file;
      if (const auto lm = nn::language_model_shape(nn::read_model_file(where), where))
        model = lm->llama() ? "llama" : "gpt";
    }
  }
  c = model_defaults(model);
  const TrainConfig def = c;
  TrainOptions o(c, def);
  po::variables_map vm;
  if (!parse_options(argc, argv, o.all(), usage, vm, true)) return false;
  if (vm.count("config")) c.config_file = vm["config"].as<std::string>();
  c.synthetic_shape = parse_dims(o.synthetic_shape, "synthetic-shape");
  c.hidden = parse_dims(o.hidden, "hidden");
  DT_INPUT_CHECK(c.model == "mlp" || c.model == "simple_cnn" || c.model == "resnet20" || is_language_model(c.model),
                 "option --model must be mlp, simple_cnn, resnet20, gpt or llama, got '" << c.model << "'");
  refuse_options_of_other_models(vm, o, c.model);
  for (const char* name :
       {"model", "hidden", "dropout", "layers", "heads", "width", "context", "kv-heads", "mlp-width", "rope-base"})
    DT_INPUT_CHECK(c.model_file.empty() || !vm.count(name) || vm[name].defaulted(),
                   "option --" << name << " does not combine with --model-file (the file describes the whole model)");
  if (c.zero1) {
    DT_INPUT_CHECK(vm["zero"].defaulted() || c.zero == 1,
                   "option --zero1 true is --zero 1; it does not combine with --zero " << c.zero);
    c.zero = 1;
  }
  check_ranges(c);
  // Relative data paths in a config file are relative to the file, so a job runs from any directory.
  if (!c.config_file.empty()) {
    auto rebase = [&](std::string& p, const char* key) {
      if (!vm[key].defaulted()) p = relative_to_config(p, c.config_file);
    };
    rebase(c.data, "data");
    rebase(c.test_data, "test-data");
    rebase(c.model_file, "model-file");
  }
  return true;
}

std::string config_ini(const TrainConfig& cfg) {
  TrainConfig c = cfg;
  TrainOptions o(c, model_defaults(c.model));
  return "# dtrain train --config FILE: the effective configuration of --model " + c.model + "\n" + o.ini(c.model);
}

}  // namespace dtrain::train

#include "dtrain/train/config.h"

#include <boost/program_options.hpp>
#include <filesystem>
#include <sstream>

#include "dtrain/core/error.h"
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

}  // namespace

bool parse_train_config(int argc, char** argv, TrainConfig& c) {
  TrainConfig def;
  std::string synthetic_shape = join_dims(def.synthetic_shape), hidden = join_dims(def.hidden);
  po::options_description opts("Job options (also valid as keys in the config file)");
  // clang-format off
  opts.add_options()
    ("data", po::value<std::string>(&c.data), "training data: a directory of HDF5 shards (dtrain convert)")
    ("test-data", po::value<std::string>(&c.test_data), "test data evaluated after each epoch (directory of shards)")
    ("synthetic", po::bool_switch(&c.synthetic), "train on random batches of the model's input shape; reads no data")
    ("synthetic-shape", po::value<std::string>(&synthetic_shape)->default_value(synthetic_shape), "per-sample shape C,H,W for --synthetic")
    ("synthetic-classes", po::value<int64_t>(&c.synthetic_classes)->default_value(def.synthetic_classes), "classes for --synthetic")
    ("normalize", po::value<bool>(&c.normalize)->default_value(def.normalize), "normalise inputs by the training set's per-channel mean/std")
    ("augment-crop", po::value<int>(&c.augment.crop_padding)->default_value(0), "random crop after zero padding by this many pixels (0: off)")
    ("augment-flip", po::value<bool>(&c.augment.hflip)->default_value(false), "random horizontal flip")
    ("augment-rotate", po::value<float>(&c.augment.rotate_deg)->default_value(0.f), "random rotation within +-degrees (0: off)")
    ("loader-threads", po::value<int>(&c.loader_threads)->default_value(-1), "loader threads per rank (-1: DTRAIN_LOADER_THREADS)")
    ("prefetch", po::value<int>(&c.prefetch)->default_value(-1), "batches prepared ahead (-1: DTRAIN_PREFETCH)")
    ("model", po::value<std::string>(&c.model)->default_value(def.model), "model: mlp, simple_cnn, resnet20")
    ("hidden", po::value<std::string>(&hidden)->default_value(hidden), "MLP hidden widths, comma separated")
    ("dropout", po::value<float>(&c.dropout)->default_value(def.dropout), "MLP dropout probability")
    ("epochs", po::value<int64_t>(&c.epochs)->default_value(def.epochs), "passes over the training data")
    ("steps", po::value<int64_t>(&c.steps)->default_value(def.steps), "stop after this many steps (0: run all epochs)")
    ("batch-size", po::value<int64_t>(&c.batch_size)->default_value(def.batch_size), "samples per step (micro-step with --accumulate) per rank")
    ("global-batch-size", po::value<int64_t>(&c.global_batch_size)->default_value(0), "samples per optimizer step over all ranks and micro-steps (0: batch-size x ranks x accumulate); must divide evenly")
    ("drop-last", po::value<bool>(&c.drop_last)->default_value(def.drop_last), "drop the last partial batch of each epoch")
    ("optimizer", po::value<std::string>(&c.optimizer)->default_value(def.optimizer), "sgd, adam, adamw, lars or lamb")
    ("lars-eta", po::value<float>(&c.lars_eta)->default_value(def.lars_eta), "LARS trust coefficient")
    ("lr-scaling", po::value<std::string>(&c.lr_scaling)->default_value(def.lr_scaling), "none, or linear: lr x global batch / --base-batch-size")
    ("base-batch-size", po::value<int64_t>(&c.base_batch_size)->default_value(def.base_batch_size), "the global batch --lr is given for (with --lr-scaling linear)")
    ("lr", po::value<float>(&c.lr)->default_value(def.lr), "base learning rate")
    ("momentum", po::value<float>(&c.momentum)->default_value(def.momentum), "SGD momentum")
    ("nesterov", po::value<bool>(&c.nesterov)->default_value(def.nesterov), "Nesterov momentum")
    ("weight-decay", po::value<float>(&c.weight_decay)->default_value(def.weight_decay), "weight decay (decoupled for adamw)")
    ("beta1", po::value<float>(&c.beta1)->default_value(def.beta1), "Adam beta1")
    ("beta2", po::value<float>(&c.beta2)->default_value(def.beta2), "Adam beta2")
    ("eps", po::value<float>(&c.eps)->default_value(def.eps), "Adam epsilon")
    ("lr-schedule", po::value<std::string>(&c.lr_schedule)->default_value(def.lr_schedule), "constant, step or cosine (per step, to zero at the end)")
    ("warmup-steps", po::value<int64_t>(&c.warmup_steps)->default_value(0), "linear learning-rate warm-up steps")
    ("lr-step-size", po::value<int64_t>(&c.lr_step_size)->default_value(def.lr_step_size), "step schedule: steps between decays")
    ("lr-gamma", po::value<float>(&c.lr_gamma)->default_value(def.lr_gamma), "step schedule: decay factor")
    ("min-lr", po::value<float>(&c.min_lr)->default_value(0.f), "cosine schedule: final learning rate")
    ("clip-grad-norm", po::value<float>(&c.clip_grad_norm)->default_value(0.f), "clip the global gradient norm to this (0: off)")
    ("precision", po::value<std::string>(&c.precision)->default_value(def.precision), "fp32, bf16 or fp16 (GEMM/conv inputs; fp32 accumulation and master weights; fp16 with dynamic loss scaling); tf32 on a GPU")
    ("device", po::value<std::string>(&c.device)->default_value(def.device), "cpu or cuda (one GPU per rank)")
    ("loss-scale-interval", po::value<int64_t>(&c.loss_scale_interval)->default_value(def.loss_scale_interval), "fp16: finite steps in a row before the loss scale doubles")
    ("loss-scale-init", po::value<float>(&c.loss_scale_init)->default_value(def.loss_scale_init), "fp16: the first loss scale (halved on every step with inf/NaN gradients)")
    ("threads", po::value<int>(&c.threads)->default_value(0), "compute threads per rank (0: node cores / ranks on the node)")
    ("seed", po::value<uint64_t>(&c.seed)->default_value(def.seed), "seed for initialisation, shuffling, augmentation, dropout")
    ("log-every", po::value<int64_t>(&c.log_every)->default_value(def.log_every), "steps between metrics lines")
    ("progress", po::value<std::string>(&c.progress)->default_value(def.progress), "progress bar on rank 0: auto, on, off")
    ("metrics", po::value<std::string>(&c.metrics), "JSON-lines metrics file (written by rank 0)")
    ("checkpoint-dir", po::value<std::string>(&c.checkpoint_dir), "write HDF5 checkpoints here")
    ("checkpoint-every", po::value<int64_t>(&c.checkpoint_every)->default_value(0), "steps between checkpoints (0: each epoch end)")
    ("keep-checkpoints", po::value<int>(&c.keep_checkpoints)->default_value(def.keep_checkpoints), "checkpoints kept in --checkpoint-dir")
    ("resume", po::value<std::string>(&c.resume), "resume from this checkpoint file (or the newest in this directory)")
    ("preempt-signals", po::value<std::string>(&c.preempt_signals)->default_value(def.preempt_signals), "signals that checkpoint at the next step and exit with code 42: comma list of TERM, USR1, USR2, INT, HUP, CONT, or none")
    ("preempt-check-every", po::value<int64_t>(&c.preempt_check_every)->default_value(def.preempt_check_every), "steps between the ranks' agreement on a received preemption signal")
    ("trace", po::value<std::string>(&c.trace), "write a Chrome trace (Perfetto) of each rank's data wait, compute, communication wait and optimizer to this JSON file")
    ("trace-steps", po::value<int64_t>(&c.trace_steps)->default_value(def.trace_steps), "steps recorded by --trace, from the first")
    ("eval", po::value<bool>(&c.eval_each_epoch)->default_value(true), "evaluate on --test-data after each epoch")
    ("bucket-mb", po::value<double>(&c.bucket_mb)->default_value(def.bucket_mb), "data-parallel gradient bucket size (MiB)")
    ("overlap", po::value<bool>(&c.overlap)->default_value(true), "start each bucket's allreduce while backward runs")
    ("compression", po::value<std::string>(&c.compression)->default_value(def.compression), "gradient compression: none, fp16, bf16, topk:RATIO, powersgd:RANK, onebit, qsgd:LEVELS")
    ("compression-warmup", po::value<int64_t>(&c.compression_warmup)->default_value(-1), "compression warm-up steps (-1: one epoch, 0: none): top-k's kept fraction falls from 25 % to the target; PowerSGD sends uncompressed gradients until then")
    ("compression-on-engine", po::value<bool>(&c.compression_on_engine)->default_value(false), "top-k through the compute engine's kernels (the path GPU buckets always take: CUB and NCCL) instead of the communication layer's compressor, also on the CPU")
    ("momentum-correction", po::value<bool>(&c.momentum_correction)->default_value(def.momentum_correction), "top-k with SGD momentum: accumulate momentum, not raw gradients, in the compressor (Deep Gradient Compression); the optimizer then runs without momentum")
    ("accumulate", po::value<int64_t>(&c.accumulate)->default_value(1), "micro-batches per optimizer step (gradient accumulation)")
    ("zero1", po::value<bool>(&c.zero1)->default_value(false), "ZeRO stage 1: shard optimizer state over the data-parallel ranks")
    ("sync-batchnorm", po::value<bool>(&c.sync_batchnorm)->default_value(false), "batch statistics over all data-parallel ranks");
  // clang-format on
  po::variables_map vm;
  if (!parse_options(argc, argv, opts, "usage: dtrain train --config FILE [options]", vm, true)) return false;
  if (vm.count("config")) c.config_file = vm["config"].as<std::string>();
  c.synthetic_shape = parse_dims(synthetic_shape, "synthetic-shape");
  c.hidden = parse_dims(hidden, "hidden");

  // Ranges, each naming its option.
  DT_INPUT_CHECK(c.batch_size > 0, "option --batch-size must be > 0, got " << c.batch_size);
  DT_INPUT_CHECK(c.global_batch_size >= 0, "option --global-batch-size must be >= 0");
  DT_INPUT_CHECK(c.epochs >= 1 || c.steps > 0, "option --epochs must be >= 1 (or give --steps), got " << c.epochs);
  DT_INPUT_CHECK(c.steps >= 0, "option --steps must be >= 0, got " << c.steps);
  DT_INPUT_CHECK(c.lr > 0.f, "option --lr must be > 0, got " << c.lr);
  DT_INPUT_CHECK(c.momentum >= 0.f && c.momentum < 1.f, "option --momentum must be in [0, 1), got " << c.momentum);
  DT_INPUT_CHECK(c.weight_decay >= 0.f, "option --weight-decay must be >= 0");
  DT_INPUT_CHECK(c.threads >= 0 && c.threads <= 1024, "option --threads must be in [0, 1024], got " << c.threads);
  DT_INPUT_CHECK(c.log_every >= 1, "option --log-every must be >= 1");
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
  DT_INPUT_CHECK(c.device == "cpu" || c.device == "cuda",
                 "option --device must be cpu or cuda, got '" << c.device << "'");
  DT_INPUT_CHECK(
      c.precision == "fp32" || c.precision == "bf16" || c.precision == "fp16" ||
          (c.precision == "tf32" && c.device == "cuda"),
      "option --precision must be fp32, bf16 or fp16 (or tf32 with --device cuda), got '" << c.precision << "'");
  DT_INPUT_CHECK(c.loss_scale_interval >= 1, "option --loss-scale-interval must be >= 1");
  DT_INPUT_CHECK(c.loss_scale_init >= 1.f && c.loss_scale_init <= 16777216.f,
                 "option --loss-scale-init must be in [1, 2^24], got " << c.loss_scale_init);
  DT_INPUT_CHECK(c.accumulate >= 1, "option --accumulate must be >= 1, got " << c.accumulate);
  DT_INPUT_CHECK(!c.zero1 || (c.optimizer != "lars" && c.optimizer != "lamb"),
                 "option --zero1 does not combine with --optimizer "
                     << c.optimizer << " (its per-layer trust ratios need whole tensors)");
  DT_INPUT_CHECK(c.clip_grad_norm >= 0.f, "option --clip-grad-norm must be >= 0");
  DT_INPUT_CHECK(c.augment.crop_padding >= 0 && c.augment.crop_padding <= 64,
                 "option --augment-crop must be in [0, 64]");
  DT_INPUT_CHECK(c.augment.rotate_deg >= 0.f && c.augment.rotate_deg <= 180.f,
                 "option --augment-rotate must be in [0, 180]");
  DT_INPUT_CHECK(c.keep_checkpoints >= 1, "option --keep-checkpoints must be >= 1");
  DT_INPUT_CHECK(c.bucket_mb > 0, "option --bucket-mb must be > 0");
  DT_INPUT_CHECK(c.synthetic || !c.data.empty(), "no training data: give --data DIR (or --synthetic)");
  DT_INPUT_CHECK(c.synthetic_shape.size() == 3 || c.synthetic_shape.size() == 1,
                 "option --synthetic-shape needs C,H,W (or one size for flat inputs)");
  // Relative data paths in a config file are relative to the file, so a job runs from any directory.
  if (!c.config_file.empty()) {
    std::filesystem::path base = std::filesystem::path(c.config_file).parent_path();
    auto rebase = [&](std::string& p, const char* key) {
      if (!p.empty() && !vm[key].defaulted() && std::filesystem::path(p).is_relative() && !std::filesystem::exists(p) &&
          std::filesystem::exists(base / p))
        p = (base / p).string();
    };
    rebase(c.data, "data");
    rebase(c.test_data, "test-data");
  }
  return true;
}

}  // namespace dtrain::train

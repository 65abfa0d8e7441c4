#include "dtrain/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/nccl.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif
#include "dtrain/core/timer.h"
#include "dtrain/optim/large_batch.h"
#include "dtrain/parallel/sync_batchnorm.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/step_support.h"
#include "dtrain/train/trace.h"

namespace fs = std::filesystem;

namespace dtrain::train {

double process_age_s() {
  std::ifstream stat("/proc/self/stat"), up("/proc/uptime");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  double uptime = 0;
  up >> uptime;
  size_t close = s.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 22) return uptime - std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  return 0;
}

static std::string fixed(double v, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << v;
  return o.str();
}

Trainer::Trainer(const TrainConfig& cfg, comm::Runtime& rt, comm::Communicator* dp)
    : cfg_(cfg), rt_(rt), comm_(dp ? *dp : rt.world()) {
  rank_ = comm_.rank();
  world_ = comm_.size();
  progress_ = std::make_unique<Progress>(cfg_.progress, rank_ == 0);
  comm::agree_on_inputs(comm_, [this] { setup(); });
  comm::agree_on_inputs(comm_, [this] { setup_exchange(); });
}

void Trainer::setup() {
  const comm::Topology& topo = rt_.topology();

  // Threads: by default the node's cores shared among the ranks on it.
  int threads = cfg_.threads > 0 ? cfg_.threads : std::max(1, topo.threads_per_rank);
  cpu_engine().set_threads(threads);
  if (cfg_.device == "cuda") {
    DT_INPUT_CHECK(enable_cuda() > 0, "option --device cuda: no GPU is visible, or this dtrain was built without CUDA");
    // One GPU per rank: the bootstrap bound local rank r to GPU r % count; NCCL refuses two ranks
    // of a communicator on one GPU, so a node must have as many GPUs as ranks.
    DT_INPUT_CHECK(world_ == 1 || topo.local_size <= topo.cuda_device_count,
                   "option --device cuda: " << topo.local_size << " ranks on host " << topo.host << " share "
                                            << topo.cuda_device_count
                                            << " GPU(s); data parallel on GPUs needs one GPU per rank");
    DT_INPUT_CHECK(world_ == 1 || comm::nccl_compiled() || topo.cuda_aware_mpi,
                   "option --device cuda with " << world_
                                                << " ranks: this dtrain was built without NCCL and the MPI "
                                                   "library is not CUDA-aware, so gradients cannot leave the GPU");
    DT_INPUT_CHECK(!cfg_.zero1 && (cfg_.compression == "none" || cfg_.compression.rfind("topk", 0) == 0) &&
                       !cfg_.sync_batchnorm,
                   "option --device cuda: --zero1, --sync-batchnorm and --compression other than topk run on the "
                   "CPU engine only in this version");
    device_ = Device::cuda(std::max(0, topo.cuda_device));
  }
  if (cfg_.precision != "tf32") cpu_engine().set_math_precision(math_precision_from_name(cfg_.precision));
  engine_for(device_).set_math_precision(math_precision_from_name(cfg_.precision));
  scaler_ = make_loss_scaler(cfg_.precision, cfg_.loss_scale_interval, cfg_.loss_scale_init);
  std::string warn = topo.binding_warning(threads);
  if (!warn.empty() && topo.local_rank == 0)
    std::fprintf(stderr, "dtrain: warning (rank %d): %s\n", rank_, warn.c_str());

  // Batch: per rank, or the global batch split evenly.
  // Batch: --batch-size is each rank's micro-batch; --global-batch-size is the samples of one
  // optimizer step over all ranks and accumulation micro-steps, and must split evenly.
  batch_ = cfg_.batch_size;
  if (cfg_.global_batch_size > 0) {
    int64_t parts = world_ * cfg_.accumulate;
    DT_INPUT_CHECK(cfg_.global_batch_size % parts == 0,
                   "option --global-batch-size " << cfg_.global_batch_size << " does not divide evenly over " << world_
                                                 << " ranks x " << cfg_.accumulate << " micro-steps");
    batch_ = cfg_.global_batch_size / parts;
  }

  // Data.
  Shape input;
  int64_t classes;
  if (cfg_.synthetic) {
    input = Shape(cfg_.synthetic_shape.begin(), cfg_.synthetic_shape.end());
    classes = cfg_.synthetic_classes;
    DT_INPUT_CHECK(classes >= 2, "option --synthetic-classes must be >= 2");
  } else {
    train_ds_ = std::make_shared<data::ShardedHdf5Dataset>(cfg_.data);
    input = train_ds_->info().sample_shape;
    classes = train_ds_->info().num_classes;
    if (!cfg_.test_data.empty()) {
      test_ds_ = std::make_shared<data::ShardedHdf5Dataset>(cfg_.test_data);
      DT_INPUT_CHECK(test_ds_->info().sample_shape == input,
                     "test data '" << cfg_.test_data << "' has samples of shape "
                                   << shape_str(test_ds_->info().sample_shape) << " but training data '" << cfg_.data
                                   << "' has " << shape_str(input));
    }
    data::LoaderOptions lo;
    lo.batch_size = batch_;
    lo.shuffle = true;
    lo.drop_last = cfg_.drop_last;
    lo.seed = cfg_.seed;
    lo.threads = cfg_.loader_threads;
    lo.prefetch = cfg_.prefetch;
    lo.normalize = cfg_.normalize;
    lo.augment = cfg_.augment;
    lo.rank = rank_;
    lo.world = world_;
    loader_ = std::make_unique<data::DataLoader>(train_ds_, lo);
  }

  spec_ = nn::ModelSpec{cfg_.model, input, classes, cfg_.hidden, cfg_.dropout, cfg_.seed};
  model_ = nn::make_model(spec_);
  model_->set_needs_input_grad(false);  // nothing consumes d(input data)
  model_->to(device_);                  // drawn on the host, trained where the engine is
}

// The rest of the constructor's work, after the ranks agreed on the inputs: it creates the NCCL
// communicator, which every rank must reach.
void Trainer::setup_exchange() {
  if (cfg_.sync_batchnorm) parallel::convert_sync_batchnorm(*model_, comm_);
  if (world_ > 1 || cfg_.zero1 || cfg_.compression != "none") {
    parallel::DataParallelOptions dpo;
    dpo.bucket_bytes = static_cast<int64_t>(cfg_.bucket_mb * 1048576.0);
    dpo.zero1 = cfg_.zero1;
    dpo.overlap = cfg_.overlap;
    dpo.compression = cfg_.compression;
    dpo.seed = derive_seed(cfg_.seed, 77);
    dpo.momentum_correction = topk_momentum_correction();
    dpo.engine_topk = cfg_.compression_on_engine;
    dpo.device_stream = compute_stream_of(device_);
    if (world_ > 1) nccl_ = gpu_gradient_communicator(comm_, device_, "dp-nccl");
    dp_ = std::make_unique<parallel::DataParallel>(*model_, nccl_ ? *nccl_ : comm_, dpo);
  }
  build_optimizer();

  // An optimizer step takes `accumulate` micro-batches; a partial group at an epoch's end is dropped.
  int64_t batches = loader_ ? loader_->batches_per_epoch() : std::max<int64_t>(cfg_.steps, 100) * cfg_.accumulate;
  steps_per_epoch_ = batches / cfg_.accumulate;
  if (dp_) {
    int64_t warmup = cfg_.compression_warmup >= 0 ? cfg_.compression_warmup : batches / cfg_.accumulate;
    dp_->set_compression_warmup(warmup);
  }
  DT_INPUT_CHECK(steps_per_epoch_ > 0,
                 "option --accumulate " << cfg_.accumulate << " exceeds the " << batches << " batches of an epoch");
  epochs_ = cfg_.epochs;
  total_steps_ = steps_per_epoch_ * epochs_;
  if (cfg_.steps > 0 && (cfg_.steps < total_steps_ || cfg_.synthetic)) {
    total_steps_ = cfg_.steps;
    epochs_ = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  }
  optim::ScheduleOptions so;
  so.kind = cfg_.lr_schedule;
  so.base_lr = cfg_.lr;
  if (cfg_.lr_scaling == "linear")  // Goyal et al.: lr grows with the global batch (pair with warm-up)
    so.base_lr =
        cfg_.lr * static_cast<float>(batch_ * world_ * cfg_.accumulate) / static_cast<float>(cfg_.base_batch_size);
  so.total_steps = total_steps_;
  so.step_size = cfg_.lr_step_size;
  so.gamma = cfg_.lr_gamma;
  so.min_lr = cfg_.min_lr;
  so.warmup_steps = cfg_.warmup_steps;
  sched_ = std::make_unique<optim::LrSchedule>(so);
  if (rank_ == 0 && !cfg_.metrics.empty())
    metrics_ = std::make_unique<MetricsWriter>(cfg_.metrics, !cfg_.resume.empty());
  provenance_ = run_provenance(std::to_string(world_) + " rank(s): dp " + std::to_string(world_), config_ini(cfg_));
  if (metrics_) metrics_->write(provenance_);
}

Trainer::~Trainer() = default;

// The momentum top-k compression takes over from SGD (Deep Gradient Compression's momentum
// correction), or 0 where it does not apply: another compressor or optimizer, Nesterov momentum,
// or --momentum-correction false.
float Trainer::topk_momentum_correction() const {
  bool topk = cfg_.compression.rfind("topk", 0) == 0;
  if (!topk || !cfg_.momentum_correction || cfg_.optimizer != "sgd" || cfg_.nesterov) return 0.f;
  return cfg_.momentum;
}

void Trainer::build_optimizer() {
  auto params = dp_ ? dp_->optimizer_params() : model_->parameters();
  if (cfg_.optimizer == "lars") {
    opt_ = std::make_unique<optim::LARS>(params, optim::LarsOptions{cfg_.momentum, cfg_.weight_decay, cfg_.lars_eta});
  } else if (cfg_.optimizer == "lamb") {
    opt_ =
        std::make_unique<optim::LAMB>(params, optim::LambOptions{cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay});
  } else if (cfg_.optimizer == "sgd") {
    optim::SgdOptions o;
    // With top-k's momentum correction the compressor keeps the momentum; what arrives here is
    // already the momentum update (weight decay is then added without momentum).
    o.momentum = topk_momentum_correction() > 0 ? 0.f : cfg_.momentum;
    o.weight_decay = cfg_.weight_decay;
    o.nesterov = cfg_.nesterov;
    opt_ = std::make_unique<optim::SGD>(params, o);
  } else {
    optim::AdamOptions o;
    o.beta1 = cfg_.beta1;
    o.beta2 = cfg_.beta2;
    o.eps = cfg_.eps;
    o.weight_decay = cfg_.weight_decay;
    o.decoupled = cfg_.optimizer == "adamw";
    opt_ = std::make_unique<optim::Adam>(params, o);
  }
}

void Trainer::say(const std::string& s) { progress_->line(s); }

// ------------------------------------------------------------------ checkpoints
void Trainer::save(int64_t epoch, int64_t batch_in_epoch) {
  if (cfg_.checkpoint_dir.empty()) return;
  // Optimizer state is saved per parameter ("optim/<param>.<state>") whatever the layout; under
  // ZeRO-1 each state is a flat slice per rank, gathered here (a collective) and cut per parameter.
  std::map<std::string, Tensor> optim_state;
  for (const optim::StateTensor& st : opt_->state()) {
    if (dp_ && dp_->zero1()) {
      Tensor full = dp_->gather_flat(*st.value);
      std::string suffix = st.name.substr(st.name.find('.'));  // ".momentum", ".exp_avg", ...
      for (nn::Parameter* p : model_->parameters()) {
        int64_t off = dp_->offset_of(p);
        optim_state[p->name + suffix] = full.slice0(off, off + p->value.numel()).reshape(p->value.shape()).clone();
      }
    } else {
      optim_state[st.name] = to_host(*st.value);
    }
  }
  const fs::path path = checkpoint_file(cfg_.checkpoint_dir, step_);
  // Each rank's gradient compression state first, so a checkpoint that exists has all its parts.
  const bool parts = write_compression_parts(path.string(), dp_.get(), &comm_, step_, cfg_.compression);
  // Rank 0 writes the checkpoint (data parallel: every rank holds the same parameters); the
  // agreement doubles as the barrier that keeps every rank behind a checkpoint that may fail.
  comm::agree_on_inputs(comm_, [&] { write_main(path, optim_state, !parts, epoch, batch_in_epoch); });
}

void Trainer::write_main(const fs::path& path, std::map<std::string, Tensor>& optim_state, bool no_parts,
                         int64_t epoch, int64_t batch_in_epoch) {
  if (rank_ == 0) {
    CheckpointState s;
    for (nn::Parameter* p : model_->parameters()) s.tensors["param/" + p->name] = to_host(p->value);
    for (nn::Buffer* b : model_->buffers()) s.tensors["buffer/" + b->name] = to_host(b->value);
    for (auto& [name, t] : optim_state) s.tensors["optim/" + name] = t;
    s.strings["model"] = spec_.name;
    s.strings["provenance"] = to_json(provenance_);
    s.strings["optimizer"] = opt_->kind();
    s.ints["step"] = step_;
    s.ints["optimizer_steps"] = opt_->steps();
    s.ints["epoch"] = epoch;
    s.ints["batch_in_epoch"] = batch_in_epoch;
    s.ints["world_size"] = world_;
    s.ints["per_rank_batch"] = batch_;
    s.ints["accumulate"] = cfg_.accumulate;
    s.ints["compression_ranks"] = no_parts ? 0 : world_;  // ranks with a <checkpoint>.rank<r> part
    s.strings["compression"] = cfg_.compression;
    if (scaler_) {
      s.tensors["meta/loss_scale"] = Tensor::from({1}, {scaler_->scale()});
      s.ints["loss_scale_good_steps"] = scaler_->good_steps();
      s.ints["loss_scale_skipped_steps"] = scaler_->skipped_steps();
    }
    s.ints["classes"] = spec_.classes;
    s.ints["seed"] = static_cast<int64_t>(cfg_.seed);
    s.int_lists["input_shape"] = std::vector<int64_t>(spec_.input.begin(), spec_.input.end());
    s.int_lists["hidden"] = spec_.hidden;
    if (train_ds_) {  // the input normalisation, so `dtrain eval` transforms inputs the same way
      const auto& info = train_ds_->info();
      s.tensors["meta/norm_mean"] = Tensor::from({static_cast<int64_t>(info.mean.size())}, info.mean);
      s.tensors["meta/norm_std"] = Tensor::from({static_cast<int64_t>(info.std.size())}, info.std);
    }
    save_checkpoint(path.string(), s);
    prune_checkpoints(cfg_.checkpoint_dir, path.string(), cfg_.keep_checkpoints);
    if (!progress_->bar()) say("checkpoint " + path.string());
  }
}

void Trainer::restore(const std::string& where, int64_t& epoch, int64_t& skip) {
  std::string path = resolve_checkpoint(where);
  CheckpointState s = load_checkpoint(path);
  auto need = [&](const std::string& key) -> int64_t {
    auto it = s.ints.find(key);
    DT_INPUT_CHECK(it != s.ints.end(), "checkpoint '" << path << "' has no '" << key << "'");
    return it->second;
  };
  DT_INPUT_CHECK(s.strings["model"] == spec_.name,
                 "checkpoint '" << path << "' holds model '" << s.strings["model"] << "', not --model " << spec_.name);
  std::vector<int64_t> shape = s.int_lists["input_shape"];
  DT_INPUT_CHECK(Shape(shape.begin(), shape.end()) == spec_.input,
                 "checkpoint '" << path << "' was trained on inputs " << shape_str(Shape(shape.begin(), shape.end()))
                                << " but the data has " << shape_str(spec_.input));
  DT_INPUT_CHECK(s.strings["optimizer"] == opt_->kind(), "checkpoint '" << path << "' used optimizer "
                                                                        << s.strings["optimizer"]
                                                                        << ", not --optimizer " << opt_->kind());
  auto load = [&](const std::string& key, Tensor& dst) {
    auto it = s.tensors.find(key);
    DT_INPUT_CHECK(it != s.tensors.end(), "checkpoint '" << path << "' has no tensor " << key);
    DT_INPUT_CHECK(it->second.shape() == dst.shape(), "checkpoint '" << path << "': " << key << " has shape "
                                                                     << shape_str(it->second.shape())
                                                                     << ", the model needs " << shape_str(dst.shape()));
    copy_any(it->second, dst);
  };
  for (nn::Parameter* p : model_->parameters()) load("param/" + p->name, p->value);
  for (nn::Buffer* b : model_->buffers()) load("buffer/" + b->name, b->value);
  for (const optim::StateTensor& st : opt_->state()) {
    if (dp_ && dp_->zero1()) {  // rebuild the flat vector from the per-parameter tensors, keep our slice
      Tensor full = Tensor::zeros({dp_->flat_numel()});
      std::string suffix = st.name.substr(st.name.find('.'));
      for (nn::Parameter* p : model_->parameters()) {
        int64_t off = dp_->offset_of(p);
        Tensor view = full.slice0(off, off + p->value.numel()).reshape(p->value.shape());
        load("optim/" + p->name + suffix, view);
      }
      st.value->copy_from(dp_->own_slice(full));
    } else {
      load("optim/" + st.name, *st.value);
    }
  }
  if (scaler_ && s.tensors.count("meta/loss_scale"))
    scaler_->set_state(s.tensors["meta/loss_scale"].f32()[0], s.ints["loss_scale_good_steps"],
                       s.ints["loss_scale_skipped_steps"]);
  step_ = need("step");
  // Each rank's gradient compression state, from its part of the checkpoint, when the run compresses
  // as the checkpointed one did on as many ranks; otherwise error feedback restarts from zero.
  if (std::string note = load_compression_part(s, path, dp_.get(), rank_, world_, cfg_.compression, true);
      !note.empty())
    say(note);
  opt_->set_steps(need("optimizer_steps"));
  epoch = need("epoch");
  skip = need("batch_in_epoch");
  const int64_t then_world = need("world_size");
  resume_position(then_world, need("per_rank_batch") * then_world * need("accumulate"), skip);
  if (skip >= steps_per_epoch_) {
    ++epoch;
    skip = 0;
  }
  if (std::string changed = resume_changes(s.strings["provenance"], config_ini(cfg_)); !changed.empty()) say(changed);
  say("resumed from " + path + " at step " + std::to_string(step_) + " (epoch " + std::to_string(epoch + 1) + ")");
}

// Resuming in another layout. Every layout walks the same shuffled order of an epoch, rank r taking
// every world-th sample, so a step of global batch G covers the next G samples of that order
// whatever the rank count: `skip` (steps done in the epoch, at the checkpoint's global batch
// `then_global`) becomes the step of this layout at the same sample, and the log says what is
// exact and what is not.
void Trainer::resume_position(int64_t then_world, int64_t then_global, int64_t& skip) {
  const int64_t global = batch_ * world_ * cfg_.accumulate;
  if (then_world == world_ && then_global == global) return;
  const int64_t samples = skip * then_global;
  skip = samples / global;
  std::string line = "resume: " + std::to_string(then_world) + " -> " + std::to_string(world_) + " rank(s), global batch " +
                     std::to_string(then_global) + " -> " + std::to_string(global) + ": ";
  if (then_global == global) {
    line += "every step sees the samples it would have seen (sums in another order: equal within rounding, not bitwise)";
  } else {
    line += "continues at sample " + std::to_string(skip * global) + " of the epoch";
    if (samples != skip * global) line += " (" + std::to_string(samples - skip * global) + " samples seen again)";
    line += "; steps and the learning-rate schedule count the new global batch";
  }
  bool batchnorm = false;
  for (nn::Buffer* b : model_->buffers()) batchnorm |= b->name.find("running_mean") != std::string::npos;
  if (batchnorm && !cfg_.sync_batchnorm) line += "; BatchNorm statistics come from each rank's own batch";
  say(line);
}

// ------------------------------------------------------------------ evaluation
EvalResult evaluate_model(nn::Module& model, std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                          bool normalize, comm::Communicator* comm, const std::vector<float>& mean,
                          const std::vector<float>& std) {
  int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  model.eval();
  data::LoaderOptions lo;
  lo.batch_size = batch;
  lo.shuffle = false;
  lo.normalize = normalize;
  lo.mean = mean;
  lo.std = std;
  lo.rank = rank;
  lo.world = world;
  data::DataLoader loader(ds, lo);
  // The sampler deals rank r the global positions r, r + world, ...; positions past the end are
  // padding and are not counted.
  int64_t mine = (ds->size() - rank + world - 1) / world;
  nn::SoftmaxCrossEntropy ce;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  const Device device = model.parameters().empty() ? Device::cpu() : model.parameters().front()->value.device();
  nn::update_working_copies(model.parameters(), engine_for(device).math_precision());
  StagedTensor inputs, labels;  // the batches on the model's device
  loader.start_epoch(0);
  data::Batch b;
  // The loss and hits add up on the model's device and are read once at the end (a GPU is not
  // synchronised per batch).
  Tensor stats = zeros_on({kXentStatsFloats}, device);
  while (seen < mine && loader.next(b)) {
    int64_t rows = std::min<int64_t>(b.inputs.size(0), mine - seen);
    ce.accumulate(model.forward(stage_to(b.inputs.slice0(0, rows), device, inputs)),
                  stage_to(b.labels.slice0(0, rows), device, labels), stats);
    seen += rows;
  }
  model.train();
  // One rank's bad label fails every rank (the others would wait in the allreduce below).
  auto read = [&] {
    const XentStats st = xent_stats(to_host(stats));
    DT_INPUT_CHECK(!st.bad_label, "a label of the evaluation data on rank " << rank << " is outside the model's classes");
    loss_sum = st.loss_sum;
    correct = static_cast<int64_t>(st.hits);
  };
  if (comm && world > 1)
    comm::agree_on_inputs(*comm, read);
  else
    read();
  // Sums in f64 words carried as two f32 tensors would lose counts past 2^24; use i64 + f32.
  Tensor counts = Tensor::empty({2}, DType::I64);
  counts.data<int64_t>()[0] = correct;
  counts.data<int64_t>()[1] = seen;
  Tensor loss = Tensor::from({1}, {static_cast<float>(loss_sum)});
  if (world > 1) {
    comm->allreduce(counts, comm::ReduceOp::Sum)->wait();
    comm->allreduce(loss, comm::ReduceOp::Sum)->wait();
  }
  EvalResult r;
  r.samples = counts.data<int64_t>()[1];
  r.loss = loss.f32()[0] / static_cast<double>(std::max<int64_t>(r.samples, 1));
  r.accuracy = static_cast<double>(counts.data<int64_t>()[0]) / static_cast<double>(std::max<int64_t>(r.samples, 1));
  return r;
}

EvalResult Trainer::evaluate(const data::ShardedHdf5Dataset& ds) {
  auto view = std::shared_ptr<const data::ShardedHdf5Dataset>(&ds, [](const data::ShardedHdf5Dataset*) {});
  return evaluate_model(*model_, view, std::max<int64_t>(batch_, 256), cfg_.normalize, world_ > 1 ? &comm_ : nullptr,
                        train_ds_->info().mean, train_ds_->info().std);
}

// ------------------------------------------------------------------ the loop
TrainResult Trainer::run() {
  TrainResult result;
  int64_t start_epoch = 0, skip = 0;
  // A checkpoint part or file one rank cannot read fails every rank alike.
  if (!cfg_.resume.empty()) comm::agree_on_inputs(comm_, [&] { restore(cfg_.resume, start_epoch, skip); });
  if (dp_) dp_->broadcast_state(0);
  PreemptionGuard preemption(parse_signal_list(cfg_.preempt_signals, "preempt-signals"));
  ChromeTrace trace(cfg_.trace, rank_, cfg_.trace_steps);

  if (rank_ == 0) {
    std::ostringstream o;
    o << "dtrain: model " << spec_.name << " (" << model_->parameter_count() << " parameters), "
      << (cfg_.synthetic ? std::string("synthetic data") : "data " + cfg_.data) << ", " << world_ << " rank"
      << (world_ > 1 ? "s" : "") << " x " << cpu_engine().threads() << " thread(s), batch " << batch_ << "/rank"
      << (cfg_.accumulate > 1 ? " x " + std::to_string(cfg_.accumulate) + " micro-steps" : std::string()) << " ("
      << batch_ * world_ * cfg_.accumulate << " global), " << steps_per_epoch_ << " steps/epoch, " << total_steps_
      << " steps, " << opt_->kind() << " lr " << cfg_.lr << " " << cfg_.lr_schedule << ", precision " << cfg_.precision;
    say(o.str());
    if (std::string note = engine_for(device_).precision_note(); !note.empty()) say("precision: " + note);
    // Training state per rank: parameters and gradients whole, optimizer state sharded by ZeRO-1.
    double mib = 1.0 / 1048576.0, state = 0;
    for (const optim::StateTensor& st : opt_->state()) state += static_cast<double>(st.value->nbytes());
    double params = static_cast<double>(model_->parameter_count()) * 4;
    std::ostringstream m;
    m.setf(std::ios::fixed);
    m.precision(2);
    m << "memory per rank: parameters " << params * mib << " MiB, gradients " << params * mib
      << " MiB, optimizer state " << state * mib << " MiB"
      << (cfg_.zero1 ? " (ZeRO-1: 1/" + std::to_string(world_) + " of it)" : std::string())
      << (dp_ ? ", " + std::to_string(dp_->bucket_count()) + " gradient bucket(s), compression " + cfg_.compression
              : std::string())
      << (topk_momentum_correction() > 0 ? " with momentum correction" : "");
    say(m.str());
  }

  // Synthetic batches: a few fixed random batches, cycled (no data path at all).
  std::vector<data::Batch> synthetic;
  if (cfg_.synthetic) {
    Rng rng(derive_seed(cfg_.seed, 1000 + static_cast<uint64_t>(rank_)));
    Shape xs = spec_.input;
    xs.insert(xs.begin(), batch_);
    for (int i = 0; i < 4; ++i) {
      data::Batch b;
      b.inputs = Tensor::empty(xs);
      for (int64_t j = 0; j < b.inputs.numel(); ++j) b.inputs.f32()[j] = rng.normal();
      b.labels = Tensor::empty({batch_}, DType::I32);
      for (int64_t j = 0; j < batch_; ++j) b.labels.data<int32_t>()[j] = static_cast<int32_t>(rng.below(spec_.classes));
      synthetic.push_back(std::move(b));
    }
  }

  nn::SoftmaxCrossEntropy ce;
  int64_t step_mallocs = 0;  // cudaMalloc calls inside the steps after the first two (not evaluation)
  StagedTensor dev_inputs, dev_labels;  // on a GPU: page-locked staging, asynchronous uploads
  // On a GPU with a data loader the micro-batch after this one is read and its upload queued on
  // the engine's copy stream before this one's forward, so the copy runs beside the compute; two
  // staging slots alternate (the loader's position for checkpoints is counted in steps, so a batch
  // read ahead and never used changes nothing).
  struct Slot {
    StagedTensor inputs, labels;
    data::Batch batch;
    bool full = false;
  };
  Slot slots[2];
  int slot_now = 0;
  const bool prefetch = loader_ && !device_.is_cpu();
  auto fill_slot = [&](Slot& s) {
    if (!loader_->next(s.batch)) return false;
    stage_async(s.batch.inputs, device_, s.inputs);
    stage_async(s.batch.labels, device_, s.labels);
    return s.full = true;
  };
  model_->train();
  double run_t0 = 0, run_cpu0 = 0;
  int64_t run_samples = 0;
  // Interval statistics for log lines.
  double iv_loss = 0, iv_wait = 0, iv_comm = 0, iv_t0 = now_s();
  // Per-interval split of the step for the scaling harness's performance model (seconds, this rank).
  double iv_fwd = 0, iv_bwd = 0, iv_opt = 0;
  // Training wall time leaves out evaluation, so time-to-accuracy counts training only.
  const double train_t0 = now_s();
  double eval_total_s = 0;
  int64_t iv_bytes0 = dp_ ? dp_->stats().bytes_sent : 0;
  int64_t iv_steps = 0, iv_correct = 0, iv_seen = 0;
  double ema_step_s = 0;
  // Losses and hits stay on the model's device until a log line or a checkpoint needs them: row i
  // of iv_xent adds up the i-th step since the last read (at most log_every: a log line comes at
  // every multiple), so a GPU step never waits for its loss. iv_step_seen: each such step's
  // samples, for its mean loss.
  // Reads come at every multiple of log_every and at each epoch's end, so there are at most
  // min(log_every, steps per epoch) rows between two of them.
  Tensor iv_xent = zeros_on({std::min(cfg_.log_every, steps_per_epoch_), kXentStatsFloats}, device_);
  std::vector<int64_t> iv_step_seen;
  // Reads the interval's rows: the per-step mean losses summed into iv_loss, hits into iv_correct;
  // a non-finite loss or an out-of-range label stops the run naming the step.
  // Before a checkpoint (before_save) the weights about to be saved are checked too: a step whose
  // update overflowed leaves non-finite weights before any loss shows it.
  auto read_interval_losses = [&](bool before_save) {
    const int64_t n = static_cast<int64_t>(iv_step_seen.size());
    // Every rank reads at the same steps; a check that fails on one rank (its own batches' loss)
    // fails every rank alike, so none is left waiting in the next collective.
    comm::agree_on_inputs(comm_, [&] {
      Tensor host = n > 0 ? to_host(iv_xent.slice0(0, n)) : Tensor{};
      for (int64_t i = 0; i < n; ++i) {
        const XentStats st = xent_stats(host.slice0(i, i + 1).reshape({kXentStatsFloats}));
        const int64_t at = step_ - n + i + 1;
        DT_INPUT_CHECK(!st.bad_label,
                       "a label of the batch of step " << at << " on rank " << rank_ << " is outside the model's classes");
        const double loss =
            st.loss_sum / static_cast<double>(std::max<int64_t>(iv_step_seen[static_cast<size_t>(i)], 1));
        check_finite_loss(loss, at, rank_);
        iv_loss += loss;
        iv_correct += static_cast<int64_t>(st.hits);
        result.final_loss = loss;
      }
      if (before_save) check_finite_weights(model_->parameters(), step_, rank_);
    });
    if (n == 0) return;
    engine_for(device_).fill(iv_xent, 0.f);
    iv_step_seen.clear();
  };

  for (int64_t epoch = start_epoch; epoch < epochs_ && step_ < total_steps_; ++epoch) {
    if (loader_) loader_->start_epoch(epoch, skip * cfg_.accumulate);
    for (Slot& sl : slots) sl.full = false;  // a batch read ahead of the last epoch's end is dropped
    int64_t batch_in_epoch = skip;
    skip = 0;
    double epoch_t0 = now_s();
    while (step_ < total_steps_) {
      // One optimizer step: `accumulate` micro-batches, gradients exchanged on the last one only.
      double t0 = now_s(), wait = 0;
      const int64_t mallocs0 = gpu_malloc_count(device_);
      float lr = sched_->lr(step_);
      std::vector<nn::Parameter*> params = model_->parameters();
      for (nn::Parameter* p : params) engine_for(p->grad.device()).fill(p->grad, 0.f);
      nn::update_working_copies(params, engine_for(device_).math_precision());  // the masters changed last step
      int64_t seen_step = 0;
      const int64_t row = static_cast<int64_t>(iv_step_seen.size());
      Tensor step_xent = iv_xent.slice0(row, row + 1).reshape({kXentStatsFloats});
      bool ended = false;
      for (int64_t micro = 0; micro < cfg_.accumulate; ++micro) {
        data::Batch b;
        double td = now_s();
        Slot* slot = prefetch ? &slots[slot_now] : nullptr;
        if (slot) {
          if (!slot->full && !fill_slot(*slot)) {  // nothing read ahead: an epoch's first batch
            ended = true;
            break;
          }
          slot->full = false;
          b = slot->batch;
          slot_now ^= 1;
          fill_slot(slots[slot_now]);  // false at the epoch's end: the next epoch starts afresh
        } else if (loader_) {
          if (!loader_->next(b)) {
            ended = true;
            break;
          }
        } else {
          if (batch_in_epoch >= steps_per_epoch_) {
            ended = true;
            break;
          }
          b = synthetic[static_cast<size_t>((step_ * cfg_.accumulate + micro) % 4)];
        }
        wait += b.wait_s;
        double tc = now_s();
        trace.span("data wait", td, tc, step_);
        Tensor inputs = slot ? take_staged(slot->inputs) : stage_to(b.inputs, device_, dev_inputs);
        Tensor labels = slot ? take_staged(slot->labels) : stage_to(b.labels, device_, dev_labels);
        Tensor logits = model_->forward(inputs);
        ce.accumulate(logits, labels, step_xent);
        double tb = now_s();
        iv_fwd += tb - tc;
        seen_step += b.inputs.size(0);
        if (dp_) {
          dp_->set_step(step_);
          dp_->begin_backward(micro + 1 == cfg_.accumulate);
        }
        float loss_scale = scaler_ ? scaler_->scale() : 1.f;
        model_->backward(ce.backward(loss_scale / static_cast<float>(cfg_.accumulate)));
        double te = now_s();
        iv_bwd += te - tb;
        trace.span("forward+backward", tc, te, step_);
      }
      if (ended) {  // an epoch ended inside the step: its micro-batches so far are not counted
        engine_for(device_).fill(step_xent, 0.f);
        break;
      }
      double tw = now_s();
      if (dp_) {
        double c0 = dp_->stats().comm_wait_s;
        dp_->finish();
        if (scaler_ || cfg_.clip_grad_norm > 0.f) dp_->settle();  // the host reads the gradients next
        iv_comm += dp_->stats().comm_wait_s - c0;
      }
      double to = now_s();
      trace.span("communication wait", tw, to, step_);
      // fp16: unscale and check for inf/NaN after the exchange, so every rank decides alike (under
      // ZeRO-1 each rank holds a different slice, so the verdict is agreed on explicitly).
      const bool take_step = unscale_and_agree(scaler_.get(), opt_->params(), dp_ && dp_->zero1() ? &comm_ : nullptr);
      if (take_step && cfg_.clip_grad_norm > 0.f) {
        double norm = dp_ ? dp_->grad_norm() : optim::grad_norm(model_->parameters());
        if (norm > cfg_.clip_grad_norm) {
          float k = static_cast<float>(cfg_.clip_grad_norm / (norm + 1e-6));
          for (nn::Parameter* p : opt_->params()) engine_for(p->grad.device()).scale(p->grad, k);
        }
      }
      if (take_step) opt_->step(lr);
      if (dp_) {
        double c0 = dp_->stats().comm_wait_s;
        if (take_step) dp_->after_step();
        // On a GPU the optimizer step is now queued behind the exchange (an event); the host checks
        // the exchange before anything else can wait for the GPU (evaluation, a checkpoint, the next
        // loss), so a stuck peer times out naming the ranks instead of hanging in a stream sync.
        dp_->settle();
        iv_comm += dp_->stats().comm_wait_s - c0;
      }
      double t1 = now_s();
      iv_opt += t1 - to;
      trace.span("optimizer", to, t1, step_);
      trace.end_step();
      ++step_;
      ++batch_in_epoch;
      if (step_ > 2) step_mallocs += gpu_malloc_count(device_) - mallocs0;
      if (step_ == 1 || result.first_step_at_s == 0) {
        result.first_step_at_s = process_age_s();
        run_t0 = t1;
        run_cpu0 = process_cpu_s();
      } else {
        run_samples += seen_step * world_;
      }
      ema_step_s = ema_step_s == 0 ? (t1 - t0 + wait) : 0.9 * ema_step_s + 0.1 * (t1 - t0 + wait);
      iv_wait += wait;
      iv_seen += seen_step;
      iv_step_seen.push_back(seen_step);
      ++iv_steps;

      bool log_now = step_ % cfg_.log_every == 0 || step_ == total_steps_ || batch_in_epoch == steps_per_epoch_;
      if (log_now) {
        read_interval_losses(false);
        // Loss and accuracy averaged over ranks; throughput over the interval, globally.
        Tensor agg = Tensor::from({4}, {static_cast<float>(iv_loss), static_cast<float>(iv_correct),
                                        static_cast<float>(iv_seen), static_cast<float>(iv_wait)});
        if (world_ > 1) comm_.allreduce(agg, comm::ReduceOp::Sum)->wait();
        double now = now_s();
        double mean_loss = agg.f32()[0] / (iv_steps * world_);
        double acc = agg.f32()[1] / std::max(1.f, agg.f32()[2]);
        double sps = agg.f32()[2] / std::max(now - iv_t0, 1e-9);
        double wait = agg.f32()[3] / (iv_steps * world_);
        // The slowest rank's forward+backward per step: on shared cores it sets the pace.
        Tensor slow = Tensor::from({1}, {static_cast<float>((iv_fwd + iv_bwd) / iv_steps)});
        if (world_ > 1) comm_.allreduce(slow, comm::ReduceOp::Max)->wait();
        if (metrics_)
          metrics_->write({{"epoch", epoch + 1},
                           {"step", step_},
                           {"loss", mean_loss},
                           {"train_accuracy", acc},
                           {"lr", static_cast<double>(lr)},
                           {"samples_per_s", sps},
                           {"data_wait_s", wait},
                           {"comm_wait_s", iv_comm / iv_steps},
                           {"bytes_sent_per_step", dp_ ? (dp_->stats().bytes_sent - iv_bytes0) / iv_steps : int64_t{0}},
                           {"step_time_s", (now - iv_t0) / iv_steps},
                           {"loss_scale", static_cast<double>(scaler_ ? scaler_->scale() : 1.f)},
                           {"skipped_steps", scaler_ ? scaler_->skipped_steps() : int64_t{0}},
                           {"forward_s", iv_fwd / iv_steps},
                           {"backward_s", iv_bwd / iv_steps},
                           {"optimizer_s", iv_opt / iv_steps},
                           {"compute_max_s", static_cast<double>(slow.f32()[0])},
                           {"bucket_count", dp_ ? static_cast<int64_t>(dp_->bucket_count()) : int64_t{0}},
                           {"train_time_s", now - train_t0 - eval_total_s}});
        std::string stats = "loss " + fixed(mean_loss, 4) + " acc " + fixed(100 * acc, 1) + "% " + fixed(sps, 0) +
                            " samples/s wait " + fixed(1e3 * wait, 2) + " ms";
        if (progress_->bar()) {
          double eta = ema_step_s * static_cast<double>(total_steps_ - step_);
          progress_->update(epoch + 1, epochs_, batch_in_epoch, steps_per_epoch_, stats, eta);
        } else {
          say("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs_) + " step " + std::to_string(step_) +
              "/" + std::to_string(total_steps_) + " " + stats + " lr " + fixed(lr, 5));
        }
        iv_loss = iv_wait = iv_comm = iv_fwd = iv_bwd = iv_opt = 0;
        iv_bytes0 = dp_ ? dp_->stats().bytes_sent : 0;
        iv_steps = iv_correct = iv_seen = 0;
        iv_t0 = now_s();
      }
      bool saved = cfg_.checkpoint_every > 0 && step_ % cfg_.checkpoint_every == 0;
      if (saved) {
        read_interval_losses(true);  // a non-finite loss stops the run before it can replace a checkpoint
        save(epoch, batch_in_epoch);
      }
      // Preemption: a signal seen by any rank stops every rank after this same step. Not on an
      // epoch's last step, so that its evaluation and checkpoint happen first.
      if (step_ % cfg_.preempt_check_every == 0 && step_ < total_steps_ && batch_in_epoch < steps_per_epoch_ &&
          (result.preempted_by = agree_on_preemption(&comm_)) != 0) {
        if (!saved) {
          read_interval_losses(true);
          save(epoch, batch_in_epoch);
        }
        say("preempted by " + signal_name(result.preempted_by) + " at step " + std::to_string(step_) +
            (cfg_.checkpoint_dir.empty() ? std::string(": no --checkpoint-dir, nothing saved")
                                         : ": checkpoint written to " + cfg_.checkpoint_dir));
        if (metrics_)
          metrics_->write(
              {{"event", std::string("preempted")}, {"step", step_}, {"signal", signal_name(result.preempted_by)}});
        break;
      }
    }
    if (result.preempted_by != 0) break;
    bool epoch_done = batch_in_epoch >= steps_per_epoch_;
    if (epoch_done || step_ >= total_steps_) {
      std::string line = "epoch " + std::to_string(epoch + 1) + " done in " + fixed(now_s() - epoch_t0, 1) + " s";
      if (test_ds_ && cfg_.eval_each_epoch) {
        double te0 = now_s();
        double train_time_s = te0 - train_t0 - eval_total_s;
        EvalResult ev = evaluate(*test_ds_);
        double eval_s = now_s() - te0;
        eval_total_s += eval_s;
        result.last_eval = ev;
        line += ": test loss " + fixed(ev.loss, 4) + ", test accuracy " + fixed(100 * ev.accuracy, 2) + "% (" +
                std::to_string(ev.samples) + " samples)";
        if (metrics_)
          metrics_->write({{"epoch", epoch + 1},
                           {"step", step_},
                           {"test_loss", ev.loss},
                           {"test_accuracy", ev.accuracy},
                           {"test_samples", ev.samples},
                           {"train_time_s", train_time_s},
                           {"eval_s", eval_s},
                           {"wall_s", now_s() - train_t0}});
      }
      say(line);
      if (cfg_.checkpoint_every == 0 || step_ % cfg_.checkpoint_every != 0)
        save(epoch_done ? epoch + 1 : epoch, epoch_done ? 0 : batch_in_epoch);
    }
  }
  read_interval_losses(false);  // steps after the last log line (a preempted run): final_loss, checks
  trace.write(comm_);
  if (!cfg_.trace.empty()) say("trace of " + std::to_string(world_) + " rank(s) written to " + cfg_.trace);
  result.steps = step_;
  double elapsed = now_s() - run_t0;
  double cpu = process_cpu_s() - run_cpu0;
  result.samples_per_s = elapsed > 0 ? static_cast<double>(run_samples) / elapsed : 0;
  const std::string gpu_memory = gpu_memory_report(device_, step_, step_mallocs);
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (!device_.is_cpu()) {
    const cuda::AllocatorStats st = cuda::allocator_stats(device_.index);
    result.gpu_peak_allocated_mib = static_cast<double>(st.peak_allocated) / 1048576.0;
    result.gpu_reserved_mib = static_cast<double>(st.reserved) / 1048576.0;
    result.gpu_mallocs_after_warmup = step_ > 2 ? step_mallocs : -1;
  }
#endif
  if (!gpu_memory.empty()) say("GPU memory (rank 0, cuda:" + std::to_string(device_.index) + "): " + gpu_memory);
  if (rank_ == 0) {
    say("done: " + std::to_string(step_) + " steps, " + fixed(result.samples_per_s, 0) + " samples/s, first step " +
        fixed(result.first_step_at_s, 3) + " s after process start");
    if (metrics_) {
      JsonFields f{{"summary", std::string("run")},
                   {"steps", step_},
                   {"samples_per_s", result.samples_per_s},
                   {"first_step_at_s", result.first_step_at_s},
                   {"samples_per_cpu_s", cpu > 0 ? static_cast<double>(run_samples) / world_ / cpu : 0.0},
                   {"final_loss", result.final_loss},
                   {"test_accuracy", result.last_eval.accuracy}};
      if (!gpu_memory.empty()) {
        f.push_back({"gpu_peak_allocated_mib", result.gpu_peak_allocated_mib});
        f.push_back({"gpu_reserved_mib", result.gpu_reserved_mib});
        f.push_back({"gpu_mallocs_after_warmup", result.gpu_mallocs_after_warmup});
      }
      metrics_->write(f);
    }
  }
  return result;
}

}  // namespace dtrain::train

// The trainer's set-up: device, layout, gradient exchange, optimizer, pruner, the opening lines.
#include "dtrain/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include <zlib.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/forensics.h"
#include "dtrain/comm/nccl.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif
#include "dtrain/core/env.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/loader.h"
#include "dtrain/optim/large_batch.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/parallel/zero/memory_plan.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/step_support.h"
#include "dtrain/train/trace.h"

namespace fs = std::filesystem;

namespace dtrain::train {

// ------------------------------------------------------------------ set-up
namespace {
// A number this run's ranks share and no other run has (rank 0's draw, broadcast): the checkpoint
// files of one set carry it, so a part of another run with the same step is never merged.
int64_t draw_run_id(comm::Communicator& world) {
  Tensor id = Tensor::zeros({1}, DType::I64);
  if (world.rank() == 0) {
    std::random_device rd;
    const uint64_t bits = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    id.data<int64_t>()[0] = static_cast<int64_t>((bits & 0x7fffffffffffffffull) | 1);
  }
  if (world.size() > 1) world.broadcast(id, 0)->wait();
  return id.data<int64_t>()[0];
}

// Which parameters (by name) the run freezes: LoRA every weight but the adapters, --freeze those
// its expression matches whole; none (empty) without either. InputError for a bad expression.
std::function<bool(const std::string&)> frozen_names(const TrainConfig& cfg) {
  if (cfg.lora_rank > 0) return [](const std::string& name) { return !nn::is_lora_adapter(name); };
  if (cfg.freeze.empty()) return {};
  try {
    return [pattern = std::regex(cfg.freeze)](const std::string& name) { return std::regex_match(name, pattern); };
  } catch (const std::regex_error& e) {
    throw InputError("option --freeze '" + cfg.freeze + "' is not a regular expression: " + e.what());
  }
}
}  // namespace

Trainer::Trainer(const TrainConfig& cfg, comm::Runtime& rt, comm::Communicator* world)
    : cfg_(cfg), rt_(rt), world_(world ? *world : rt.world()), phases_(world_) {
  rank_ = world_.rank();
  progress_ = std::make_unique<Progress>(cfg_.progress, rank_ == 0 && !cfg_.quiet);
  task_ = is_language_model(cfg_.model) ? make_gpt_task() : make_image_task();
  parse_test_hooks();
  // A hang's forensics files go with the run: its checkpoints, else its metrics file.
  comm::set_run_dir(!cfg_.checkpoint_dir.empty() ? cfg_.checkpoint_dir
                    : !cfg_.metrics.empty()      ? fs::path(cfg_.metrics).parent_path().string()
                                                 : std::string("."));
  // A host short of GPUs fails every rank alike, before any rank creates a communicator.
  comm::agree_on_inputs(world_, [this] { choose_device(); });
  run_id_ = draw_run_id(world_);
  // Every communicator of the grid is split from the world and inherits its allreduce algorithm.
  if (!cfg_.allreduce.empty()) world_.set_allreduce_algorithm(comm::allreduce_algorithm_from_name(cfg_.allreduce));
  grid_ = std::make_unique<parallel::ProcessGrid>(world_, cfg_.tp, cfg_.pp);  // the same check on every rank
  // ZeRO-3 keeps only this rank's blocks while the model is built: of the data-parallel group's
  // blocks, or with --shard-scope node of its node's.
  if (cfg_.zero == 3) {
    comm::agree_on_inputs(world_, [this] {
      const parallel::ShardGroups g = parallel::shard_groups(grid_->dp(), cfg_.shard_scope);
      const comm::Communicator& over = g.node ? *g.node : grid_->dp();
      // LoRA's adapters are known by their names' ends as a unit is built; --freeze's expressions
      // name whole-model paths, which a unit's parameters do not have yet then (its units stay whole).
      built_ = std::make_unique<parallel::ShardedInit>(over.rank(), over.size(),
                                                       cfg_.lora_rank > 0 ? frozen_names(cfg_) : nullptr);
    });
  }
  comm::agree_on_inputs(world_, [this] {
    check_layout();
    task_->setup(TaskSetup{cfg_, *grid_, device_, batch_, parts_, rt_.topology().local_size, built_.get()});
  });
  task_->connect();                               // an image pipeline draws its stage here
  if (built_ && built_->empty()) built_.reset();  // no unit with parameters came (a stage of pools)
  comm::agree_on_inputs(world_, [this] { setup_exchange(); });
}

Trainer::~Trainer() = default;

void Trainer::choose_device() {
  const comm::Topology& topo = rt_.topology();
  // Threads: by default the node's cores shared among the ranks on it.
  const int threads = topo.compute_threads(cfg_.threads);
  cpu_engine().set_threads(threads);
  if (cfg_.device == "cuda") {
    DT_INPUT_CHECK(enable_cuda() > 0, "option --device cuda: no GPU is visible, or this dtrain was built without CUDA");
    device_ = Device::cuda(std::max(0, topo.cuda_device));
  } else if (cfg_.device == "sim") {
    device_ = Device::sim();
  }
  comm_ = choose_comm();
  if (cfg_.precision != "tf32") cpu_engine().set_math_precision(math_precision_from_name(cfg_.precision));
  engine_for(device_).set_math_precision(math_precision_from_name(cfg_.precision));
  scaler_ = make_loss_scaler(cfg_.precision, cfg_.loss_scale_interval, cfg_.loss_scale_init);
  std::string warn = topo.binding_warning(threads);
  if (!warn.empty() && topo.local_rank == 0 && !cfg_.quiet)
    std::fprintf(stderr, "dtrain: warning (rank %d): %s\n", rank_, warn.c_str());
}

// How device tensors travel between ranks (--comm): NCCL where every rank of a node has a GPU of its
// own (NCCL refuses two ranks of a communicator on one GPU), otherwise MPI with host staging. Host
// tensors always take MPI.
std::string Trainer::choose_comm() const {
  const comm::Topology& topo = rt_.topology();
  if (device_.type != DeviceType::CUDA) {
    DT_INPUT_CHECK(cfg_.comm != "nccl", "option --comm nccl needs --device cuda (NCCL moves GPU memory only)");
    return device_.is_cpu() ? "mpi" : "mpi (host-staged)";
  }
  const bool gpu_each = topo.local_size <= topo.cuda_device_count;
  // The inter-node scope splits the data-parallel communicator by node, agreeing over host memory.
  const bool by_node = cfg_.compression != "none" && cfg_.compression_scope == "inter-node";
  if (cfg_.comm == "nccl") {
    DT_INPUT_CHECK(comm::nccl_compiled(), "option --comm nccl: this dtrain was built without NCCL; use --comm mpi");
    DT_INPUT_CHECK(world_.size() == 1 || gpu_each,
                   "option --comm nccl: " << topo.local_size << " ranks on host " << topo.host << " share "
                                          << topo.cuda_device_count
                                          << " GPU(s), and NCCL refuses two ranks on one GPU; use --comm mpi");
    DT_INPUT_CHECK(!by_node,
                   "option --comm nccl does not combine with --compression-scope inter-node in this "
                   "version (the split by node runs over MPI); use --comm mpi or auto");
    return "nccl";
  }
  if (cfg_.comm == "auto" && comm::nccl_compiled() && gpu_each && !by_node) return "nccl";
  return "mpi (host-staged)";
}

// --batch-size is each rank's micro-batch; --global-batch-size the samples of one optimizer step
// over all dp ranks and accumulation micro-steps, which must split evenly. A pipeline step cuts
// the batch into --micro-batches instead.
void Trainer::check_layout() {
  const int dp = grid_->dp_size();
  batch_ = cfg_.batch_size;
  if (cfg_.global_batch_size > 0) {
    const int64_t parts = dp * cfg_.accumulate;
    DT_INPUT_CHECK(cfg_.global_batch_size % parts == 0, "option --global-batch-size "
                                                            << cfg_.global_batch_size << " does not divide evenly over "
                                                            << dp << " ranks x " << cfg_.accumulate << " micro-steps");
    batch_ = cfg_.global_batch_size / parts;
  }
  DT_INPUT_CHECK(batch_ > 0, "option --batch-size must be positive");
  DT_INPUT_CHECK(cfg_.accumulate == 1 || cfg_.pp == 1,
                 "option --accumulate does not combine with --pp: a pipeline step already runs --micro-batches");
  parts_ = cfg_.pp > 1 ? static_cast<int>(cfg_.micro_batches > 0 ? cfg_.micro_batches : 2 * cfg_.pp)
                       : static_cast<int>(cfg_.accumulate);
  DT_INPUT_CHECK(cfg_.pp == 1 || batch_ % parts_ == 0,
                 "--micro-batches " << parts_ << " must divide --batch-size " << batch_);
  DT_INPUT_CHECK(cfg_.trace.empty() || cfg_.trace_steps > 0, "option --trace-steps must be positive");
}

// After the ranks agreed on the inputs: creates the NCCL communicator, which every rank must reach.
void Trainer::setup_exchange() {
  nn::Module& model = task_->model();
  refuse_what_cannot_fit();
  freeze_parameters();
  if (grid_->dp_size() > 1 || cfg_.zero > 0 || cfg_.compression != "none") {
    parallel::DataParallelOptions dpo;
    dpo.bucket_bytes = static_cast<int64_t>(cfg_.bucket_mb * 1048576.0);
    dpo.zero = cfg_.zero;
    dpo.reshard_after_forward = cfg_.reshard_after_forward;
    dpo.prefetch = cfg_.zero_prefetch;
    dpo.gather_dtype = cfg_.zero_gather_dtype == "bf16" ? DType::BF16 : DType::F32;
    dpo.shard_scope = cfg_.shard_scope;
    dpo.overlap = cfg_.overlap;
    dpo.compression = cfg_.compression;  // PowerSGD per tensor: matrices factorised, vectors sent whole
    dpo.compression_scope = cfg_.compression_scope;
    dpo.seed = derive_seed(cfg_.seed, 77);
    dpo.momentum_correction = topk_momentum_correction();
    dpo.device_stream = compute_stream_of(device_);
    if (grid_->dp_size() > 1 && comm_ == "nccl") nccl_ = gpu_gradient_communicator(grid_->dp(), device_, "dp-nccl");
    if (nccl_) nccl_->track_step_phases(true);
    dpo.built = built_.get();
    dp_ = parallel::make_data_parallel(model, nccl_ ? *nccl_ : grid_->dp(), dpo);
    built_.reset();  // the blocks are the shard's now
  }
  if (cfg_.pp > 1)
    pipe_ = std::make_unique<parallel::PipelineStage>(model, grid_->pp(),
                                                      parallel::pipeline_schedule_from_name(cfg_.schedule), parts_);
  build_optimizer();
  steps_per_epoch_ = task_->steps_per_epoch();
  has_epochs_ = steps_per_epoch_ > 0;
  epochs_ = has_epochs_ ? cfg_.epochs : 1;
  total_steps_ = has_epochs_ ? steps_per_epoch_ * epochs_ : cfg_.steps;
  if (has_epochs_ && cfg_.steps > 0 && (cfg_.steps < total_steps_ || cfg_.synthetic)) {
    total_steps_ = cfg_.steps;
    epochs_ = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  }
  if (!has_epochs_) steps_per_epoch_ = total_steps_;  // one "epoch": the whole run
  DT_INPUT_CHECK(total_steps_ > 0, "option --steps must be positive");
  if (cfg_.prune_sparsity > 0.f) build_pruner();
  // Top-k's sparsity warm-up and PowerSGD's uncompressed start: one epoch, or the lr warm-up.
  if (dp_)
    dp_->set_compression_warmup(cfg_.compression_warmup >= 0 ? cfg_.compression_warmup
                                : has_epochs_                ? steps_per_epoch_
                                                             : cfg_.warmup_steps);
  optim::ScheduleOptions so;
  so.kind = cfg_.lr_schedule;
  so.base_lr = cfg_.lr;
  if (cfg_.lr_scaling == "linear")  // Goyal et al.: lr grows with the global batch (pair with warm-up)
    so.base_lr = cfg_.lr * static_cast<float>(batch_ * grid_->dp_size() * cfg_.accumulate) /
                 static_cast<float>(cfg_.base_batch_size);
  so.total_steps = total_steps_;
  so.step_size = cfg_.lr_step_size;
  so.gamma = cfg_.lr_gamma;
  so.min_lr = cfg_.min_lr;
  so.warmup_steps = cfg_.warmup_steps;
  sched_ = std::make_unique<optim::LrSchedule>(so);
  provenance_ = run_provenance(std::to_string(world_.size()) + " rank(s): dp " + std::to_string(grid_->dp_size()) +
                                   " x tp " + std::to_string(cfg_.tp) + " x pp " + std::to_string(cfg_.pp),
                               config_ini(cfg_));
  if (rank_ == 0 && !cfg_.metrics.empty()) {
    metrics_ = std::make_unique<MetricsWriter>(cfg_.metrics, !cfg_.resume.empty());  // a resumed run adds to its file
    metrics_->write(provenance_);
  }
}

namespace {

int optimizer_floats(const TrainConfig& c) {  // f32 values the optimizer keeps per parameter
  if (c.optimizer == "sgd") return c.momentum > 0.f ? 1 : 0;
  if (c.optimizer == "lars") return 1;
  return 2;  // adam, adamw, lamb
}

std::vector<int64_t> unit_sizes(nn::Module& model) {
  std::vector<int64_t> sizes;
  for (const std::vector<nn::Module*>& entries : model.shard_units().by_unit()) {
    int64_t n = 0;
    for (const nn::Parameter* p : parallel::unit_parameters(entries)) n += p->value.numel();
    sizes.push_back(n);
  }
  return sizes;
}

}  // namespace

// Before anything of the step is allocated: the model state this rank would hold at this --zero
// stage (parallel::plan_model_state) against the memory it may fill. A run that cannot fit stops
// here on every rank (an input error), with the bytes and what would fit instead.
void Trainer::refuse_what_cannot_fit() {
  const comm::Topology& topo = comm::Runtime::get().topology();
  const auto [budget, source] = memory_per_rank(cfg_.memory_per_rank_mb, device_, topo.local_size);
  if (budget <= 0) return;
  nn::Module& model = task_->model();
  const int64_t params = built_ ? built_->parameter_count() : model.parameter_count();
  int64_t trained = params;  // less what --freeze or LoRA will freeze (values may be freed: their kept shapes)
  if (const auto frozen = frozen_names(cfg_))
    for (const nn::Parameter* p : model.parameters())
      if (frozen(p->name)) trained -= shape_numel(nn::local_shape(*p));
  const std::vector<int64_t> units = built_ ? built_->unit_sizes() : unit_sizes(model);
  // --shard-scope node shards over a node's ranks only.
  const int dp = cfg_.shard_scope == "node" ? std::min(grid_->dp_size(), topo.local_size) : grid_->dp_size();
  const int k = optimizer_floats(cfg_);
  const auto plan = [&](int zero, int ranks) {
    return parallel::plan_model_state(params, trained, units, zero, ranks, k, cfg_.zero_prefetch);
  };
  const parallel::ModelStateBytes need = plan(cfg_.zero, dp);
  if (need.total() <= budget) return;
  const auto gib = parallel::bytes_text;
  std::string fits;
  for (int zero = cfg_.zero + 1; zero <= 3 && !units.empty(); ++zero)
    if (plan(zero, dp).total() <= budget) {
      fits = "--zero " + std::to_string(zero) + " (" + gib(plan(zero, dp).total()) + ")";
      break;
    }
  const int sharded = cfg_.zero > 0 || units.empty() ? std::max(cfg_.zero, 1) : 3;  // more ranks help a ZeRO stage
  for (int ranks = 2 * dp; ranks <= 64 * dp && fits.empty(); ranks *= 2)
    if (plan(sharded, ranks).total() <= budget) {
      fits = std::to_string(ranks) + " data-parallel ranks at --zero " + std::to_string(sharded) + " (" +
             gib(plan(sharded, ranks).total()) + ")";
      break;
    }
  throw InputError(
      "the model state of this run needs " + parallel::describe(need) + " on each rank at --zero " +
      std::to_string(cfg_.zero) + " over " + std::to_string(dp) + " data-parallel rank(s), more than the " +
      gib(budget) + " a rank may fill (" + source + "); " +
      (fits.empty() ? std::string("no ZeRO stage or rank count up to 64 x fits it") : "it fits with " + fits) +
      ". Activations come on top: --checkpoint-activations makes them smaller");
}

// This rank's model state by kind, in bytes: the data-parallel layout's (parameters, gradients,
// ZeRO's shards and peaks) or the model's own, and the optimizer's.
std::map<std::string, int64_t> Trainer::model_state_bytes() {
  std::map<std::string, int64_t> bytes;
  if (dp_) {
    bytes = dp_->memory_bytes();
  } else {
    bytes = {{"parameters", task_->model().parameter_count() * 4}, {"gradients", 0}};
    for (const nn::Parameter* p : task_->model().parameters())
      bytes["gradients"] += static_cast<int64_t>(p->grad.defined() ? p->grad.nbytes() : 0);
  }
  int64_t state = 0;
  for (const optim::StateTensor& st : opt_->state()) state += static_cast<int64_t>(st.value->nbytes());
  bytes["optimizer state"] = state;
  return bytes;
}

// At the end, on rank 0 (every rank with --memory-report): the model state by kind, ZeRO's peaks,
// the activations the last step kept, and the process's peak RSS.
void Trainer::report_memory() {
  result_.model_state_bytes = model_state_bytes();
  if (rank_ != 0 && !cfg_.memory_report) return;
  const std::map<std::string, int64_t>& held = result_.model_state_bytes;
  std::string line;
  int64_t total = 0;
  for (const auto& [kind, bytes] : held) {
    if (kind.find("(peak)") == std::string::npos) total += bytes;
    if (bytes > 0) line += ", " + kind + " " + fixed(static_cast<double>(bytes) / 1048576.0, 2);
  }
  const double activations = static_cast<double>(task_->model().activation_bytes()) / 1048576.0;
  const std::string text = "memory of rank " + std::to_string(rank_) + " (MiB): model state " +
                           fixed(static_cast<double>(total) / 1048576.0, 2) + line + ", activations " +
                           fixed(activations, 2) + ", peak RSS " + fixed(peak_rss_mib(), 1);
  if (rank_ == 0)
    say(text);
  else
    std::fprintf(stderr, "%s\n", text.c_str());
}

// The momentum top-k compression takes over from SGD (Deep Gradient Compression's momentum
// correction), or 0 where it does not apply: another compressor or optimizer, Nesterov momentum,
// --momentum-correction false, or --compression-scope inter-node (the exact exchange within a node
// keeps SGD's own momentum, and a job on one node compresses nothing).
float Trainer::topk_momentum_correction() const {
  bool topk = cfg_.compression.rfind("topk", 0) == 0;
  if (!topk || !cfg_.momentum_correction || cfg_.optimizer != "sgd" || cfg_.nesterov || cfg_.compression_scope != "all")
    return 0.f;
  return cfg_.momentum;
}

// The task's parameter groups (the GPT: no decay on vectors and the position table); under ZeRO-1
// each parameter's piece in this rank's slice, in its parameter's group.
// --freeze: the parameters whose names the expression matches whole. Counted over the world (a
// pipeline stage may hold none of them): an expression that matches nothing, or everything, is
// refused on every rank.
void Trainer::freeze_parameters() {
  const std::function<bool(const std::string&)> frozen = frozen_names(cfg_);
  if (!frozen) return;
  const bool lora = cfg_.lora_rank > 0;
  // Counted over the world, each parameter once (by the first tp and dp rank of its stage).
  const bool counts = grid_->dp_rank() == 0 && grid_->tp_rank() == 0;
  Tensor n = Tensor::zeros({2});  // frozen tensors, all tensors
  for (nn::Parameter* p : task_->model().parameters()) {
    p->frozen = frozen(p->name);
    if (p->frozen) p->grad = Tensor();  // no gradient memory (nn::Parameter::frozen)
    n.f32()[0] += counts && p->frozen ? 1.f : 0.f;
    n.f32()[1] += counts ? 1.f : 0.f;
  }
  world_.allreduce(n)->wait();
  const std::string what = lora ? "option --lora-rank" : "option --freeze '" + cfg_.freeze + "'";
  DT_INPUT_CHECK(n.f32()[0] > 0, what << " matches no parameter's name");
  DT_INPUT_CHECK(n.f32()[0] < n.f32()[1], what << " matches every parameter: nothing to train");
  char line[200];
  std::snprintf(line, sizeof line, "frozen: %.0f of %.0f parameter tensors (%s)", n.f32()[0], n.f32()[1],
                lora ? "LoRA: all but the adapters" : ("matching '" + cfg_.freeze + "'").c_str());
  say(line);
}

void Trainer::build_optimizer() {
  std::vector<nn::Parameter*> params;
  for (nn::Parameter* p : task_->model().parameters())
    if (!p->frozen) params.push_back(p);
  std::vector<optim::ParamGroup> groups = task_->param_groups(params, cfg_.weight_decay);
  if (dp_) groups = dp_->optimizer_groups(groups);
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
    o.nesterov = cfg_.nesterov;
    momentum_ = o.momentum;
    opt_ = std::make_unique<optim::SGD>(groups, o);
  } else {
    optim::AdamOptions o;
    o.beta1 = cfg_.beta1;
    o.beta2 = cfg_.beta2;
    o.eps = cfg_.eps;
    o.decoupled = cfg_.optimizer == "adamw";
    opt_ = std::make_unique<optim::Adam>(groups, o);
  }
}

// Conv and Linear weights the task lets prune; structured pruning keeps the output layer whole (its
// rows are the classes or the residual stream) and takes each weight's bias along.
void Trainer::build_pruner() {
  std::vector<nn::Parameter*> weights, biases;
  std::map<std::string, nn::Parameter*> by_name;
  for (nn::Parameter* p : task_->model().parameters()) {
    by_name[p->name] = p;
    if (task_->prunable(*p)) weights.push_back(p);
  }
  if (cfg_.prune_structured && !weights.empty()) weights.pop_back();
  for (nn::Parameter* w : weights) {
    const std::string bias = w->name.substr(0, w->name.rfind('.') + 1) + "bias";
    auto it = by_name.find(bias);
    biases.push_back(it != by_name.end() && it->second->value.numel() == w->value.size(0) ? it->second : nullptr);
  }
  optim::PruneOptions o;
  o.sparsity = cfg_.prune_sparsity;
  o.start = cfg_.prune_start;
  o.end = cfg_.prune_end >= 0 ? cfg_.prune_end : std::max(cfg_.prune_start, total_steps_ * 4 / 5);
  o.every = cfg_.prune_every;
  o.structured = cfg_.prune_structured;
  o.global = cfg_.prune_scope == "global";
  pruner_ = std::make_unique<optim::MagnitudePruner>(weights, biases, o);
}

void Trainer::say(const std::string& s) { progress_->line(s); }

void Trainer::announce() {
  if (rank_ != 0) return;
  std::ostringstream o;
  o << "dtrain: " << task_->describe() << ", " << world_.size() << " rank" << (world_.size() > 1 ? "s" : "") << " (dp "
    << grid_->dp_size() << " x tp " << cfg_.tp << " x pp " << cfg_.pp << ") x " << cpu_engine().threads()
    << " thread(s), batch " << batch_ << "/rank"
    << (cfg_.accumulate > 1 ? " x " + std::to_string(cfg_.accumulate) + " micro-steps" : std::string()) << " ("
    << batch_ * grid_->dp_size() * cfg_.accumulate << " global), "
    << (has_epochs_ ? std::to_string(steps_per_epoch_) + " steps/epoch, " : std::string()) << total_steps_ << " steps, "
    << opt_->kind() << " lr " << cfg_.lr << " " << cfg_.lr_schedule << ", precision " << cfg_.precision << ", device "
    << device_.str() << ", comm " << comm_;
  say(o.str());
  if (std::string note = engine_for(device_).precision_note(); !note.empty()) say("precision: " + note);
  // Training state per rank as it is held now (ZeRO's gathered units and gradient buffers come and
  // go during the passes: report_memory gives their peaks).
  const std::map<std::string, int64_t> held = model_state_bytes();
  std::string kinds;
  for (const auto& [kind, bytes] : held)
    if (bytes > 0 && kind.find("(peak)") == std::string::npos)
      kinds += (kinds.empty() ? "" : ", ") + kind + " " + fixed(static_cast<double>(bytes) / 1048576.0, 2) + " MiB";
  say("memory per rank: " + kinds +
      (cfg_.zero > 0 ? " (ZeRO-" + std::to_string(cfg_.zero) + " over " + std::to_string(grid_->dp_size()) + " ranks" +
                           (cfg_.shard_scope == "node" ? ", sharded within each node)" : ")")
                     : std::string()) +
      (dp_ ? ", " + std::to_string(dp_->bucket_count()) + (cfg_.zero >= 2 ? " unit(s)" : " gradient bucket(s)") +
                 ", compression " + cfg_.compression
           : std::string()) +
      (topk_momentum_correction() > 0 ? " with momentum correction" : ""));
  if (pruner_)
    say("pruning: " + fixed(100 * cfg_.prune_sparsity, 1) + " % of " +
        (cfg_.prune_structured ? "each layer's output channels" : "the weights (" + cfg_.prune_scope + ")") +
        ", cubic ramp from step " + std::to_string(cfg_.prune_start) + ", masks every " +
        std::to_string(cfg_.prune_every) + " steps");
  if (pipe_) {
    const std::vector<int> starts = task_->stage_starts();
    std::ostringstream per;
    for (int s = 0; s < cfg_.pp; ++s) per << (s ? "," : " ") << starts[s + 1] - starts[s];
    say("pipeline: " + std::to_string(cfg_.pp) + " stages, " + task_->piece() + " per stage" + per.str() + ", " +
        std::to_string(parts_) + " micro-batches of " + std::to_string(batch_ / parts_) + ", " +
        parallel::pipeline_schedule_name(parallel::pipeline_schedule_from_name(cfg_.schedule)) +
        " schedule, ideal bubble " + fixed(100 * parallel::pipeline_ideal_bubble(cfg_.pp, parts_), 1) + " %");
  }
}

}  // namespace dtrain::train

// GPT language-model training on byte-token streams. One step: B random windows of T+1 tokens per
// rank -> Gpt forward -> mean softmax cross-entropy over B*T positions -> backward (gradients
// averaged over the dp ranks by DataParallel, started from the grad-ready hook) -> clip -> AdamW.
#include "dtrain/train/lm_trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/text.h"
#include "dtrain/optim/loss_scaler.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/optim/schedule.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/step_support.h"
#include "dtrain/train/trace.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

double eval_stream(nn::Gpt& model, const data::TokenStream& s, int64_t batch, int64_t t, int64_t max_batches,
                   nn::SoftmaxCrossEntropy& xent, Device device = Device::cpu()) {
  int64_t windows = data::window_count(s, t);
  int64_t batches = windows / batch;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  DT_INPUT_CHECK(batches > 0, "the validation stream (" << s.tokens.size() << " tokens) holds no batch of " << batch
                                                        << " windows of " << t + 1 << " tokens");
  nn::update_working_copies(model.parameters(), engine_for(device).math_precision());
  bool was_training = model.training();
  model.eval();
  StagedTensor ids, targets;  // on a GPU: page-locked staging, reused by every batch
  Tensor stats = zeros_on({kXentStatsFloats}, device);  // summed on the device, read once
  for (int64_t k = 0; k < batches; ++k) {
    data::TokenBatch b = data::sequential_windows(s, batch, t, k * batch);
    xent.accumulate(model.forward(stage_to(b.ids, device, ids)),
                    stage_to(b.targets, device, targets).reshape({batch * t}), stats);
  }
  model.train(was_training);
  const XentStats st = xent_stats(to_host(stats));
  DT_INPUT_CHECK(!st.bad_label, "a token of the validation stream is outside the vocabulary");
  return st.loss_sum / static_cast<double>(batches * batch * t);
}

}  // namespace

double evaluate_lm(nn::Gpt& model, const std::string& val_file, int64_t batch, int64_t seq_len, int64_t max_batches) {
  data::TokenStream s = data::load_tokens(val_file);
  nn::SoftmaxCrossEntropy xent;
  return eval_stream(model, s, batch, seq_len, max_batches, xent);
}

CheckpointState gpt_checkpoint_state(const nn::GptConfig& c, const std::map<std::string, Tensor>& full_params,
                                     int64_t step) {
  CheckpointState s;
  for (const auto& [name, t] : full_params) s.tensors["param/" + name] = t;
  s.strings["model"] = "gpt";
  s.strings["tokenizer"] = "bytes";
  s.ints["step"] = step;
  s.int_lists["gpt"] = {c.vocab, c.context, c.layers, c.heads, c.width};
  return s;
}

CheckpointState load_gpt_checkpoint(const std::string& file) {
  CheckpointState s = load_checkpoint(file);
  auto it = s.ints.find("pp_stages");
  const int64_t stages = it == s.ints.end() ? 1 : it->second;
  for (int64_t st = 1; st < stages; ++st) {
    std::string f = stage_part_file(file, st);
    DT_INPUT_CHECK(fs::exists(f), "checkpoint " << file << " is stage 0 of " << stages << " pipeline stages, but " << f
                                                << " (stage " << st << ") is missing");
    CheckpointState part = load_checkpoint(f);
    DT_INPUT_CHECK(part.ints["step"] == s.ints["step"],
                   f << " is from step " << part.ints["step"] << ", " << file << " from step " << s.ints["step"]);
    for (auto& [name, t] : part.tensors) s.tensors.emplace(name, t);  // the tied "wte" copy: stage 0's
  }
  return s;
}

std::unique_ptr<nn::Gpt> gpt_from_checkpoint(const CheckpointState& s) {
  auto it = s.strings.find("model");
  DT_INPUT_CHECK(it != s.strings.end() && it->second == "gpt", "the checkpoint does not hold a gpt model");
  auto cfg_it = s.int_lists.find("gpt");
  DT_INPUT_CHECK(cfg_it != s.int_lists.end() && cfg_it->second.size() == 5, "the checkpoint lacks the gpt config");
  nn::GptConfig cfg;
  cfg.vocab = cfg_it->second[0];
  cfg.context = cfg_it->second[1];
  cfg.layers = cfg_it->second[2];
  cfg.heads = cfg_it->second[3];
  cfg.width = cfg_it->second[4];
  auto model = std::make_unique<nn::Gpt>(cfg);
  for (nn::Parameter* p : model->parameters()) {
    auto t = s.tensors.find("param/" + p->name);
    DT_INPUT_CHECK(t != s.tensors.end() && t->second.numel() == p->value.numel(),
                   "the checkpoint lacks parameter " << p->name << " of " << p->value.str());
    p->value.copy_from(t->second);
  }
  return model;
}

namespace {

// Which blocks each pipeline stage holds: given ("2,4"), or cut by cost (the embedding counts
// with the first block, the head with the last).
std::vector<int> stage_starts(const LmConfig& cfg) {
  const int layers = static_cast<int>(cfg.model.layers);
  if (!cfg.pp_split.empty()) {
    std::vector<int> starts{0};
    std::stringstream ss(cfg.pp_split);
    std::string item;
    while (std::getline(ss, item, ',')) {
      int n = 0;
      try {
        n = std::stoi(item);
      } catch (const std::exception&) {
        DT_INPUT_CHECK(false, "--pp-split " << cfg.pp_split << ": '" << item << "' is not a block count");
      }
      DT_INPUT_CHECK(n >= 1, "--pp-split " << cfg.pp_split << ": every stage needs at least one block");
      starts.push_back(starts.back() + n);
    }
    DT_INPUT_CHECK(static_cast<int>(starts.size()) == cfg.pp + 1 && starts.back() == layers,
                   "--pp-split " << cfg.pp_split << " must give " << cfg.pp << " block counts adding up to the "
                                 << layers << " layers");
    return starts;
  }
  nn::GptCosts k = nn::gpt_costs(cfg.model, cfg.seq_len);
  std::vector<double> costs(layers, k.block);
  costs.front() += k.embed;
  costs.back() += k.head;
  return parallel::balance_stages(costs, cfg.pp);
}

}  // namespace

LmConfig lm_config(const TrainConfig& t) {
  LmConfig c;
  c.data = t.data;
  c.model.vocab = t.vocab;
  c.model.context = t.context;
  c.model.layers = t.layers;
  c.model.heads = t.heads;
  c.model.width = t.width;
  c.model.seed = t.seed;
  c.seed = t.seed;
  c.batch_size = t.batch_size;
  c.seq_len = t.seq_len;
  c.steps = t.steps;
  c.lr = t.lr;
  c.min_lr = t.min_lr;
  c.weight_decay = t.weight_decay;
  c.clip_grad_norm = t.clip_grad_norm;
  c.beta1 = t.beta1;
  c.beta2 = t.beta2;
  c.eps = t.eps;
  c.warmup_steps = t.warmup_steps;
  c.eval_every = t.eval_every;
  c.eval_batches = t.eval_batches;
  c.log_every = t.log_every;
  c.tp = t.tp;
  c.pp = t.pp;
  c.pp_split = t.pp_split;
  c.micro_batches = t.micro_batches;
  c.schedule = t.schedule;
  c.checkpoint_activations = t.checkpoint_activations;
  c.precision = t.precision;
  c.loss_scale_interval = t.loss_scale_interval;
  c.loss_scale_init = t.loss_scale_init;
  c.device = t.device;
  c.threads = t.threads;
  c.metrics = t.metrics;
  c.checkpoint_dir = t.checkpoint_dir;
  c.checkpoint_every = t.checkpoint_every;
  c.keep_checkpoints = t.keep_checkpoints;
  c.resume = t.resume;
  c.preempt_signals = t.preempt_signals;
  c.preempt_check_every = t.preempt_check_every;
  c.compression = t.compression;
  c.compression_warmup = t.compression_warmup;
  c.compression_on_engine = t.compression_on_engine;
  c.bucket_mb = t.bucket_mb;
  c.overlap = t.overlap;
  c.accumulate = t.accumulate;
  c.trace = t.trace;
  c.trace_steps = t.trace_steps;
  c.progress = t.progress;
  c.config_ini = config_ini(t);
  return c;
}

LmResult train_lm(const LmConfig& cfg_in, comm::Communicator* world_comm) {
  LmConfig cfg = cfg_in;
  if (cfg.seq_len <= 0) cfg.seq_len = cfg.model.context;
  DT_INPUT_CHECK(cfg.seq_len <= cfg.model.context,
                 "--seq-len " << cfg.seq_len << " exceeds the context " << cfg.model.context);
  DT_INPUT_CHECK(cfg.batch_size > 0 && cfg.steps > 0, "--batch-size and --steps must be positive");
  DT_INPUT_CHECK(world_comm || (cfg.tp == 1 && cfg.pp == 1), "--tp " << cfg.tp << " --pp " << cfg.pp << " need ranks");
  DT_INPUT_CHECK(cfg.pp >= 1 && cfg.pp <= cfg.model.layers,
                 "--pp " << cfg.pp << " must be between 1 and the " << cfg.model.layers << " layers");
  const int micro = cfg.pp == 1 ? 1 : static_cast<int>(cfg.micro_batches > 0 ? cfg.micro_batches : 2 * cfg.pp);
  DT_INPUT_CHECK(cfg.batch_size % micro == 0,
                 "--micro-batches " << micro << " must divide --batch-size " << cfg.batch_size);
  DT_INPUT_CHECK(cfg.accumulate >= 1, "option --accumulate must be >= 1, got " << cfg.accumulate);
  DT_INPUT_CHECK(cfg.accumulate == 1 || cfg.pp == 1,
                 "option --accumulate does not combine with --pp: a pipeline step already runs --micro-batches");
  DT_INPUT_CHECK(cfg.trace.empty() || world_comm, "option --trace needs the MPI runtime (run under dtrain train)");
  const parallel::PipelineSchedule schedule = parallel::pipeline_schedule_from_name(cfg.schedule);
  std::unique_ptr<parallel::ProcessGrid> grid;
  if (world_comm) grid = std::make_unique<parallel::ProcessGrid>(*world_comm, cfg.tp, cfg.pp);
  const int rank = world_comm ? world_comm->rank() : 0;
  const int dp_rank = grid ? grid->dp_rank() : 0, dp_size = grid ? grid->dp_size() : 1;
  const int tp_size = grid ? grid->tp_size() : 1, tp_rank = grid ? grid->tp_rank() : 0;
  const int pp_size = cfg.pp, stage = grid ? grid->pp_rank() : 0;
  const bool speak = rank == 0 && !cfg.quiet;
  if (cfg.threads > 0) cpu_engine().set_threads(cfg.threads);
  DT_INPUT_CHECK(cfg.device == "cpu" || cfg.device == "cuda", "--device " << cfg.device << " is not one of cpu, cuda");
  Device dev = Device::cpu();
  // The GPU checks look at this rank's host: the ranks agree on their outcome before any of them
  // creates the NCCL communicator, so a host short of GPUs fails every rank alike.
  auto pick_device = [&] {
    if (cfg.device != "cuda") return;
    DT_INPUT_CHECK(enable_cuda() > 0, "--device cuda: no GPU is visible, or this dtrain was built without CUDA");
    const int ranks = world_comm ? world_comm->size() : 1;
    DT_INPUT_CHECK(ranks == 1 || (cfg.tp == 1 && cfg.pp == 1),
                   "--device cuda runs the language model data parallel only (one GPU per rank); --tp and --pp run "
                   "on the CPU engine in this version");
    int gpu = 0;
    if (ranks > 1) {
      // One GPU per rank: the bootstrap bound local rank r to GPU r % count, and NCCL refuses two
      // ranks of a communicator on one GPU.
      const comm::Topology& topo = comm::Runtime::get().topology();
      DT_INPUT_CHECK(topo.local_size <= topo.cuda_device_count,
                     "--device cuda: " << topo.local_size << " ranks on host " << topo.host << " share "
                                       << topo.cuda_device_count << " GPU(s); data parallel on GPUs needs one per rank");
      DT_INPUT_CHECK(comm::nccl_compiled() || topo.cuda_aware_mpi,
                     "--device cuda with " << ranks
                                           << " ranks: this dtrain was built without NCCL and the MPI library is not "
                                              "CUDA-aware, so gradients cannot leave the GPU");
      gpu = std::max(0, topo.cuda_device);
    }
    DT_INPUT_CHECK(cfg.compression == "none" || cfg.compression.rfind("topk", 0) == 0,
                   "option --device cuda: --compression " << cfg.compression
                                                          << " runs on the CPU engine only in this version (topk runs "
                                                             "on the GPU)");
    dev = Device::cuda(gpu);
  };
  if (world_comm)
    comm::agree_on_inputs(*world_comm, pick_device);
  else
    pick_device();
  DT_INPUT_CHECK(cfg.precision == "fp32" || cfg.precision == "bf16" || cfg.precision == "fp16" ||
                     (!dev.is_cpu() && cfg.precision == "tf32"),
                 "--precision " << cfg.precision << " is not one of fp32, bf16, fp16" << (dev.is_cpu() ? "" : ", tf32")
                                << " for the language model on " << cfg.device);
  DT_INPUT_CHECK(cfg.loss_scale_interval >= 1, "option --loss-scale-interval must be >= 1");
  DT_INPUT_CHECK(cfg.loss_scale_init >= 1.f && cfg.loss_scale_init <= 16777216.f,
                 "option --loss-scale-init must be in [1, 2^24], got " << cfg.loss_scale_init);
  engine_for(dev).set_math_precision(math_precision_from_name(cfg.precision));
  // fp16: dynamic loss scaling (bf16 has fp32's exponent range and needs none).
  std::unique_ptr<optim::LossScaler> scaler =
      make_loss_scaler(cfg.precision, cfg.loss_scale_interval, cfg.loss_scale_init);

  // Every rank reads the token files itself (without a shared file system a node may lack them):
  // the ranks agree on the outcome, so a file one rank cannot read fails every rank naming it,
  // instead of leaving the others in the grid's first collective.
  data::TokenStream train, val;
  auto read_tokens = [&] {
    train = data::load_tokens((fs::path(cfg.data) / "train.h5").string());
    val = data::load_tokens((fs::path(cfg.data) / "val.h5").string());
    DT_INPUT_CHECK(train.vocab <= cfg.model.vocab, "the tokens need a vocabulary of " << train.vocab);
  };
  if (world_comm)
    comm::agree_on_inputs(*world_comm, read_tokens);
  else
    read_tokens();

  // Same seed on every rank: every tp layer draws the full weights and keeps its shard, every
  // stage draws the whole model and keeps its blocks, so the model equals the one-rank model.
  const std::vector<int> starts = pp_size > 1 ? stage_starts(cfg) : std::vector<int>{0, int(cfg.model.layers)};
  nn::GptPart part{starts[stage], starts[stage + 1], stage == 0, stage == pp_size - 1};
  // Under tensor parallelism the vocabulary is split too: embedding rows, logit columns, and the
  // cross-entropy over them.
  const nn::GptVocabShard vocab =
      tp_size > 1 ? parallel::vocab_parallel_shard(cfg.model.vocab, grid->tp()) : nn::GptVocabShard();
  // Under bf16/fp16 the activations the blocks' GEMMs read are held in 16 bits
  // (GptConfig::copy_gemm_inputs; the tensor-parallel blocks keep f32 references).
  nn::GptConfig model_cfg = cfg.model;
  model_cfg.copy_gemm_inputs = (cfg.precision == "bf16" || cfg.precision == "fp16") && tp_size == 1;
  nn::Gpt model(model_cfg,
                tp_size > 1 ? parallel::tensor_parallel_gpt_blocks(cfg.model.width, cfg.model.heads, grid->tp())
                            : nn::GptBlockFactory(),
                part, cfg.checkpoint_activations, vocab);
  model.to(dev);  // drawn on the host (the same numbers everywhere), trained where the engine is
  model.train();
  // The tied embedding lives on the first and the last stage: their gradients are summed.
  std::unique_ptr<comm::Communicator> tied;
  if (grid && pp_size > 1)
    tied = grid->world().split(
        stage == 0 || stage == pp_size - 1 ? dp_rank * tp_size + tp_rank : comm::Communicator::kNoColor, stage,
        "tied-embedding");
  nn::Parameter* tied_wte = model.embedding_wte() ? model.embedding_wte() : model.head_wte_copy();
  std::unique_ptr<parallel::DataParallel> ddp;
  std::unique_ptr<comm::Communicator> nccl;  // data parallel on GPUs
  if (dp_size > 1) {
    nccl = gpu_gradient_communicator(grid->dp(), dev, "lm-dp-nccl");
    parallel::DataParallelOptions dpo;
    dpo.bucket_bytes = static_cast<int64_t>(cfg.bucket_mb * 1048576.0);
    dpo.overlap = cfg.overlap;
    dpo.compression = cfg.compression;  // PowerSGD per tensor: matrices factorised, vectors sent whole
    dpo.compression_warmup_steps = cfg.compression_warmup >= 0 ? cfg.compression_warmup : cfg.warmup_steps;
    dpo.engine_topk = cfg.compression_on_engine;
    dpo.seed = derive_seed(cfg.seed, 77);
    dpo.device_stream = compute_stream_of(dev);
    ddp = std::make_unique<parallel::DataParallel>(model, nccl ? *nccl : grid->dp(), dpo);
    ddp->broadcast_state(0);
  }
  std::unique_ptr<parallel::PipelineStage> pipe;
  if (pp_size > 1) pipe = std::make_unique<parallel::PipelineStage>(model, grid->pp(), schedule, micro);
  // AdamW; as GPT-2 and nanoGPT, no weight decay on biases, LayerNorm gains and position table.
  optim::AdamOptions ao;
  ao.beta1 = cfg.beta1;
  ao.beta2 = cfg.beta2;
  ao.eps = cfg.eps;
  ao.decoupled = true;
  optim::Adam opt(optim::decay_groups(model.parameters(), cfg.weight_decay, {"wpe"}), ao);
  optim::ScheduleOptions so;
  so.kind = "cosine";
  so.base_lr = cfg.lr;
  so.min_lr = cfg.min_lr;
  so.total_steps = cfg.steps;
  so.warmup_steps = cfg.warmup_steps;
  optim::LrSchedule sched(so);
  // AdamW's moments by parameter name, for checkpoints: saved and loaded in the one-rank layout
  // like the parameters, so a run resumes in any layout.
  std::map<std::string, Tensor*> moments;
  for (const optim::StateTensor& st : opt.state()) moments[st.name] = st.value;
  auto moment = [&moments](std::string which) -> parallel::ParameterTensor {
    return [&moments, which](nn::Parameter& p) -> Tensor& { return *moments.at(p.name + which); };
  };
  const parallel::ParameterTensor value = [](nn::Parameter& p) -> Tensor& { return p.value; };
  comm::Communicator* tp_comm = grid ? &grid->tp() : nullptr;
  int64_t start_step = 0;
  std::string resumed_provenance;  // the checkpoint's, to say what this run changed
  std::string resume_note;         // what of the gradient compression state is not resumed
  // Every rank reads the checkpoint; one that cannot (a file its node does not see) fails them all.
  auto resume = [&] {
    if (cfg.resume.empty()) return;
    const std::string file = resolve_checkpoint(cfg.resume);
    try {
      CheckpointState st = load_gpt_checkpoint(file);
      auto g = st.int_lists.find("gpt");
      const std::vector<int64_t> want{cfg.model.vocab, cfg.model.context, cfg.model.layers, cfg.model.heads,
                                      cfg.model.width};
      DT_INPUT_CHECK(st.strings["model"] == "gpt" && g != st.int_lists.end() && g->second == want,
                     "its GPT (vocab, context, layers, heads, width) differs from this run's");
      std::map<std::string, Tensor> params, exp_avg, exp_avg_sq;
      auto ends = [](const std::string& n, const std::string& suffix) {
        return n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
      };
      for (auto& [name, t] : st.tensors) {
        if (name.rfind("param/", 0) == 0)
          params[name.substr(6)] = t;
        else if (name.rfind("optim/", 0) == 0 && ends(name, ".exp_avg_sq"))
          exp_avg_sq[name.substr(6, name.size() - 6 - 11)] = t;
        else if (name.rfind("optim/", 0) == 0 && ends(name, ".exp_avg"))
          exp_avg[name.substr(6, name.size() - 6 - 8)] = t;
      }
      DT_INPUT_CHECK(!exp_avg.empty() && !exp_avg_sq.empty(), "it holds no optimizer state");
      parallel::load_full(model, params, value);
      parallel::load_full(model, exp_avg, moment(".exp_avg"));
      parallel::load_full(model, exp_avg_sq, moment(".exp_avg_sq"));
      const bool same_layout = st.ints.count("tp") && st.ints.at("tp") == tp_size && st.ints.count("pp_stages") &&
                               st.ints.at("pp_stages") == pp_size;
      resume_note = load_compression_part(st, file, ddp.get(), rank, world_comm ? world_comm->size() : 1,
                                          cfg.compression, same_layout);
      start_step = st.ints.at("step");
      resumed_provenance = st.strings["provenance"];
      // AdamW's step count (bias correction) lags the run's by the steps fp16 skipped.
      const int64_t opt_steps = st.ints.count("optimizer_steps") ? st.ints.at("optimizer_steps") : start_step;
      opt.set_steps(opt_steps);
      if (scaler && st.tensors.count("meta/loss_scale"))
        scaler->set_state(st.tensors.at("meta/loss_scale").f32()[0], st.ints.at("loss_scale_good_steps"),
                          st.ints.at("loss_scale_skipped_steps"));
    } catch (const InputError& e) {
      DT_INPUT_CHECK(false, "--resume " << file << ": " << e.what());
    }
    DT_INPUT_CHECK(start_step < cfg.steps,
                   "--resume " << file << " is at step " << start_step << ", not before --steps " << cfg.steps);
    if (speak) {
      if (std::string changed = resume_changes(resumed_provenance, cfg.config_ini); !changed.empty())
        std::printf("%s\n", changed.c_str());
      if (!resume_note.empty()) std::printf("%s\n", resume_note.c_str());
      std::printf("resumed from %s at step %lld\n", file.c_str(), static_cast<long long>(start_step));
    }
  };
  if (world_comm)
    comm::agree_on_inputs(*world_comm, resume);
  else
    resume();

  std::unique_ptr<MetricsWriter> metrics;
  const JsonFields provenance =
      run_provenance(std::to_string(world_comm ? world_comm->size() : 1) + " rank(s): dp " + std::to_string(dp_size) +
                         " x tp " + std::to_string(tp_size) + " x pp " + std::to_string(pp_size),
                     cfg.config_ini);
  auto open_metrics = [&] {  // rank 0 only: the others learn of a failure through the agreement
    if (rank == 0 && !cfg.metrics.empty()) metrics = std::make_unique<MetricsWriter>(cfg.metrics, !cfg.resume.empty());  // a resumed run adds to its file
    if (metrics) metrics->write(provenance);
  };
  if (world_comm)
    comm::agree_on_inputs(*world_comm, open_metrics);
  else
    open_metrics();
  if (speak) {
    std::printf(
        "%s, %lld parameters on rank 0, dp %d x tp %d x pp %d, batch %lld x %lld tokens per dp rank, %lld train / "
        "%lld val tokens\n",
        model.kind().c_str(), static_cast<long long>(model.parameter_count()), dp_size, tp_size, pp_size,
        static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.seq_len),
        static_cast<long long>(train.tokens.size()), static_cast<long long>(val.tokens.size()));
    if (std::string note = engine_for(dev).precision_note(); !note.empty())
      std::printf("precision: %s\n", note.c_str());
    if (pp_size > 1) {
      std::printf("pipeline: %d stages, blocks per stage", pp_size);
      for (int s = 0; s < pp_size; ++s) std::printf("%s%d", s ? "," : " ", starts[s + 1] - starts[s]);
      std::printf(", %d micro-batches of %lld, %s schedule, ideal bubble %.1f %%\n", micro,
                  static_cast<long long>(cfg.batch_size / micro), parallel::pipeline_schedule_name(schedule),
                  100 * parallel::pipeline_ideal_bubble(pp_size, micro));
    }
  }

  const uint64_t data_seed = derive_seed(cfg.seed, static_cast<uint64_t>(dp_rank));  // each dp group its own windows
  std::unique_ptr<nn::SoftmaxCrossEntropy> xent_owner =
      tp_size > 1 ? std::make_unique<parallel::VocabParallelCrossEntropy>(grid->tp(), vocab.offset)
                  : std::make_unique<nn::SoftmaxCrossEntropy>();
  nn::SoftmaxCrossEntropy& xent = *xent_owner;
  LmResult res;
  double interval_loss = 0, t_interval = now_s(), t_start = now_s(), bubble_sum = 0;
  int64_t interval_steps = 0;
  // m: tokens of one micro-batch of --batch-size sequences; a step takes --accumulate of them.
  const int64_t m = cfg.batch_size * cfg.seq_len, mbs = cfg.batch_size / micro, step_tokens = m * cfg.accumulate;
  // Shares the last stage's number with every stage (a pipeline's loss is known there only).
  auto from_last_stage = [&](double v) {
    if (pp_size == 1) return v;
    Tensor t = Tensor::full({1}, stage == pp_size - 1 ? static_cast<float>(v) : 0.f);
    grid->pp().allreduce(t)->wait();
    return static_cast<double>(t.f32()[0]);
  };
  Progress progress(cfg.progress, speak);  // a bar with ETA on a terminal, plain lines otherwise
  auto validate = [&](int64_t step) {
    if (pp_size == 1) {
      res.val_loss = eval_stream(model, val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, xent, dev);
    } else {
      int64_t batches = data::window_count(val, cfg.seq_len) / cfg.batch_size;
      if (cfg.eval_batches > 0) batches = std::min(batches, cfg.eval_batches);
      DT_INPUT_CHECK(batches > 0, "the validation stream holds no batch of " << cfg.batch_size << " windows");
      nn::update_working_copies(model.parameters(), engine_for(dev).math_precision());
      model.eval();
      double sum = 0;
      std::vector<data::TokenBatch> vb(batches);
      pipe->forward_only(
          [&](int k) {
            vb[k] = data::sequential_windows(val, cfg.batch_size, cfg.seq_len, k * cfg.batch_size);
            return vb[k].ids;
          },
          [&](const Tensor& out, int k) {
            vb[k] = data::sequential_windows(val, cfg.batch_size, cfg.seq_len, k * cfg.batch_size);
            xent.forward(out, vb[k].targets.reshape({m}));
            sum += xent.last_loss_sum();
          },
          {cfg.batch_size, cfg.seq_len, cfg.model.width}, static_cast<int>(batches));
      model.train();
      res.val_loss = from_last_stage(sum / static_cast<double>(batches * m));
    }
    res.val_bpb = res.val_loss / std::log(2.0);
    if (speak) {
      char line[96];
      std::snprintf(line, sizeof line, "step %lld  val_loss %.4f  val_bpb %.4f", static_cast<long long>(step),
                    res.val_loss, res.val_bpb);
      progress.line(line);
      std::fflush(stdout);
    }
    if (metrics) metrics->write({{"step", step}, {"val_loss", res.val_loss}, {"val_bpb", res.val_bpb}});
  };
  // A checkpoint of step `step` (collective): parameters and AdamW moments gathered over tp into the
  // one-rank layout; rank 0 of each stage (dp 0, tp 0) writes its part, the other stages first, so
  // stage 0's file, written last, says the whole set is there. The newest keep_checkpoints stay.
  auto save = [&](int64_t step) {
    std::map<std::string, Tensor> full = parallel::gather_full(model, tp_comm, value);
    std::map<std::string, Tensor> m1 = parallel::gather_full(model, tp_comm, moment(".exp_avg"));
    std::map<std::string, Tensor> m2 = parallel::gather_full(model, tp_comm, moment(".exp_avg_sq"));
    const std::string file = checkpoint_file(cfg.checkpoint_dir, step);
    CheckpointState st = gpt_checkpoint_state(cfg.model, full, step);
    for (auto& [n, t] : m1) st.tensors["optim/" + n + ".exp_avg"] = t;
    for (auto& [n, t] : m2) st.tensors["optim/" + n + ".exp_avg_sq"] = t;
    st.strings["optimizer"] = "adamw";
    st.strings["provenance"] = to_json(provenance);
    st.ints["optimizer_steps"] = opt.steps();
    if (scaler) {
      st.tensors["meta/loss_scale"] = Tensor::from({1}, {scaler->scale()});
      st.ints["loss_scale_good_steps"] = scaler->good_steps();
      st.ints["loss_scale_skipped_steps"] = scaler->skipped_steps();
    }
    st.ints["pp_stage"] = stage;
    st.ints["pp_stages"] = pp_size;
    st.ints["first_block"] = starts[stage];
    st.ints["end_block"] = starts[stage + 1];
    st.ints["tp"] = tp_size;
    st.ints["dp"] = dp_size;
    // Each rank's gradient compression state first (parts before the main files).
    const bool parts = write_compression_parts(file, ddp.get(), world_comm, step, cfg.compression);
    st.ints["compression_ranks"] = parts ? (world_comm ? world_comm->size() : 1) : 0;
    st.strings["compression"] = cfg.compression;
    const bool writer = dp_rank == 0 && tp_rank == 0;
    // A file one writer cannot write fails every rank alike (agree_on_inputs): no rank is left
    // waiting for it in a collective. The agreements double as the barriers between the parts.
    auto agreed = [&](const std::function<void()>& fn) {
      if (grid)
        comm::agree_on_inputs(grid->world(), fn);
      else
        fn();
    };
    agreed([&] {
      if (writer && stage > 0) save_checkpoint(stage_part_file(file, stage), st);
    });
    agreed([&] {
      if (!writer || stage != 0) return;
      save_checkpoint(file, st);
      prune_checkpoints(cfg.checkpoint_dir, file, cfg.keep_checkpoints);
    });  // nobody runs ahead of a checkpoint that may fail
    if (!progress.bar()) progress.line("checkpoint " + file);
    return file;
  };
  auto draw = [&](int64_t step) {  // step s's windows, from its own stream (resumed runs see the same)
    Rng rng(derive_seed(data_seed, static_cast<uint64_t>(step)));
    return data::random_windows(train, cfg.batch_size * cfg.accumulate, cfg.seq_len, rng);
  };
  // On a GPU a batch goes through page-locked host buffers and the engine's copy stream: the next
  // step's windows are drawn and their upload queued before this step's forward, so the copy runs
  // beside this step's compute (stage_async / take_staged). Two slots alternate.
  struct Staged {
    StagedTensor ids, targets;
    bool ready = false;
  };
  Staged staged[2];
  auto stage_batch = [&](const data::TokenBatch& tb, Staged& st) {
    stage_async(tb.ids, dev, st.ids);
    stage_async(tb.targets, dev, st.targets);
    st.ready = true;
  };
  const std::vector<nn::Parameter*> step_params = model.parameters();
  const std::vector<nn::Parameter*>& opt_params = opt.params();  // each parameter once (a tied one too)
  int64_t step_mallocs = 0;  // cudaMalloc calls inside the steps after the first two (not validation)
  // On a GPU each step's loss stays on the device (a row of gpu_losses) until a log line, a
  // validation, a checkpoint or the end reads the rows since the last read, so no step waits for
  // its loss; the rows are read when they run out too. On the CPU the losses wait in cpu_losses.
  // Reading checks them: a non-finite loss or an out-of-range token stops every rank naming the
  // step, before a checkpoint could keep the diverged weights.
  Tensor gpu_losses;
  int64_t gpu_rows = 0;
  std::vector<double> cpu_losses;
  if (!dev.is_cpu())
    gpu_losses = zeros_on({cfg.log_every > 0 ? std::min<int64_t>(cfg.log_every, 256) : 64, kXentStatsFloats}, dev);
  // before_save: the weights about to be checkpointed are checked too (an overflowing update leaves
  // non-finite weights before any loss shows it).
  auto read_losses = [&](int64_t step_now, bool before_save) {
    const int64_t n = dev.is_cpu() ? static_cast<int64_t>(cpu_losses.size()) : gpu_rows;
    if (n == 0 && !before_save) return;  // the same on every rank: the steps are
    auto read = [&] {
      Tensor host;
      if (!dev.is_cpu() && n > 0) host = to_host(gpu_losses.slice0(0, n));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = step_now - n + i + 2;  // 1-based
        double loss = 0;
        if (dev.is_cpu()) {
          loss = cpu_losses[static_cast<size_t>(i)];
        } else {
          const XentStats st = xent_stats(host.slice0(i, i + 1).reshape({kXentStatsFloats}));
          DT_INPUT_CHECK(!st.bad_label,
                         "a target token of step " << at << " on rank " << rank << " is outside the vocabulary");
          loss = st.loss_sum / static_cast<double>(step_tokens);
        }
        check_finite_loss(loss, at, rank);
        interval_loss += loss;
        if (rank == 0) res.step_losses.push_back(loss);
      }
      if (before_save) check_finite_weights(model.parameters(), step_now + 1, rank);
    };
    if (world_comm)
      comm::agree_on_inputs(*world_comm, read);  // one rank's failed check fails every rank
    else
      read();
    if (n > 0 && !dev.is_cpu()) engine_for(dev).fill(gpu_losses, 0.f);
    gpu_rows = 0;
    cpu_losses.clear();
  };
  ChromeTrace trace(cfg.trace, rank, cfg.trace_steps);
  PreemptionGuard preemption(parse_signal_list(cfg.preempt_signals, "preempt-signals"));
  int64_t step_end = start_step;  // steps done: cfg.steps, or fewer when preempted
  for (int64_t step = start_step; step < cfg.steps; ++step) {
    const bool on_gpu = !dev.is_cpu();
    const int64_t mallocs0 = gpu_malloc_count(dev);
    data::TokenBatch b;
    const double t_data = now_s();
    if (!on_gpu) b = draw(step);
    trace.span("data wait", t_data, now_s(), step);
    opt.zero_grad();
    nn::update_working_copies(step_params, engine_for(dev).math_precision());  // the masters changed last step
    double step_loss = 0;
    const float loss_scale = scaler ? scaler->scale() : 1.f;  // fp16: the loss gradient is scaled up
    if (!pipe) {  // data parallel at most on a GPU (checked above)
      Tensor ids = b.ids, targets = b.targets;
      Tensor row;
      if (on_gpu) {
        Staged& st = staged[step % 2];
        if (!st.ready) stage_batch(draw(step), st);
        st.ready = false;
        if (step + 1 < cfg.steps) stage_batch(draw(step + 1), staged[(step + 1) % 2]);  // copied beside this step
        ids = take_staged(st.ids);
        targets = take_staged(st.targets);
        row = gpu_losses.slice0(gpu_rows, gpu_rows + 1).reshape({kXentStatsFloats});
        ++gpu_rows;
      }
      // --accumulate micro-batches of batch_size rows each; gradients are exchanged after the last.
      // Each loss is a mean over its tokens, so each gradient is scaled by 1/accumulate.
      const int64_t a = cfg.accumulate;
      const double ts = now_s();
      for (int64_t k = 0; k < a; ++k) {
        if (ddp) {
          ddp->set_step(step);
          ddp->begin_backward(k + 1 == a);
        }
        const Tensor x = a == 1 ? ids : ids.slice0(k * cfg.batch_size, (k + 1) * cfg.batch_size);
        const Tensor y = (a == 1 ? targets : targets.slice0(k * cfg.batch_size, (k + 1) * cfg.batch_size)).reshape({m});
        if (on_gpu)
          xent.accumulate(model.forward(x), y, row);  // the step's row sums every micro-batch's tokens
        else
          step_loss += xent.forward(model.forward(x), y) / static_cast<double>(a);
        model.backward(xent.backward(loss_scale / static_cast<float>(a)));
      }
      trace.span("forward+backward", ts, now_s(), step);
    } else {
      // Micro-batch k: rows [k*mbs, (k+1)*mbs) of the batch; each loss is a mean over its tokens, so
      // its gradient is scaled by 1/micro and the sum over micro-batches is the batch's gradient.
      double loss_sum = 0;
      const double ts = now_s();
      pipe->train_step([&](int k) { return b.ids.slice0(k * mbs, (k + 1) * mbs); },
                       [&](const Tensor& out, int k) {
                         loss_sum +=
                             xent.forward(out, b.targets.slice0(k * mbs, (k + 1) * mbs).reshape({mbs * cfg.seq_len}));
                         return xent.backward(loss_scale / static_cast<float>(micro));
                       },
                       {mbs, cfg.seq_len, cfg.model.width},
                       [&](int, bool last) {
                         if (!ddp) return;
                         ddp->set_step(step);
                         ddp->begin_backward(last);
                       });
      step_loss = from_last_stage(loss_sum / micro);
      bubble_sum += pipe->stats().bubble;
      trace.span("forward+backward", ts, now_s(), step);
    }
    const double t_comm = now_s();
    if (ddp) {
      ddp->finish();
      if (scaler || cfg.clip_grad_norm > 0) ddp->settle();  // the host reads the gradients next
    }
    if (tied) tied->allreduce(tied_wte->grad)->wait();  // the embedding's and the head's parts
    const double t_opt = now_s();
    trace.span("communication wait", t_comm, t_opt, step);
    // fp16: unscale and check the complete gradients; the ranks of a tp/pp grid hold different
    // parameters, so the verdict is agreed over the world (a step is taken everywhere or nowhere).
    const bool take_step = unscale_and_agree(scaler.get(), opt_params, grid ? &grid->world() : nullptr);
    if (take_step && cfg.clip_grad_norm > 0) {
      if (grid)
        parallel::clip_grad_norm_tp(model, grid->tp(), cfg.clip_grad_norm, pp_size > 1 ? &grid->pp() : nullptr,
                                    model.head_wte_copy());
      else
        optim::clip_grad_norm(model.parameters(), cfg.clip_grad_norm);
    }
    float lr = sched.lr(step);
    if (take_step) {
      opt.step(lr);
    }
    // On a GPU the optimizer step is now queued behind the exchange (an event); the host checks the
    // exchange before anything else can wait for the GPU, so a stuck peer times out naming the ranks.
    if (ddp) ddp->settle();
    trace.span("optimizer", t_opt, now_s(), step);
    trace.end_step();
    if (step >= start_step + 2) step_mallocs += gpu_malloc_count(dev) - mallocs0;
    if (on_gpu) {
      if (gpu_rows == gpu_losses.size(0)) read_losses(step, false);
    } else {
      cpu_losses.push_back(step_loss);
    }
    ++interval_steps;
    bool last = step + 1 == cfg.steps;
    const bool log_now = (cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || last;
    const bool validate_now = (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last;
    const bool save_now =
        !cfg.checkpoint_dir.empty() && cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0 && !last;
    if (log_now || validate_now || save_now) read_losses(step, save_now);
    if (log_now) {
      double dt = now_s() - t_interval;
      res.train_loss = interval_loss / static_cast<double>(interval_steps);
      double tps = static_cast<double>(interval_steps * step_tokens * dp_size) / dt;
      if (speak) {
        char stats[160];
        std::snprintf(stats, sizeof stats, "loss %.4f  lr %.2e  %.0f tokens/s", res.train_loss, lr, tps);
        std::string text = stats;
        if (scaler) {
          std::snprintf(stats, sizeof stats, "  loss scale %g  skipped %lld", static_cast<double>(scaler->scale()),
                        static_cast<long long>(scaler->skipped_steps()));
          text += stats;
        }
        if (progress.bar()) {
          const double per_step = (now_s() - t_start) / static_cast<double>(step + 1 - start_step);
          progress.update(1, 1, step + 1, cfg.steps, text, per_step * static_cast<double>(cfg.steps - step - 1));
        } else {
          progress.line("step " + std::to_string(step + 1) + "/" + std::to_string(cfg.steps) + "  " + text);
        }
      }
      if (metrics) {
        JsonFields line{{"step", step + 1}, {"loss", res.train_loss}, {"lr", static_cast<double>(lr)}, {"tokens_per_s", tps}};
        if (scaler) {
          line.push_back({"loss_scale", static_cast<double>(scaler->scale())});
          line.push_back({"skipped_steps", scaler->skipped_steps()});
        }
        metrics->write(line);
      }
      interval_loss = 0;
      interval_steps = 0;
      t_interval = now_s();
    }
    if (validate_now) validate(step + 1);
    if (save_now) save(step + 1);
    step_end = step + 1;
    // Preemption: a signal seen by any rank stops every rank after this same step, behind a
    // checkpoint (the last step's own checkpoint comes below).
    if (!last && (step + 1) % cfg.preempt_check_every == 0 &&
        (res.preempted_by = agree_on_preemption(grid ? &grid->world() : nullptr)) != 0) {
      if (!save_now) {
        read_losses(step, true);
        if (!cfg.checkpoint_dir.empty()) res.checkpoint = save(step + 1);
      }
      if (speak)
        std::printf("preempted by %s at step %lld: %s\n", signal_name(res.preempted_by).c_str(),
                    static_cast<long long>(step + 1),
                    cfg.checkpoint_dir.empty() ? "no --checkpoint-dir, nothing saved"
                                               : ("checkpoint written to " + cfg.checkpoint_dir).c_str());
      if (metrics)
        metrics->write({{"event", std::string("preempted")}, {"step", step + 1}, {"signal", signal_name(res.preempted_by)}});
      break;
    }
  }
  const double train_s = now_s() - t_start;
  if (world_comm) trace.write(*world_comm);  // collective; a part one rank cannot write fails every rank
  if (speak && !cfg.trace.empty())
    std::printf("trace of %d rank(s) written to %s\n", world_comm->size(), cfg.trace.c_str());
  const int64_t steps_run = step_end - start_step;
  res.steps = step_end;
  if (scaler) {
    res.loss_scale = scaler->scale();
    res.skipped_steps = scaler->skipped_steps();
  }
  res.tokens_per_s = static_cast<double>(steps_run * step_tokens * dp_size) / train_s;
  if (pipe) {
    res.pp_bubble = bubble_sum / static_cast<double>(std::max<int64_t>(steps_run, 1));
    res.pp_ideal_bubble = parallel::pipeline_ideal_bubble(pp_size, micro);
    res.pp_peak_activation_bytes = pipe->stats().peak_activation_bytes;
    // Every stage's figures, printed by rank 0 (world order is stage-major under one dp x tp).
    constexpr int kF = 4;
    Tensor all = Tensor::zeros({kF * pp_size});
    if (dp_rank == 0 && tp_rank == 0) {
      float* f = all.f32() + kF * stage;
      f[0] = static_cast<float>(res.pp_bubble);
      f[1] = static_cast<float>(res.pp_peak_activation_bytes / 1048576.0);
      f[2] = static_cast<float>(model.parameter_count());
      f[3] = static_cast<float>(peak_rss_mib());
    }
    grid->world().allreduce(all)->wait();
    for (int s = 0; s < pp_size; ++s) {
      const float* f = all.f32() + kF * s;
      if (speak)
        std::printf(
            "stage %d: blocks [%d, %d), %.0f parameters, measured bubble %.1f %% (ideal %.1f %%), peak "
            "activations %.1f MiB, peak RSS %.1f MiB\n",
            s, starts[s], starts[s + 1], f[2], 100 * f[0], 100 * res.pp_ideal_bubble, f[1], f[3]);
      if (metrics)
        metrics->write({{"pp_stage", s},
                        {"bubble", static_cast<double>(f[0])},
                        {"ideal_bubble", res.pp_ideal_bubble},
                        {"peak_activation_mib", static_cast<double>(f[1])},
                        {"peak_rss_mib", static_cast<double>(f[3])}});
    }
  }
  if (!cfg.checkpoint_dir.empty() && !res.preempted_by) res.checkpoint = save(step_end);
  if (metrics)
    metrics->write({{"summary", std::string("gpt")},
                    {"steps", res.steps},
                    {"val_loss", res.val_loss},
                    {"val_bpb", res.val_bpb},
                    {"tokens_per_s", res.tokens_per_s},
                    {"peak_rss_mib", peak_rss_mib()},
                    {"skipped_steps", res.skipped_steps}});
  if (speak) std::printf("%.0f tokens/s, peak RSS %.1f MiB (rank 0)\n", res.tokens_per_s, peak_rss_mib());
  if (speak && scaler)
    std::printf("fp16: loss scale %g, %lld of %lld steps skipped for inf/NaN gradients\n", res.loss_scale,
                static_cast<long long>(res.skipped_steps), static_cast<long long>(step_end));
  if (!dev.is_cpu() && steps_run > 2) res.gpu_step_mallocs = step_mallocs;
  if (const std::string gpu = gpu_memory_report(dev, steps_run, step_mallocs); speak && !gpu.empty())
    progress.line("GPU memory (rank 0, cuda:" + std::to_string(dev.index) + "): " + gpu);
  return res;
}

}  // namespace dtrain::train

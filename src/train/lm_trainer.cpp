// GPT language-model training on byte-token streams. One step: B random windows of T+1 tokens per
// rank -> Gpt forward -> mean softmax cross-entropy over B*T positions -> backward (gradients
// averaged over the dp ranks by DataParallel, started from the grad-ready hook) -> clip -> AdamW.
#include "dtrain/train/lm_trainer.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/text.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/optim/schedule.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/metrics.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

double eval_stream(nn::Gpt& model, const data::TokenStream& s, int64_t batch, int64_t t, int64_t max_batches) {
  int64_t windows = data::window_count(s, t);
  int64_t batches = windows / batch;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  DT_INPUT_CHECK(batches > 0, "the validation stream (" << s.tokens.size() << " tokens) holds no batch of " << batch
                                                        << " windows of " << t + 1 << " tokens");
  bool was_training = model.training();
  model.eval();
  nn::SoftmaxCrossEntropy xent;
  double sum = 0;
  for (int64_t k = 0; k < batches; ++k) {
    data::TokenBatch b = data::sequential_windows(s, batch, t, k * batch);
    xent.forward(model.forward(b.ids), b.targets.reshape({batch * t}));
    sum += xent.last_loss_sum();
  }
  model.train(was_training);
  return sum / static_cast<double>(batches * batch * t);
}

}  // namespace

double evaluate_lm(nn::Gpt& model, const std::string& val_file, int64_t batch, int64_t seq_len, int64_t max_batches) {
  data::TokenStream s = data::load_tokens(val_file);
  return eval_stream(model, s, batch, seq_len, max_batches);
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

LmResult train_lm(const LmConfig& cfg_in, comm::Communicator* world_comm) {
  LmConfig cfg = cfg_in;
  if (cfg.seq_len <= 0) cfg.seq_len = cfg.model.context;
  DT_INPUT_CHECK(cfg.seq_len <= cfg.model.context,
                 "--seq-len " << cfg.seq_len << " exceeds the context " << cfg.model.context);
  DT_INPUT_CHECK(cfg.batch_size > 0 && cfg.steps > 0, "--batch-size and --steps must be positive");
  DT_INPUT_CHECK(world_comm || cfg.tp == 1, "--tp " << cfg.tp << " needs that many ranks");
  std::unique_ptr<parallel::ProcessGrid> grid;
  if (world_comm) grid = std::make_unique<parallel::ProcessGrid>(*world_comm, cfg.tp, 1);
  const int rank = world_comm ? world_comm->rank() : 0;
  const int dp_rank = grid ? grid->dp_rank() : 0, dp_size = grid ? grid->dp_size() : 1;
  const int tp_size = grid ? grid->tp_size() : 1;
  const bool speak = rank == 0 && !cfg.quiet;
  if (cfg.threads > 0) cpu_engine().set_threads(cfg.threads);
  DT_INPUT_CHECK(cfg.precision == "fp32" || cfg.precision == "bf16",
                 "--precision " << cfg.precision << " is not one of fp32, bf16 for the language model");
  cpu_engine().set_math_precision(math_precision_from_name(cfg.precision));

  data::TokenStream train = data::load_tokens((fs::path(cfg.data) / "train.h5").string());
  data::TokenStream val = data::load_tokens((fs::path(cfg.data) / "val.h5").string());
  DT_INPUT_CHECK(train.vocab <= cfg.model.vocab, "the tokens need a vocabulary of " << train.vocab);

  // Same seed on every rank: every tp layer draws the full weights and keeps its shard, so the
  // model equals the one-rank model in any layout.
  nn::Gpt model(cfg.model, tp_size > 1
                               ? parallel::tensor_parallel_gpt_blocks(cfg.model.width, cfg.model.heads, grid->tp())
                               : nn::GptBlockFactory());
  model.train();
  std::unique_ptr<parallel::DataParallel> ddp;
  if (dp_size > 1) {
    ddp = std::make_unique<parallel::DataParallel>(model, grid->dp());
    ddp->broadcast_state(0);
  }
  // AdamW; as GPT-2 and nanoGPT, no weight decay on biases, LayerNorm gains and position table.
  std::vector<nn::Parameter*> decayed, plain;
  for (nn::Parameter* p : model.parameters()) (p->value.dim() >= 2 && p->name != "wpe" ? decayed : plain).push_back(p);
  optim::AdamOptions ao;
  ao.beta1 = 0.9f;
  ao.beta2 = 0.95f;
  ao.decoupled = true;
  ao.weight_decay = cfg.weight_decay;
  optim::Adam opt_decay(decayed, ao);
  ao.weight_decay = 0.f;
  optim::Adam opt_plain(plain, ao);
  optim::ScheduleOptions so;
  so.kind = "cosine";
  so.base_lr = cfg.lr;
  so.min_lr = cfg.min_lr;
  so.total_steps = cfg.steps;
  so.warmup_steps = cfg.warmup_steps;
  optim::LrSchedule sched(so);

  std::unique_ptr<MetricsWriter> metrics;
  if (rank == 0 && !cfg.metrics.empty()) metrics = std::make_unique<MetricsWriter>(cfg.metrics, false);
  if (speak)
    std::printf(
        "%s, %lld parameters on rank 0, dp %d x tp %d, batch %lld x %lld tokens per dp rank, %lld train / "
        "%lld val tokens\n",
        model.kind().c_str(), static_cast<long long>(model.parameter_count()), dp_size, tp_size,
        static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.seq_len),
        static_cast<long long>(train.tokens.size()), static_cast<long long>(val.tokens.size()));

  Rng rng(derive_seed(cfg.seed, static_cast<uint64_t>(dp_rank)));  // each dp group its own windows
  nn::SoftmaxCrossEntropy xent;
  LmResult res;
  double interval_loss = 0, t_interval = now_s(), t_start = now_s();
  int64_t interval_steps = 0;
  const int64_t m = cfg.batch_size * cfg.seq_len;
  auto validate = [&](int64_t step) {
    res.val_loss = eval_stream(model, val, cfg.batch_size, cfg.seq_len, cfg.eval_batches);
    res.val_bpb = res.val_loss / std::log(2.0);
    if (speak) {
      std::printf("step %lld  val_loss %.4f  val_bpb %.4f\n", static_cast<long long>(step), res.val_loss, res.val_bpb);
      std::fflush(stdout);
    }
    if (metrics) metrics->write({{"step", step}, {"val_loss", res.val_loss}, {"val_bpb", res.val_bpb}});
  };
  for (int64_t step = 0; step < cfg.steps; ++step) {
    data::TokenBatch b = data::random_windows(train, cfg.batch_size, cfg.seq_len, rng);
    opt_decay.zero_grad();
    opt_plain.zero_grad();
    if (ddp) ddp->begin_backward(true);
    interval_loss += xent.forward(model.forward(b.ids), b.targets.reshape({m}));
    model.backward(xent.backward());
    if (ddp) ddp->finish();
    if (cfg.clip_grad_norm > 0) {
      if (grid)
        parallel::clip_grad_norm_tp(model, grid->tp(), cfg.clip_grad_norm);
      else
        optim::clip_grad_norm(model.parameters(), cfg.clip_grad_norm);
    }
    float lr = sched.lr(step);
    opt_decay.step(lr);
    opt_plain.step(lr);
    ++interval_steps;
    bool last = step + 1 == cfg.steps;
    if ((cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || last) {
      double dt = now_s() - t_interval;
      res.train_loss = interval_loss / static_cast<double>(interval_steps);
      double tps = static_cast<double>(interval_steps * m * dp_size) / dt;
      if (speak) {
        std::printf("step %lld/%lld  loss %.4f  lr %.2e  %.0f tokens/s\n", static_cast<long long>(step + 1),
                    static_cast<long long>(cfg.steps), res.train_loss, lr, tps);
        std::fflush(stdout);
      }
      if (metrics)
        metrics->write(
            {{"step", step + 1}, {"loss", res.train_loss}, {"lr", static_cast<double>(lr)}, {"tokens_per_s", tps}});
      interval_loss = 0;
      interval_steps = 0;
      t_interval = now_s();
    }
    if ((cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last) validate(step + 1);
  }
  res.steps = cfg.steps;
  res.tokens_per_s = static_cast<double>(cfg.steps * m * dp_size) / (now_s() - t_start);
  if (!cfg.checkpoint_dir.empty()) {
    // Collective over tp: the shards are gathered into the one-rank layout, which loads anywhere.
    std::map<std::string, Tensor> full = parallel::gather_full_parameters(model);
    if (rank == 0) {
      res.checkpoint = (fs::path(cfg.checkpoint_dir) / ("ckpt-" + std::to_string(cfg.steps) + ".h5")).string();
      save_checkpoint(res.checkpoint, gpt_checkpoint_state(cfg.model, full, cfg.steps));
      if (speak) std::printf("checkpoint %s\n", res.checkpoint.c_str());
    }
  }
  if (metrics)
    metrics->write({{"summary", std::string("gpt")},
                    {"steps", res.steps},
                    {"val_loss", res.val_loss},
                    {"val_bpb", res.val_bpb},
                    {"tokens_per_s", res.tokens_per_s}});
  return res;
}

}  // namespace dtrain::train

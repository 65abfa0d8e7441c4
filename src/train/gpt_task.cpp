// The GPT task of the one loop: byte-token streams (dtrain convert text), each step B random
// windows of T+1 tokens per dp rank, the model cut over tp and pp (a stage is a Gpt over a part of
// it), mean cross-entropy per token (vocabulary-parallel under tp), validation loss and bits per byte.
#include "dtrain/train/lm_trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "dtrain/comm/runtime.h"
#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/text.h"
#include "dtrain/kernels/attention.h"
#include "dtrain/nn/model_file.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/import.h"
#include "dtrain/train/lm_names.h"
#include "dtrain/train/task.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

// Validation windows [first, first + rows) of `s`: consecutive windows of text, or one sample per
// window; `scored` grows by the targets that count (every one of text, the completions' of samples).
data::TokenBatch validation_windows(const data::TokenStream& s, int64_t first, int64_t rows, int64_t t,
                                    int64_t& scored) {
  if (!s.has_samples()) {
    scored += rows * t;
    return data::sequential_windows(s, rows, t, first);
  }
  std::vector<int64_t> samples(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) samples[static_cast<size_t>(i)] = first + i;
  int64_t trained = 0;
  data::TokenBatch b = data::sample_windows(s, samples, t, &trained);
  scored += trained;
  return b;
}

// Bytes of this process's resident set now (0 where /proc cannot tell).
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  return statm >> pages >> resident ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

// The windows one evaluation batch takes on the host: `batch`, or as many as fit in what this rank
// may still fill (the training's memory budget less the resident set other than the model's
// activation buffers, which the next pass reuses), from the activations and
// probabilities of one window measured by a one-window forward; said once when it splits. Not even
// one window fitting is an input error with the bytes. GPUs keep `batch` (an allocation there fails
// with an error instead of the out-of-memory killer).
int64_t eval_rows_that_fit(nn::Gpt& model, const data::TokenStream& s, int64_t batch, int64_t t, Device device,
                           bool head_scores, const MemoryBudget& budget) {
  if (budget.bytes <= 0 || batch <= 1 || device.type == DeviceType::CUDA) return batch;
  // What the process holds besides the model's activation buffers, which the next pass reuses.
  const int64_t others = resident_bytes() - model.activation_bytes();
  int64_t scored = 0;
  StagedTensor ids, targets;
  const data::TokenBatch one = validation_windows(s, 0, 1, t, scored);
  if (head_scores) model.score_next(stage_to(one.targets, device, targets).reshape({t}));
  const int64_t per_window = model.forward(stage_to(one.ids, device, ids)).nbytes() + model.activation_bytes();
  const int64_t left = budget.bytes - others;
  const auto mib = [](int64_t b) { return std::to_string(b >> 20) + " MiB"; };
  DT_INPUT_CHECK(per_window <= left, "evaluating one window of " << t << " tokens needs " << mib(per_window)
                                                                 << ", more than the " << mib(std::max<int64_t>(left, 0))
                                                                 << " this rank has left of " << budget.source);
  const int64_t rows = std::min(batch, left / per_window);
  static bool said = false;
  if (rows < batch && !said && comm::Runtime::get().topology().rank == 0) {
    said = true;
    std::fprintf(stderr,
                 "dtrain: evaluation batch of %lld windows of %lld tokens needs %s, more than the %s left of %s: "
                 "%lld windows at a time (the same loss)\n",
                 static_cast<long long>(batch), static_cast<long long>(t), mib(batch * per_window).c_str(),
                 mib(left).c_str(), budget.source.c_str(), static_cast<long long>(rows));
  }
  return rows;
}

// The mean loss per token over the first `windows` consecutive windows of `s`, `batch` at a time
// (the last batch holds what is left; fewer where `budget` says a batch would not fit); of a
// prompt/completion stream: over the completion tokens of its first `windows` samples, one per window.
// `head_scores`: the model's head scores the targets (then `xent` is a HeadCrossEntropy).
double eval_stream(nn::Gpt& model, const data::TokenStream& s, int64_t batch, int64_t t, int64_t windows,
                   nn::SoftmaxCrossEntropy& xent, bool head_scores, Device device, const MemoryBudget& budget) {
  DT_INPUT_CHECK(windows > 0,
                 "the validation stream (" << s.tokens.size() << " tokens) holds no window of " << t + 1 << " tokens");
  nn::update_working_copies(model.parameters(), engine_for(device).math_precision());
  bool was_training = model.training();
  model.eval();
  batch = eval_rows_that_fit(model, s, batch, t, device, head_scores, budget);
  StagedTensor ids, targets;                            // on a GPU: page-locked staging, reused by every batch
  Tensor stats = zeros_on({kXentStatsFloats}, device);  // summed on the device, read once
  int64_t scored = 0;
  for (int64_t first = 0; first < windows; first += batch) {
    const int64_t rows = std::min(batch, windows - first);
    const data::TokenBatch b = validation_windows(s, first, rows, t, scored);
    const Tensor labels = stage_to(b.targets, device, targets).reshape({rows * t});
    if (head_scores) model.score_next(labels);
    xent.accumulate(model.forward(stage_to(b.ids, device, ids)), labels, stats);
  }
  model.train(was_training);
  const XentStats st = xent_stats(to_host(stats));
  DT_INPUT_CHECK(!st.bad_label, "a token of the validation stream is outside the vocabulary");
  DT_INPUT_CHECK(scored > 0, "the validation samples hold no completion token within " << t + 1 << " tokens");
  return st.loss_sum / static_cast<double>(scored);
}

}  // namespace

double evaluate_lm(nn::Gpt& model, const std::string& val_file, int64_t batch, int64_t seq_len, int64_t max_batches) {
  return evaluate_lm(model, data::load_tokens(val_file), batch, seq_len, max_batches);
}

double evaluate_lm(nn::Gpt& model, const data::TokenStream& val, int64_t batch, int64_t seq_len, int64_t max_batches,
                   const MemoryBudget& budget) {
  const bool fused = nn::lm_head_fused();
  nn::HeadCrossEntropy scored;
  nn::SoftmaxCrossEntropy logits;
  return eval_stream(model, val, batch, seq_len, scored_windows(val, batch, seq_len, max_batches),
                     fused ? scored : logits, fused, Device::cpu(), budget);
}

int64_t scored_windows(const data::TokenStream& s, int64_t batch, int64_t seq_len, int64_t max_batches) {
  const int64_t all = s.has_samples() ? s.sample_count() : data::window_count(s, seq_len);
  return max_batches > 0 ? std::min(all, max_batches * batch) : all;
}

double bits_per_byte(const data::TokenStream& s, double nats_per_token, int64_t windows, int64_t seq_len) {
  const int64_t targets = windows * seq_len;
  const int64_t bytes = s.bytes_of(1, targets);
  return bytes > 0 ? nats_per_token * static_cast<double>(targets) / static_cast<double>(bytes) / std::log(2.0) : 0.0;
}

data::Tokenizer tokenizer_from_checkpoint(const CheckpointState& s, const std::string& where) {
  const auto name = s.strings.find("tokenizer");
  if (name == s.strings.end()) return data::Tokenizer();  // checkpoints from before BPE: bytes
  std::string model;
  if (const auto t = s.tensors.find("meta/tokenizer_model"); t != s.tensors.end()) {
    DT_INPUT_CHECK(t->second.dtype() == DType::U8, "'" << where << "': its tokenizer model is " << t->second.str());
    model.assign(t->second.data<char>(), static_cast<size_t>(t->second.numel()));
  }
  return data::Tokenizer::from_model(name->second, model, where);
}

nn::GptConfig lm_shape(const TrainConfig& c, int64_t vocab) {
  nn::GptConfig g;
  if (const auto file = c.model_file.empty()
                            ? std::nullopt
                            : nn::language_model_shape(nn::read_model_file(c.model_file), c.model_file)) {
    g = *file;  // the file's shape
  } else {
    g.context = c.context;
    g.layers = c.layers;
    g.heads = c.heads;
    g.width = c.width;
    g.kv_heads = c.kv_heads;
    g.mlp_width = c.mlp_width;
    if (c.model == "llama") {
      nn::llama_shape(g);
      g.rope_base = c.rope_base;
    }
  }
  g.vocab = vocab;
  g.seed = c.seed;
  g.lora_rank = c.lora_rank;
  g.lora_alpha = c.lora_alpha;
  g.lora_targets = c.lora_targets;
  return g;
}

void write_lm_shape(const nn::GptConfig& g, CheckpointState& s) {
  s.strings["model"] = g.llama() ? "llama" : "gpt";
  s.int_lists["gpt"] = {g.vocab, g.context, g.layers, g.heads, g.width};
  s.int_lists["lm_shape"] = {g.kv(), g.hidden(), g.rms_norm, g.rotary, g.swiglu, g.bias, g.tied};
  char base[32];
  std::snprintf(base, sizeof base, "%.9g", static_cast<double>(g.rope_base));
  s.strings["rope_base"] = base;
  if (g.lora_rank > 0) {
    s.ints["lora_rank"] = g.lora_rank;
    std::snprintf(base, sizeof base, "%.9g", static_cast<double>(g.lora_alpha));
    s.strings["lora_alpha"] = base;
    s.strings["lora_targets"] = g.lora_targets;
  }
}

nn::GptConfig read_lm_shape(const CheckpointState& s) {
  auto it = s.strings.find("model");
  DT_INPUT_CHECK(it != s.strings.end() && is_language_model(it->second),
                 "the checkpoint does not hold a language model (gpt or llama)");
  auto cfg_it = s.int_lists.find("gpt");
  DT_INPUT_CHECK(cfg_it != s.int_lists.end() && cfg_it->second.size() == 5, "the checkpoint lacks the gpt config");
  nn::GptConfig cfg;
  cfg.vocab = cfg_it->second[0];
  cfg.context = cfg_it->second[1];
  cfg.layers = cfg_it->second[2];
  cfg.heads = cfg_it->second[3];
  cfg.width = cfg_it->second[4];
  auto shape = s.int_lists.find("lm_shape");  // checkpoints from before the Llama family: GPT-2's
  if (shape == s.int_lists.end()) return cfg;
  const std::vector<int64_t>& v = shape->second;
  DT_INPUT_CHECK(v.size() == 7 && v[0] > 0 && v[1] > 0,
                 "the checkpoint's lm_shape " << shape_str(v) << " is not 7 sizes");
  cfg.kv_heads = v[0];
  cfg.mlp_width = v[1];
  cfg.rms_norm = v[2] != 0;
  cfg.rotary = v[3] != 0;
  cfg.swiglu = v[4] != 0;
  cfg.bias = v[5] != 0;
  cfg.tied = v[6] != 0;
  auto base = s.strings.find("rope_base");
  DT_INPUT_CHECK(base != s.strings.end(), "the checkpoint's lm_shape comes without its rope_base");
  cfg.rope_base = std::strtof(base->second.c_str(), nullptr);
  DT_INPUT_CHECK(!cfg.rotary || cfg.rope_base > 1.f, "the checkpoint's rope_base '" << base->second << "' is not > 1");
  if (const auto rank = s.ints.find("lora_rank"); rank != s.ints.end()) {
    const auto alpha = s.strings.find("lora_alpha"), targets = s.strings.find("lora_targets");
    DT_INPUT_CHECK(
        rank->second > 0 && rank->second <= cfg.width && alpha != s.strings.end() && targets != s.strings.end(),
        "the checkpoint's LoRA attributes (lora_rank " << rank->second << ", lora_alpha, lora_targets)");
    cfg.lora_rank = rank->second;
    cfg.lora_alpha = std::strtof(alpha->second.c_str(), nullptr);
    cfg.lora_targets = targets->second;
    DT_INPUT_CHECK(cfg.lora_alpha > 0.f, "the checkpoint's lora_alpha '" << alpha->second << "' is not > 0");
  }
  return cfg;
}

std::unique_ptr<nn::Gpt> gpt_from_checkpoint(const CheckpointState& s) {
  nn::GptConfig cfg = read_lm_shape(s);
  const auto cfg_it = s.int_lists.find("gpt");
  // The attributes size the model: it is built only when the checkpoint's tensors hold as many
  // parameters as they ask for (each then has to match in shape).
  const int64_t held = held_parameters(s);
  const int64_t wanted = nn::gpt_parameter_count(cfg);
  DT_INPUT_CHECK(wanted >= 0 && wanted <= held,
                 "the checkpoint's attribute gpt "
                     << shape_str(cfg_it->second) << " (vocab, context, layers, heads, width) asks for "
                     << (wanted < 0 ? std::string("non-positive sizes or more than 2^63") : std::to_string(wanted))
                     << " parameters; its tensors hold " << held);
  auto model = std::make_unique<nn::Gpt>(cfg);
  for (nn::Parameter* p : model->parameters()) {
    auto t = s.tensors.find("param/" + p->name);
    DT_INPUT_CHECK(
        t != s.tensors.end() && t->second.numel() == p->value.numel() && t->second.dtype() == p->value.dtype(),
        "the checkpoint lacks parameter " << p->name << " of " << p->value.str());
    p->value.copy_from(t->second);
  }
  return model;
}

namespace {

class GptTask final : public Task {
 public:
  void setup(const TaskSetup& s) override;
  void connect() override;
  nn::Module& model() override { return *model_; }
  std::string describe() override;
  std::string unit() const override { return "tokens"; }
  std::string piece() const override { return "blocks"; }
  std::vector<int> stage_starts() const override { return starts_; }
  parallel::StageShapes stage_shapes(int64_t rows) const override {
    return {{rows, seq_len_, model_cfg_.width}, {rows, seq_len_, model_cfg_.width}};
  }
  int64_t steps_per_epoch() const override { return 0; }
  void start_epoch(int64_t, int64_t) override { staged_.clear(); }
  // As GPT-2 and nanoGPT: no weight decay on biases, norm gains and the position table.
  std::vector<optim::ParamGroup> param_groups(const std::vector<nn::Parameter*>& params,
                                              float weight_decay) const override {
    return optim::decay_groups(params, weight_decay, {"wpe"});
  }
  bool prunable(const nn::Parameter& p) const override {  // the blocks' Linear weights, not the tables
    return p.value.dim() >= 2 && p.name.find("wte") == std::string::npos && p.name.find("wpe") == std::string::npos &&
           p.name != "lm_head";
  }
  bool load_step(int64_t step, double& wait_s) override;
  Tensor micro_input(int k, int parts) override { return micro_rows(ids_, k, parts); }
  void before_forward(int k, int parts) override {  // the last stage's head scores the targets itself
    if (!head_scores_) return;
    const Tensor targets = micro_rows(targets_, k, parts);
    model_->score_next(targets.reshape({targets.numel()}));
  }
  // With a teacher the statistics stay the next tokens' cross-entropy (the same quantity with and
  // without one); the gradient is the distillation loss's (on prompt/completion samples over the
  // completion tokens only).
  // Prompt/completion data: the mean over the step's completion tokens, the same whether the rows
  // are one batch, micro-batches or pipeline stages' (the prompts and padding add nothing).
  Tensor micro_loss(const Tensor& out, int k, int parts, Tensor& stats, float grad_scale) override {
    const Tensor targets = micro_rows(targets_, k, parts);
    xent_->accumulate(out, targets.reshape({targets.numel()}), stats);
    // The scale that turns a mean over the micro-batch's rows into the step's loss: over every
    // target, or over the step's completion tokens however the rows are cut.
    const bool samples = train_.has_samples();
    const float per = samples ? grad_scale * static_cast<float>(parts) * static_cast<float>(targets.numel()) /
                                    static_cast<float>(step_units())
                              : grad_scale;
    if (!teacher_) return xent_->backward(per);
    const float w = cfg_->distill_weight;
    Tensor grad = xent_->backward(per * (1.f - w));
    const Tensor teacher = teacher_->forward(micro_input(k, parts));
    const Tensor flat = targets.reshape({targets.numel()});
    engine_for(grad.device())
        .axpy(1.f, soft_targets_->gradient(out, teacher, per * w, samples ? &flat : nullptr), grad);
    return grad;
  }
  int64_t step_units() const override {  // tokens trained on: prompt/completion data's completions only
    if (!train_.has_samples()) return batch_ * cfg_->accumulate * seq_len_;
    int64_t n = 0;
    for (int64_t r : row_trained_) n += r;
    return std::max<int64_t>(n, 1);
  }
  std::string bad_label(int64_t step, int rank) const override {
    return "a target token of step " + std::to_string(step) + " on rank " + std::to_string(rank) +
           " is outside the vocabulary";
  }
  void after_exchange(parallel::DataParallel* dp) override {  // the embedding's and the head's parts
    if (!tied_ || tied_weight()->frozen) return;
    if (dp)
      dp->add_copy_gradients(*tied_weight(), *tied_);
    else
      tied_->allreduce(tied_weight()->grad)->wait();
  }
  const nn::Parameter* duplicate() const override { return model_->head_wte_copy(); }
  bool validation_due(int64_t step, bool epoch_end) const override {
    return epoch_end || (cfg_->eval_every > 0 && step % cfg_->eval_every == 0);
  }
  Validation validate(parallel::PipelineStage* pipe) override;
  void write_fields(CheckpointState& s) const override;
  void check_checkpoint(CheckpointState& s) const override;
  std::string init_from(const std::string& where) override {
    const auto files = list_safetensors(where);
    const PretrainedNames names = lm_pretrained_names(model_cfg_, files);
    const int64_t n = import_pretrained(*model_, where, names);
    return "initialised " + std::to_string(n) + " parameters from " + where + " (" + names.scheme + " names)";
  }
  ResumePoint resume_point(CheckpointState&, int64_t step) override {
    DT_INPUT_CHECK(step < cfg_->steps, "it is at step " << step << ", not before --steps " << cfg_->steps);
    return {0, step, ""};  // step s draws its windows from its own stream: nothing else to restore
  }

 private:
  nn::Parameter* tied_weight() const {
    return model_->embedding_wte() ? model_->embedding_wte() : model_->head_wte_copy();
  }
  std::vector<int> balanced_starts() const;
  // Step s's windows, from a stream seeded by (seed, dp rank, s): a resumed run sees the same.
  // Prompt/completion data: B samples drawn alike, one per window, targets -1 outside completions.
  std::pair<Tensor, Tensor> draw(int64_t step) const {
    Rng rng(derive_seed(data_seed_, static_cast<uint64_t>(step)));
    const int64_t rows = batch_ * cfg_->accumulate;
    if (!train_.has_samples()) {
      data::TokenBatch b = data::random_windows(train_, rows, seq_len_, rng);
      return {b.ids, b.targets};
    }
    std::vector<int64_t> samples(static_cast<size_t>(rows));
    for (int64_t& k : samples) k = static_cast<int64_t>(rng.below(static_cast<uint64_t>(train_.sample_count())));
    data::TokenBatch b = data::sample_windows(train_, samples, seq_len_);
    return {b.ids, b.targets};
  }
  double pipeline_val_loss(parallel::PipelineStage& pipe, int64_t windows);

  const TrainConfig* cfg_ = nullptr;
  parallel::ProcessGrid* grid_ = nullptr;
  Device device_ = Device::cpu();
  int64_t batch_ = 0, seq_len_ = 0;
  uint64_t data_seed_ = 0;
  data::TokenStream train_, val_;
  std::vector<int> starts_;
  nn::GptConfig model_cfg_;
  std::unique_ptr<nn::Gpt> model_;
  int64_t parameters_ = 0;  // this rank's part of the model, counted when it was made
  std::unique_ptr<nn::SoftmaxCrossEntropy> xent_;
  bool head_scores_ = false;  // the last stage's head scores its targets (nn::GptHead::score_next)
  std::unique_ptr<comm::Communicator> tied_;  // first and last stage: the tied embedding's gradient
  std::unique_ptr<nn::Gpt> teacher_;          // --teacher: whole on the last stage's ranks, forward only
  std::unique_ptr<parallel::VocabParallelSoftTargets> soft_targets_;
  void load_teacher(const nn::GptVocabShard& vocab);
  StagedSteps staged_;
  std::vector<Tensor> ids_, targets_;   // the loaded step, on the device
  std::vector<int64_t> row_trained_;    // its trained targets per row (prompt/completion data)
  std::vector<int64_t> trained_of_[2];  // those of the staged steps, by step parity as staged_
  // Draws `step` and stages it, counting each row's trained targets on the host as it is drawn.
  void stage(int64_t step) {
    const auto [ids, targets] = draw(step);
    std::vector<int64_t>& rows = trained_of_[step & 1];
    rows.assign(train_.has_samples() ? static_cast<size_t>(targets.size(0)) : 0, 0);
    for (int64_t i = 0; !rows.empty() && i < targets.numel(); ++i)
      rows[static_cast<size_t>(i / targets.size(1))] += targets.data<int32_t>()[i] >= 0;
    staged_.put(step, {{ids, targets}}, device_);
  }
};

void GptTask::setup(const TaskSetup& s) {
  cfg_ = &s.cfg;
  grid_ = &s.grid;
  device_ = s.device;
  const TrainConfig& c = s.cfg;
  batch_ = s.batch;
  model_cfg_ = lm_shape(c, 0);  // the vocabulary comes with the token files
  const int64_t context = model_cfg_.context, layers = model_cfg_.layers;
  seq_len_ = c.seq_len > 0 ? c.seq_len : context;
  DT_INPUT_CHECK(seq_len_ <= context, "--seq-len " << seq_len_ << " exceeds the context " << context);
  DT_INPUT_CHECK(c.pp <= layers, "--pp " << c.pp << " must be between 1 and the " << layers << " layers");
  DT_INPUT_CHECK(c.precision == "fp32" || c.precision == "bf16" || c.precision == "fp16" ||
                     (!s.device.is_cpu() && c.precision == "tf32"),
                 "--precision " << c.precision << " is not one of fp32, bf16, fp16"
                                << (s.device.is_cpu() ? "" : ", tf32") << " for the language model on " << c.device);
  // Every rank reads the token files itself (without a shared file system a node may lack them).
  train_ = data::load_tokens((fs::path(c.data) / "train.h5").string());
  val_ = data::load_tokens((fs::path(c.data) / "val.h5").string());
  DT_INPUT_CHECK(val_.tokenizer.name() == train_.tokenizer.name() && val_.tokenizer.model() == train_.tokenizer.model(),
                 "'" << c.data << "': train.h5 and val.h5 were made with different tokenizers");
  DT_INPUT_CHECK(c.vocab == 0 || train_.vocab <= c.vocab, "the tokens of '" << c.data << "' need a vocabulary of "
                                                                            << train_.vocab << ", not --vocab "
                                                                            << c.vocab << " (0: theirs)");
  DT_INPUT_CHECK(
      train_.has_samples() == val_.has_samples(),
      "'" << c.data
          << "': train.h5 and val.h5 must both be prompt/completion samples (dtrain convert sft) or both text");
  data_seed_ = derive_seed(c.seed, static_cast<uint64_t>(s.grid.dp_rank()));  // each dp group its own windows
  model_cfg_.vocab = c.vocab > 0 ? c.vocab : train_.vocab;
  starts_ = c.pp > 1 ? balanced_starts() : std::vector<int>{0, static_cast<int>(layers)};
  const int stage = s.grid.pp_rank(), tp = s.grid.tp_size();
  nn::GptPart part{starts_[stage], starts_[stage + 1], stage == 0, stage == c.pp - 1};
  // Under tensor parallelism the vocabulary is split too: embedding rows, logit columns, and the
  // cross-entropy over them.
  const nn::GptVocabShard vocab =
      tp > 1 ? parallel::vocab_parallel_shard(model_cfg_.vocab, s.grid.tp()) : nn::GptVocabShard();
  // Under bf16/fp16 the activations the blocks' GEMMs read are held in 16 bits
  // (GptConfig::copy_gemm_inputs; the tensor-parallel blocks keep f32 references).
  nn::GptConfig held = model_cfg_;
  held.copy_gemm_inputs = (c.precision == "bf16" || c.precision == "fp16") && tp == 1;
  held.sink = s.built;
  model_ = std::make_unique<nn::Gpt>(
      held, tp > 1 ? parallel::tensor_parallel_gpt_blocks(held, s.grid.tp()) : nn::GptBlockFactory(), part,
      c.checkpoint_activations, vocab);
  model_->to(device_);  // drawn on the host (the same numbers everywhere), trained where the engine is
  model_->train();
  // Before ZeRO-3 leaves the values empty between passes (built shard by shard: already).
  parameters_ = s.built ? s.built->parameter_count() : model_->parameter_count();
  // The head fused with its loss, unless distillation needs the student's whole logits.
  head_scores_ = part.head && c.teacher.empty() && nn::lm_head_fused();
  if (head_scores_)
    xent_ = std::make_unique<nn::HeadCrossEntropy>();
  else if (tp > 1)
    xent_ = std::make_unique<parallel::VocabParallelCrossEntropy>(s.grid.tp(), vocab.offset);
  else
    xent_ = std::make_unique<nn::SoftmaxCrossEntropy>();
  if (!c.teacher.empty() && stage == c.pp - 1) load_teacher(vocab);  // the stage of the student's logits
}

// The teacher of --teacher: a language model of the student's vocabulary and tokenizer, any shape.
void GptTask::load_teacher(const nn::GptVocabShard& vocab) {
  const std::string path = resolve_checkpoint(cfg_->teacher, "teacher");
  const CheckpointState s = load_checkpoint_set(path);
  DT_INPUT_CHECK(s.strings.count("model") && is_language_model(s.strings.at("model")),
                 "option --teacher: checkpoint '" << path << "' does not hold a language model");
  teacher_ = gpt_from_checkpoint(s);
  const data::Tokenizer tok = tokenizer_from_checkpoint(s, path);
  DT_INPUT_CHECK(teacher_->config().vocab == model_cfg_.vocab && tok.name() == train_.tokenizer.name() &&
                     tok.model() == train_.tokenizer.model(),
                 "option --teacher: checkpoint '" << path << "' has a vocabulary of " << teacher_->config().vocab
                                                  << " (" << tok.name() << "), the student " << model_cfg_.vocab << " ("
                                                  << train_.tokenizer.name()
                                                  << "): distillation needs the same tokens");
  teacher_->to(device_);
  teacher_->eval();
  teacher_->set_needs_input_grad(false);
  soft_targets_ =
      std::make_unique<parallel::VocabParallelSoftTargets>(grid_->tp(), vocab.offset, cfg_->distill_temperature);
}

// The tied embedding lives on the first and the last stage: their gradients are summed (an untied
// model's output layer is the last stage's own).
void GptTask::connect() {
  const int pp = grid_->pp_size(), stage = grid_->pp_rank();
  if (pp > 1 && model_cfg_.tied)
    tied_ = grid_->world().split(stage == 0 || stage == pp - 1 ? grid_->dp_rank() * grid_->tp_size() + grid_->tp_rank()
                                                               : comm::Communicator::kNoColor,
                                 stage, "tied-embedding");
}

// Which blocks each pipeline stage holds: given by --pp-split, or cut by cost (the embedding
// counts with the first block, the head with the last).
std::vector<int> GptTask::balanced_starts() const {
  const int layers = static_cast<int>(model_cfg_.layers);
  if (!cfg_->pp_split.empty()) return parallel::parse_pp_split(cfg_->pp_split, cfg_->pp, layers);
  nn::GptCosts k = nn::gpt_costs(model_cfg_, seq_len_);
  std::vector<double> costs(layers, k.block);
  costs.front() += k.embed;
  costs.back() += k.head;
  return parallel::balance_stages(costs, cfg_->pp);
}

std::string GptTask::describe() {
  std::ostringstream o;
  o << model_->kind() << ", " << parameters_ << " parameters on rank 0, batch " << batch_ << " x " << seq_len_
    << " tokens per dp rank, " << train_.tokens.size() << " train / " << val_.tokens.size()
    << " val tokens, attention " << attention_path(engine_for(device_));
  if (!cfg_->teacher.empty())
    o << ", teacher " << (teacher_ ? teacher_->kind() + " " : "") << "from " << cfg_->teacher
      << (teacher_ ? "" : " on the last stage") << ", T " << cfg_->distill_temperature << " weight "
      << cfg_->distill_weight;
  return o.str();
}

// On a GPU the next step's windows are drawn and their upload queued before this step's forward,
// so the copy runs beside this step's compute.
bool GptTask::load_step(int64_t step, double& wait_s) {
  const double t0 = now_s();
  if (!staged_.has(step)) stage(step);
  staged_.take(step, ids_, targets_);
  row_trained_ = std::move(trained_of_[step & 1]);
  if (!device_.is_cpu() && step + 1 < cfg_->steps) stage(step + 1);
  wait_s = now_s() - t0;
  return true;
}

Validation GptTask::validate(parallel::PipelineStage* pipe) {
  const int64_t windows = scored_windows(val_, batch_, seq_len_, cfg_->eval_batches);
  DT_INPUT_CHECK(windows > 0, "the validation stream (" << val_.tokens.size() << " tokens) holds no window of "
                                                        << seq_len_ + 1 << " tokens");
  Validation v;
  v.result.loss =
      pipe ? pipeline_val_loss(*pipe, windows)
           : eval_stream(*model_, val_, batch_, seq_len_, windows, *xent_, head_scores_, device_,
                         memory_per_rank(cfg_->memory_per_rank_mb, device_, comm::Runtime::get().topology().local_size));
  v.result.samples = windows;
  char line[80];
  if (val_.has_samples()) {  // nats per completion token; bits per byte would mix in the prompts
    std::snprintf(line, sizeof line, "val_loss %.4f (completion tokens)", v.result.loss);
    v.text = line;
    v.fields = {{"val_loss", v.result.loss}};
    return v;
  }
  const double bpb = bits_per_byte(val_, v.result.loss, windows, seq_len_);
  std::snprintf(line, sizeof line, "val_loss %.4f  val_bpb %.4f", v.result.loss, bpb);
  v.text = line;
  v.fields = {{"val_loss", v.result.loss}, {"val_bpb", bpb}};
  return v;
}

// The stages run the validation windows forwards only, whole batches then what is left; the last
// stage's loss is shared with all.
double GptTask::pipeline_val_loss(parallel::PipelineStage& pipe, int64_t windows) {
  nn::update_working_copies(model_->parameters(), engine_for(device_).math_precision());
  model_->eval();
  double sum = 0;
  int64_t scored = 0;  // on the last stage
  StagedTensor staged_labels;
  auto run = [&](int64_t first, int64_t rows, int64_t batches) {
    auto window = [&](int k, int64_t& count) {
      return validation_windows(val_, first + k * rows, rows, seq_len_, count);
    };
    int64_t not_counted = 0;
    Tensor labels;  // the last stage's, of the micro-batch in flight
    pipe.forward_only([&](int k) { return window(k, not_counted).ids; },
                      [&](const Tensor& out, int) {
                        xent_->forward(out, labels);
                        sum += xent_->last_loss_sum();
                      },
                      stage_shapes(rows), static_cast<int>(batches), [&](int k) {
                        if (!pipe.last()) return;
                        labels = stage_to(window(k, scored).targets, device_, staged_labels).reshape({rows * seq_len_});
                        if (head_scores_) model_->score_next(labels);
                      });
  };
  const int64_t whole = windows / batch_, rest = windows % batch_;
  if (whole > 0) run(0, batch_, whole);
  if (rest > 0) run(whole * batch_, rest, 1);
  model_->train();
  Tensor t =
      Tensor::from({2}, {pipe.last() ? static_cast<float>(sum) : 0.f, pipe.last() ? static_cast<float>(scored) : 0.f});
  grid_->pp().allreduce(t)->wait();
  DT_INPUT_CHECK(t.f32()[1] > 0,
                 "the validation samples hold no completion token within " << seq_len_ + 1 << " tokens");
  return t.f32()[0] / static_cast<double>(t.f32()[1]);
}

void GptTask::write_fields(CheckpointState& s) const {
  write_lm_shape(model_cfg_, s);
  s.strings["tokenizer"] = train_.tokenizer.name();
  if (const std::string& m = train_.tokenizer.model(); !m.empty()) {
    Tensor model = Tensor::empty({static_cast<int64_t>(m.size())}, DType::U8);
    std::copy(m.begin(), m.end(), model.data<char>());
    s.tensors["meta/tokenizer_model"] = model;
  }
  s.ints["first_block"] = starts_[grid_->pp_rank()];
  s.ints["end_block"] = starts_[grid_->pp_rank() + 1];
}

void GptTask::check_checkpoint(CheckpointState& s) const {
  CheckpointState mine;
  write_lm_shape(model_cfg_, mine);
  const nn::GptConfig theirs = read_lm_shape(s);
  DT_INPUT_CHECK(s.strings["model"] == mine.strings["model"] && s.int_lists["gpt"] == mine.int_lists["gpt"],
                 "its " << s.strings["model"] << " (vocab, context, layers, heads, width "
                        << shape_str(s.int_lists["gpt"]) << ") differs from this run's " << mine.strings["model"] << " "
                        << shape_str(mine.int_lists["gpt"]));
  CheckpointState again;
  write_lm_shape(theirs, again);
  DT_INPUT_CHECK(again.int_lists["lm_shape"] == mine.int_lists["lm_shape"] &&
                     again.strings["rope_base"] == mine.strings["rope_base"],
                 "its model's kv heads, MLP width, norm, positions, MLP kind, biases or tying ("
                     << shape_str(again.int_lists["lm_shape"]) << ", rope base " << again.strings["rope_base"]
                     << ") differ from this run's (" << shape_str(mine.int_lists["lm_shape"]) << ", "
                     << mine.strings["rope_base"] << ")");
  // The embeddings' rows mean the checkpoint's tokens: the data must be cut by the same tokenizer.
  const data::Tokenizer theirs_tok = tokenizer_from_checkpoint(s, "the checkpoint");
  const data::Tokenizer& ours = train_.tokenizer;
  const auto named = [](const data::Tokenizer& t) {
    return t.name() + (t.model().empty() ? "" : ", a model of " + std::to_string(t.model().size()) + " bytes");
  };
  DT_INPUT_CHECK(theirs_tok.name() == ours.name() && theirs_tok.model() == ours.model(),
                 "its tokenizer (" << named(theirs_tok) << ") is not the one of --data " << cfg_->data << " ("
                                   << named(ours)
                                   << (theirs_tok.name() == ours.name() ? ", another model" : "")
                                   << "): its embeddings would read other tokens");
}

}  // namespace

std::unique_ptr<Task> make_gpt_task() { return std::make_unique<GptTask>(); }

TrainResult train_lm(const TrainConfig& cfg, comm::Communicator* world) {
  comm::Runtime& rt = comm::Runtime::initialized() ? comm::Runtime::get() : comm::Runtime::init(nullptr, nullptr);
  return Trainer(cfg, rt, world).run();
}

}  // namespace dtrain::train

// Column- and row-parallel linear layers and the tensor-parallel GPT block.
#include "dtrain/parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dtrain/core/error.h"

namespace dtrain::parallel {

namespace {

// In place: the sum over the tp ranks (a no-op on one rank).
void allreduce_sum(comm::Communicator& c, Tensor& t) {
  if (c.size() > 1) c.allreduce(t, comm::ReduceOp::Sum)->wait();
}

}  // namespace

// ------------------------------------------------------------------ ColumnParallelLinear
namespace {

// The blocks of a column-parallel layer with their distinct slices: tp, or the block's units where
// it has fewer (each rank then holds one unit, replicated).
std::vector<std::pair<int64_t, int64_t>> column_blocks(std::vector<int64_t> rows, int64_t out, int64_t unit, int tp) {
  if (rows.empty()) rows = {out};
  std::vector<std::pair<int64_t, int64_t>> blocks;
  int64_t sum = 0;
  for (int64_t b : rows) {
    const int64_t units = unit > 0 && b % unit == 0 ? b / unit : b;
    const int64_t parts = std::min<int64_t>(units, tp);
    DT_INPUT_CHECK(b > 0 && units % parts == 0 && tp % parts == 0,
                   "ColumnParallelLinear: a block of " << b << " outputs in units of " << unit
                                                       << " neither splits over nor divides " << tp << " tp ranks");
    blocks.emplace_back(b, parts);
    sum += b;
  }
  DT_INPUT_CHECK(sum == out, "ColumnParallelLinear: blocks of " << sum << " outputs, not " << out);
  return blocks;
}

int64_t local_rows(const std::vector<std::pair<int64_t, int64_t>>& blocks) {
  int64_t n = 0;
  for (const auto& [rows, parts] : blocks) n += rows / parts;
  return n;
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, bool bias, Rng& rng, comm::Communicator& tp,
                                           std::vector<int64_t> blocks, int64_t unit,
                                           std::shared_ptr<comm::Communicator> share)
    : TensorParallelLinear(in, local_rows(column_blocks(blocks, out, unit, tp.size())), tp), full_out_(out) {
  DT_INPUT_CHECK(in > 0, "ColumnParallelLinear(" << in << ", " << out << ")");
  for (const auto& [rows, parts] : column_blocks(std::move(blocks), out, unit, tp.size())) {
    blocks_.push_back({rows, parts});
    if (parts == tp.size()) continue;
    DT_CHECK(share && share->size() == tp.size() / parts,
             kind() << ": a block replicated over " << tp.size() / parts << " ranks needs their communicator");
    share_ = share;
  }
  auto [w, b] = nn::Linear::init(in, out, bias, rng);  // the one-rank layer's draws, then this rank's rows
  set_parameters(w, b);
}

std::string ColumnParallelLinear::kind() const {
  return "ColumnParallelLinear(" + std::to_string(in_) + ", " + std::to_string(full_out_) +
         ", tp=" + std::to_string(tp_.size()) + ")";
}

int64_t ColumnParallelLinear::first_row(size_t k, int64_t start, int r) const {
  const Block& b = blocks_[k];
  return start + r / (tp_.size() / b.parts) * (b.rows / b.parts);
}

nn::Placement ColumnParallelLinear::output_rows(const Shape& full) const {
  DT_CHECK(!full.empty() && full[0] == full_out_, kind() << ": cannot place " << shape_str(full));
  std::vector<nn::TpPart> parts;
  for (int r = 0; r < tp_.size(); ++r) {
    nn::TpPart& t = parts.emplace_back();
    t.local = t.whole = full;
    t.local[0] = out_;
    t.columns = t.whole_columns = shape_numel(full) / full_out_;
    int64_t start = 0, at = 0;
    for (size_t k = 0; k < blocks_.size(); ++k) {
      const int64_t mine = blocks_[k].rows / blocks_[k].parts, copies = tp_.size() / blocks_[k].parts;
      t.rows.push_back({at, first_row(k, start, r), mine, r % copies == 0});
      start += blocks_[k].rows;
      at += mine;
    }
  }
  return nn::split_placement(std::move(parts), tp_.rank());
}

// The local GEMMs are nn::Linear's; d(x) = allreduce_tp(dy W_local): each rank's outputs depend on
// all of x, so d(x) is the sum of every rank's part.
Tensor ColumnParallelLinear::backward(const Tensor& dy) {
  Tensor dx = nn::Linear::backward(dy);
  if (!dx.defined()) return dx;
  engine(dy).synchronize();  // the allreduce reads dx from the host side of the engine's queue
  allreduce_sum(tp_, dx);
  return dx;
}

// Replicated rows: backward adds only this rank's query heads' part to their gradient. The rows
// accumulated so far are set aside and zeroed, so that the sum over the sharers adds up this
// backward's parts alone, then come back.
void ColumnParallelLinear::share_gradient(nn::Parameter& p, bool after) {
  if (!share_ || !p.placement.split() || p.frozen) return;
  Engine& e = engine(p.grad);
  const int64_t row = p.grad.numel() / out_;
  int64_t shared = 0;
  for (const Block& b : blocks_) shared += b.parts < tp_.size() ? b.rows / b.parts : 0;
  Tensor& aside = ensure_temp(set_aside_[&p], {shared, row}, p.grad.device());
  if (after) e.synchronize();
  int64_t at = 0, kept = 0;
  for (const Block& b : blocks_) {
    const int64_t mine = b.rows / b.parts;
    if (b.parts < tp_.size()) {
      Tensor rows = p.grad.reshape({out_, row}).slice0(at, at + mine);
      Tensor their = aside.slice0(kept, kept + mine);
      if (!after) {
        e.copy(rows, their);
        e.fill(rows, 0.f);
      } else {
        share_->allreduce(rows, comm::ReduceOp::Sum)->wait();
        e.axpy(1.f, their, rows);
      }
      kept += mine;
    }
    at += mine;
  }
}

// d(x A^T) = s dy B over this rank's output rows only: a part of the whole.
void ColumnParallelLinear::sum_lora_gradients(Tensor& dt) {
  engine(dt).synchronize();
  allreduce_sum(tp_, dt);
}

// ------------------------------------------------------------------ RowParallelLinear
RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, bool bias, Rng& rng, comm::Communicator& tp)
    : TensorParallelLinear(in / tp.size(), out, tp), full_in_(in) {
  DT_INPUT_CHECK(out > 0 && in % tp.size() == 0,
                 "RowParallelLinear(" << in << ", " << out << "): inputs must split over " << tp.size() << " tp ranks");
  auto [w, b] = nn::Linear::init(in, out, bias, rng);
  set_parameters(w, b);
}

std::string RowParallelLinear::kind() const {
  return "RowParallelLinear(" + std::to_string(full_in_) + ", " + std::to_string(out_) +
         ", tp=" + std::to_string(tp_.size()) + ")";
}

// The weight's and A's input columns of each rank (the bias and B stay whole).
nn::Placement RowParallelLinear::input_columns(const Shape& full) const {
  DT_CHECK(full.size() == 2 && full[1] == full_in_, kind() << ": cannot place " << shape_str(full));
  std::vector<nn::TpPart> parts;
  for (int r = 0; r < tp_.size(); ++r) {
    nn::TpPart& t = parts.emplace_back();
    t.local = t.whole = full;
    t.local[1] = in_;
    t.columns = in_;
    t.whole_columns = full_in_;
    t.first_column = r * in_;
    t.rows = {{0, 0, full[0], true}};
  }
  return nn::split_placement(std::move(parts), tp_.rank());
}

// x_local A_local^T: this rank's input columns' part of x A^T.
void RowParallelLinear::sum_lora_activations(Tensor& t) {
  engine(t).synchronize();
  allreduce_sum(tp_, t);
}

// y (M, out) = allreduce_tp(x_local (M, in/tp) . W_local^T) + b: the bias is added once, after the sum.
Tensor RowParallelLinear::forward(const Tensor& x) {
  Tensor& y = project(x);
  if (lora_a_) lora_forward(x, y);  // its part of the adapters' output too
  engine(x).synchronize();
  allreduce_sum(tp_, y);
  add_bias(y);
  return y;
}

// ------------------------------------------------------------------ GPT blocks
nn::GptBlockFactory tensor_parallel_gpt_blocks(const nn::GptConfig& cfg, comm::Communicator& tp) {
  nn::BlockLinears linears;
  linears.ranks = tp.size();
  // Key/value heads fewer than the tp ranks: the ranks that hold the same head share a communicator.
  std::shared_ptr<comm::Communicator> share;
  const int64_t kv = cfg.kv();
  if (kv < tp.size() && tp.size() % kv == 0)
    share = tp.split(static_cast<int>(tp.rank() / (tp.size() / kv)), tp.rank(), "tp-kv-heads");
  linears.column = [&tp, share](int64_t in, const std::vector<int64_t>& blocks, int64_t unit, bool bias,
                                Rng& rng) -> nn::ModulePtr {
    int64_t out = 0;
    for (int64_t b : blocks) out += b;
    return std::make_unique<ColumnParallelLinear>(in, out, bias, rng, tp, blocks, unit, share);
  };
  linears.row = [&tp](int64_t in, int64_t out, bool bias, Rng& rng) -> nn::ModulePtr {
    return std::make_unique<RowParallelLinear>(in, out, bias, rng, tp);
  };
  return [cfg, linears](int64_t layer, Rng& rng) { return nn::make_lm_block(cfg, rng, &linears, layer); };
}

nn::GptVocabShard vocab_parallel_shard(int64_t vocab, comm::Communicator& tp) {
  DT_INPUT_CHECK(vocab % tp.size() == 0, "vocabulary-parallel embedding: the vocabulary "
                                             << vocab << " must split over " << tp.size() << " tp ranks");
  nn::GptVocabShard s;
  s.rows = vocab / tp.size();
  s.offset = tp.rank() * s.rows;
  s.ranks = tp.size();
  s.sum = [&tp](Tensor& t) { tp.allreduce(t)->wait(); };
  s.max = [&tp](Tensor& t) { tp.allreduce(t, comm::ReduceOp::Max)->wait(); };
  return s;
}

// ------------------------------------------------------------------ vocabulary-parallel loss
VocabParallelCrossEntropy::VocabParallelCrossEntropy(comm::Communicator& tp, int64_t vocab_offset)
    : tp_(tp), offset_(vocab_offset) {}

float VocabParallelCrossEntropy::forward(const Tensor& logits, const Tensor& labels, int64_t* correct) {
  DT_CHECK(correct == nullptr, "vocabulary-parallel cross-entropy does not count argmax hits");
  Tensor stats = zeros_on({kXentStatsFloats}, logits.device());
  accumulate(logits, labels, stats);
  loss_sum_ = xent_stats(to_host(stats)).loss_sum;  // the caller asked for the figure: one sync
  return static_cast<float>(loss_sum_ / static_cast<double>(logits.size(0)));
}

// Local logits against the own rows of the vocabulary; the global row maxima, sums of exponentials
// and target logits by allreduces over tp, so the full logits never exist on one rank. The loss is
// added into `stats` on the logits' device.
void VocabParallelCrossEntropy::accumulate(const Tensor& logits, const Tensor& labels, Tensor& stats) {
  DT_CHECK(logits.dim() == 2 && labels.numel() == logits.size(0),
           "cross-entropy needs logits (N, V/tp) and N labels, got " << logits.str() << " and " << labels.str());
  const int64_t m = logits.size(0);
  logits_ = logits;
  labels_ = labels;
  Engine& e = engine_for(logits.device());
  if (!rowmax_.defined() || rowmax_.numel() != m || rowmax_.device() != logits.device()) {
    rowmax_ = Tensor::empty({m}, DType::F32, logits.device());
    partial_ = Tensor::empty({2, m}, DType::F32, logits.device());
  }
  e.row_max(logits, rowmax_);
  tp_.allreduce(rowmax_, comm::ReduceOp::Max)->wait();
  Tensor sumexp = partial_.slice0(0, 1).reshape({m}), target = partial_.slice0(1, 2).reshape({m});
  e.vocab_xent_partials(logits, labels, offset_, rowmax_, sumexp, target);
  tp_.allreduce(partial_)->wait();  // sums of exp and the target logit over the vocabulary slices
  e.vocab_xent_loss_accumulate(rowmax_, sumexp, target, labels, stats);
}

Tensor VocabParallelCrossEntropy::backward(float scale) {
  const int64_t m = logits_.size(0);
  if (!dlogits_.defined() || dlogits_.shape() != logits_.shape())
    dlogits_ = Tensor::empty(logits_.shape(), DType::F32, logits_.device());
  engine_for(logits_.device())
      .vocab_xent_backward(logits_, labels_, offset_, rowmax_, partial_.slice0(0, 1).reshape({m}),
                           scale / static_cast<float>(m), dlogits_);
  return dlogits_;
}

// ------------------------------------------------------------------ vocabulary-parallel distillation
VocabParallelSoftTargets::VocabParallelSoftTargets(comm::Communicator& tp, int64_t offset, float temperature)
    : tp_(tp), offset_(offset), t_(temperature) {
  DT_INPUT_CHECK(temperature > 0.f, "the distillation temperature must be > 0, got " << temperature);
}

Tensor VocabParallelSoftTargets::gradient(const Tensor& student, const Tensor& teacher, float scale,
                                          const Tensor* targets) {
  const int64_t m = student.size(0), n = student.size(1), tp = tp_.size();
  DT_CHECK(student.dim() == 2 && teacher.dim() == 2 && teacher.size(0) == m && teacher.size(1) == n * tp,
           "distillation: student logits " << student.str() << " (1/" << tp << " of the vocabulary), teacher's "
                                           << teacher.str());
  const Device dev = student.device();
  Engine& e = engine_for(dev);
  if (!x_.defined() || x_.shape() != student.shape() || x_.device() != dev) {
    x_ = Tensor::empty(student.shape(), DType::F32, dev);
    grad_ = Tensor::empty(student.shape(), DType::F32, dev);
    rowmax_ = Tensor::empty({m}, DType::F32, dev);
    sumexp_ = Tensor::empty({m}, DType::F32, dev);
    target_ = Tensor::empty({m}, DType::F32, dev);
    p_full_ = Tensor::empty(teacher.shape(), DType::F32, dev);
    p_split_ = Tensor::empty(teacher.shape(), DType::F32, dev);
    labels_ = Tensor::empty({m}, DType::I32, dev);
  }
  // A label no slice holds (no one-hot term below), or -1 on the rows without a trained target.
  const Tensor given = targets ? to_host(*targets) : Tensor();
  Tensor labels = Tensor::empty({m}, DType::I32);
  for (int64_t i = 0; i < m; ++i)
    labels.data<int32_t>()[i] =
        targets && given.data<int32_t>()[i] < 0 ? kIgnoreLabel : std::numeric_limits<int32_t>::max();
  copy_any(labels, labels_);
  e.copy(student, x_);
  e.scale(x_, 1.f / t_);
  e.row_max(x_, rowmax_);
  if (tp > 1) tp_.allreduce(rowmax_, comm::ReduceOp::Max)->wait();
  e.vocab_xent_partials(x_, labels_, offset_, rowmax_, sumexp_, target_);
  if (tp > 1) tp_.allreduce(sumexp_)->wait();
  const float k = scale * t_ / static_cast<float>(m);
  e.vocab_xent_backward(x_, labels_, offset_, rowmax_, sumexp_, k, grad_);  // k q
  e.softmax_rows(teacher, 1.f / t_, p_full_);
  Tensor mine = p_full_;
  if (tp > 1) {  // [rows, tp, N] -> [tp, rows, N]: this rank's columns are one contiguous block
    e.permute_0213(p_full_, 1, m, tp, n, p_split_);
    mine = p_split_.reshape({tp * m * n}).slice0(tp_.rank() * m * n, (tp_.rank() + 1) * m * n).reshape({m, n});
  }
  for (int64_t i = 0; i < m;) {  // the teacher's rows without a trained target: zero, run by run
    int64_t end = i;
    while (end < m && labels.data<int32_t>()[end] == kIgnoreLabel) ++end;
    if (end > i) {
      Tensor rows = mine.slice0(i, end);
      e.fill(rows, 0.f);
    }
    i = std::max(end, i + 1);
  }
  e.axpy(-k, mine, grad_);  // k (q - p)
  return grad_;
}

// ------------------------------------------------------------------ layouts and norms
std::map<std::string, Shape> full_parameter_shapes(nn::Module& model) {
  std::map<std::string, Shape> out;
  for (nn::Parameter* p : model.parameters()) out[p->name] = nn::whole_shape(*p);
  return out;
}

std::map<std::string, nn::TpPart> tp_parts(nn::Module& model, int tp_rank) {
  std::map<std::string, nn::TpPart> out;
  for (nn::Parameter* p : model.parameters()) out[p->name] = nn::tp_part(*p, tp_rank);
  return out;
}

std::map<std::string, Tensor> gather_full(nn::Module& model, comm::Communicator* tp, const ParameterTensor& pick,
                                          const NamedTensors* reuse, bool trained_only) {
  std::map<std::string, Tensor> full;
  for (nn::Parameter* p : model.parameters()) {  // the same order on every rank: the collectives match
    if (trained_only && p->frozen) continue;     // frozen alike on every tp rank
    const Tensor& t = pick(*p);
    if (!p->placement.split()) {  // a copy on the host (checkpoints are written from there)
      const auto old = reuse ? reuse->find(p->name) : NamedTensors::const_iterator{};
      full[p->name] = host_copy(t, reuse && old != reuse->end() ? &old->second : nullptr);
      continue;
    }
    const int64_t ranks = static_cast<int64_t>(p->placement.tp.size());
    DT_CHECK(tp || ranks == 1, "gather_full: " << p->name << " is split over tp ranks; pass the tp communicator");
    Tensor parts = Tensor::empty({ranks * t.numel()}, t.dtype());
    if (ranks > 1)
      tp->allgather(host_copy(t), parts)->wait();  // rank order
    else
      parts.copy_from(host_copy(t).reshape({t.numel()}));
    full[p->name] = nn::join_parts(p->placement, parts);
  }
  return full;
}

std::map<std::string, Tensor> gather_full_parameters(nn::Module& model, comm::Communicator* tp,
                                                     const NamedTensors* reuse) {
  return gather_full(
      model, tp, [](nn::Parameter& p) -> Tensor& { return p.value; }, reuse);
}

void load_full(nn::Module& model, const std::map<std::string, Tensor>& full, const ParameterTensor& pick,
               bool trained_only) {
  for (nn::Parameter* p : model.parameters()) {
    if (trained_only && p->frozen) continue;
    auto it = full.find(p->name);
    DT_INPUT_CHECK(it != full.end(), "no tensor for parameter " << p->name);
    Tensor& dst = pick(*p);
    const Shape whole = nn::whole_shape(*p);
    DT_INPUT_CHECK(it->second.numel() == shape_numel(whole) && it->second.dtype() == dst.dtype(),
                   "parameter " << p->name << ": " << it->second.str() << " does not fit " << shape_str(whole));
    const Tensor part = nn::own_part(p->placement, to_host(it->second).reshape(whole));
    DT_INPUT_CHECK(part.numel() == dst.numel(),
                   "parameter " << p->name << ": " << it->second.str() << " does not fit " << dst.str());
    copy_any(part, dst);
  }
}

void load_full_parameters(nn::Module& model, const std::map<std::string, Tensor>& full) {
  load_full(model, full, [](nn::Parameter& p) -> Tensor& { return p.value; });
}

double clip_grad_norm_tp(nn::Module& model, comm::Communicator& tp, double max_norm, comm::Communicator* pp,
                         const nn::Parameter* skip, DataParallel* dp, const std::vector<nn::Parameter*>& scaled) {
  double once = 0;
  for (nn::Parameter* p : model.parameters()) {
    if (p->frozen || (skip && p->name == skip->name)) continue;
    const std::vector<std::pair<int64_t, Tensor>> grads =
        dp ? dp->gradient_parts(*p).parts : std::vector<std::pair<int64_t, Tensor>>{{0, p->grad}};
    const nn::TpPart part = nn::tp_part(*p, tp.rank());
    for (const auto& [first, grad] : grads) {
      const Tensor flat = grad.reshape({grad.numel()});
      for (const auto& [lo, hi] : nn::written_elements(part, first, grad.numel()))
        once += engine_for(grad.device()).sum_squares(flat.slice0(lo - first, hi - first));
    }
  }
  const Device grad_device = scaled.empty() ? Device::cpu() : scaled.front()->grad.device();
  for (comm::Communicator* over : {dp ? dp->shard_group() : nullptr, &tp, pp}) {
    if (!over || over->size() == 1) continue;
    // On the host, or on the gradients' device for a communicator without host memory (NCCL).
    Tensor s = Tensor::empty({1}, DType::F32, over->supports(Device::cpu()) ? Device::cpu() : grad_device);
    copy_any(Tensor::from({1}, {static_cast<float>(once)}), s);
    over->allreduce(s)->wait();
    once = to_host(s).f32()[0];
  }
  const double norm = std::sqrt(once);
  if (max_norm > 0 && norm > max_norm) {
    const auto k = static_cast<float>(max_norm / (norm + 1e-6));
    for (nn::Parameter* p : scaled) engine_for(p->grad.device()).scale(p->grad, k);
  }
  return norm;
}

}  // namespace dtrain::parallel

// The process grid and tensor-parallel GPT under a real mpiexec: a GPT split over tp ranks (and
// data parallel over the rest) trains like the same GPT on one rank, step for step. The one-rank
// reference runs on every rank over a communicator of its own.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>

#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <cstdio>
#include <cstring>
#include "../train/lm_test_util.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/text.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/optim/optimizer.h"

#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/lm_trainer.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

// The part of a one-rank tensor that a tp rank holds for parameter `p` (its placement).
Tensor expected_shard(const nn::Parameter& p, const Tensor& full) { return nn::own_part(p.placement, to_host(full)); }

// max |got - want| <= tol * max(floor, max |want|); returns the left side over the scale.
double expect_rel_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                        double floor = 1e-12) {
  EXPECT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() != want.numel()) return 1.0;
  double diff = 0, scale = floor;
  for (int64_t i = 0; i < want.numel(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(got.f32()[i] - want.f32()[i])));
    scale = std::max(scale, static_cast<double>(std::abs(want.f32()[i])));
  }
  EXPECT_LE(diff / scale, tol) << what << ": max diff " << diff << " vs scale " << scale;
  return diff / scale;
}

using test::small_gpt;

// Trains `steps` SGD (momentum) steps of the GPT on a fixed sequence of batches, dp x tp x pp
// over the world (pp > 1: a pipeline of `micro` micro-batches under `schedule`), against the
// one-rank model on the whole batch, twice:
// - sync = false: two independent trajectories; the losses of every step and the parameters at
//   the end must agree.
// - sync = true: after every step the layout's parameters are set to the one-rank model's, so
//   each step's gradients are compared at the same point. Gradients of independent trajectories
//   are not compared: each step's rounding differences (tp sums partial products in another
//   order) move the parameters apart, and sums that nearly cancel, such as a LayerNorm bias's
//   gradient, turn 1e-7 differences in the parameters into 1e-5 in the gradient after 6-9 steps
//   on some processors, whatever the learning rate.
// (Not Adam: the key bias has an exactly zero gradient, softmax being shift-invariant, and Adam
// turns its rounding noise into full-size steps that differ between any two summation orders.)
// `head_scores`: the grid's last stage scores the targets in its head (GptHead::score_next), the
// reference takes its whole logits' cross-entropy.
void compare_grid_with_one_rank(const nn::GptConfig& cfg, bool sync, int tp, int pp, int steps,
                                parallel::PipelineSchedule schedule, int micro, bool head_scores = false) {
  parallel::ProcessGrid grid(world(), tp, pp);
  nn::Gpt ref(cfg);
  const int stage = grid.pp_rank();
  std::vector<int> starts = parallel::balance_stages(std::vector<double>(cfg.layers, 1.0), pp);
  nn::GptPart part{starts[stage], starts[stage + 1], stage == 0, stage == pp - 1};
  const nn::GptVocabShard vocab = tp > 1 ? parallel::vocab_parallel_shard(cfg.vocab, grid.tp()) : nn::GptVocabShard();
  nn::Gpt model(cfg, tp > 1 ? parallel::tensor_parallel_gpt_blocks(cfg, grid.tp()) : nullptr, part, false, vocab);
  std::map<std::string, nn::Parameter*> ref_params;
  for (nn::Parameter* p : ref.parameters()) ref_params[p->name] = p;
  if (pp == 1) {
    ASSERT_EQ(ref_params.size(), model.parameters().size());
  }
  for (nn::Parameter* p : model.parameters()) {
    ASSERT_TRUE(ref_params.count(p->name)) << p->name;
    expect_rel_close(p->value, expected_shard(*p, ref_params[p->name]->value), 0, "init " + p->name);
  }
  // The tied embedding: the first stage's and the last stage's copies add their gradients.
  std::unique_ptr<comm::Communicator> tied;
  if (pp > 1 && cfg.tied)
    tied = world().split(
        stage == 0 || stage == pp - 1 ? grid.dp_rank() * tp + grid.tp_rank() : comm::Communicator::kNoColor, stage,
        "tied");
  nn::Parameter* wte = model.embedding_wte() ? model.embedding_wte() : model.head_wte_copy();

  std::unique_ptr<parallel::DataParallel> ddp;
  if (grid.dp_size() > 1) ddp = std::make_unique<parallel::ReplicatedDataParallel>(model, grid.dp());
  std::unique_ptr<parallel::PipelineStage> pipe;
  if (pp > 1) pipe = std::make_unique<parallel::PipelineStage>(model, grid.pp(), schedule, micro);
  optim::SgdOptions so;
  so.momentum = 0.9f;
  so.weight_decay = 1e-4f;
  // LoRA: the base weights frozen, as the trainer freezes them; the optimizers hold the adapters.
  auto trained = [&](nn::Module& m) {
    std::vector<nn::Parameter*> out;
    for (nn::Parameter* p : m.parameters()) {
      p->frozen = cfg.lora_rank > 0 && !nn::is_lora_adapter(p->name);
      if (!p->frozen) out.push_back(p);
    }
    return out;
  };
  optim::SGD opt_ref(trained(ref), so), opt(trained(model), so);
  const int64_t per_rank = 4, t = 6, total = per_rank * grid.dp_size(), mbs = per_rank / micro;
  Rng data_rng(77);
  nn::SoftmaxCrossEntropy xent_ref;
  std::unique_ptr<nn::SoftmaxCrossEntropy> xent_owner =
      tp > 1 ? std::make_unique<parallel::VocabParallelCrossEntropy>(grid.tp(), vocab.offset)
             : std::make_unique<nn::SoftmaxCrossEntropy>();
  nn::HeadCrossEntropy head_xent;
  nn::SoftmaxCrossEntropy& xent = head_scores ? head_xent : *xent_owner;
  double worst_loss = 0, worst_grad = 0;
  for (int step = 0; step < steps; ++step) {
    Tensor ids = Tensor::empty({total, t}, DType::I32), tg = Tensor::empty({total * t}, DType::I32);
    for (int64_t i = 0; i < total * t; ++i) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(data_rng.below(40));
      tg.data<int32_t>()[i] = static_cast<int32_t>(data_rng.below(40));
    }
    opt_ref.zero_grad();
    // The reference sums the same micro-batches' gradients (one rank with gradient accumulation):
    // a pipeline changes where they are computed, not the arithmetic.
    float loss_ref = 0;
    const int64_t chunks = total / mbs;
    for (int64_t k = 0; k < chunks; ++k) {
      loss_ref +=
          xent_ref.forward(ref.forward(ids.slice0(k * mbs, (k + 1) * mbs)), tg.slice0(k * mbs * t, (k + 1) * mbs * t));
      ref.backward(xent_ref.backward(1.f / static_cast<float>(chunks)));
    }
    loss_ref /= static_cast<float>(chunks);
    // This dp rank's rows of the batch.
    Tensor my_ids = ids.slice0(grid.dp_rank() * per_rank, (grid.dp_rank() + 1) * per_rank).clone();
    Tensor my_tg = tg.slice0(grid.dp_rank() * per_rank * t, (grid.dp_rank() + 1) * per_rank * t).clone();
    opt.zero_grad();
    Tensor loss = Tensor::zeros({1});
    if (!pipe) {
      if (ddp) ddp->begin_backward(true);
      if (head_scores) model.score_next(my_tg);
      loss.f32()[0] = xent.forward(model.forward(my_ids), my_tg);
      model.backward(xent.backward());
    } else {
      float sum = 0;
      pipe->train_step([&](int k) { return my_ids.slice0(k * mbs, (k + 1) * mbs); },
                       [&](const Tensor& out, int k) {
                         sum += xent.forward(out, my_tg.slice0(k * mbs * t, (k + 1) * mbs * t));
                         return xent.backward(1.f / static_cast<float>(micro));
                       },
                       parallel::StageShapes{{mbs, t, cfg.width}, {mbs, t, cfg.width}},
                       [&](int, bool last) {
                         if (ddp) ddp->begin_backward(last);
                       },
                       [&](int k) {
                         if (head_scores && pipe->last()) model.score_next(my_tg.slice0(k * mbs * t, (k + 1) * mbs * t));
                       });
      if (pipe->last()) loss.f32()[0] = sum / static_cast<float>(micro);
      grid.pp().allreduce(loss)->wait();  // from the last stage to all
    }
    if (ddp) ddp->finish();
    if (tied) tied->allreduce(wte->grad)->wait();
    if (grid.dp_size() > 1) grid.dp().allreduce(loss, comm::ReduceOp::Avg)->wait();
    EXPECT_NEAR(loss.f32()[0], loss_ref, 1e-5 * std::abs(loss_ref)) << "step " << step;
    worst_loss = std::max(worst_loss, std::abs(double(loss.f32()[0]) - loss_ref) / std::abs(loss_ref));
    for (nn::Parameter* p : model.parameters()) {
      if (!sync) continue;
      const std::string what = "step " + std::to_string(step) + " gradient " + p->name;
      Tensor want = expected_shard(*p, ref_params[p->name]->grad);
      worst_grad = std::max(worst_grad, expect_rel_close(p->grad, want, 1e-5, what, 1e-3));
    }
    opt_ref.step(0.1f);
    opt.step(0.1f);
    if (sync)
      for (nn::Parameter* p : model.parameters())
        p->value.copy_from(expected_shard(*p, ref_params[p->name]->value));
  }
  if (world().rank() == 0 && sync)
    std::printf("%s tp %d pp %d: worst relative gradient difference over %d steps at the same parameters: %.2e\n",
                cfg.llama() ? "llama" : "gpt", tp, pp, steps, worst_grad);
  if (world().rank() == 0 && !sync)
    std::printf("%s tp %d pp %d: worst relative loss difference over %d independent steps: %.2e\n",
                cfg.llama() ? "llama" : "gpt", tp, pp, steps, worst_loss);
  // After the independent steps the rounding of every step has gone through momentum into the
  // weights (AMD EPYC's kernels: 1.4e-5 of wte's largest value after 10 steps, Xeon's less); the
  // per-step gradients above are held to 1e-5.
  if (!sync)
    for (nn::Parameter* p : model.parameters())
      expect_rel_close(p->value, expected_shard(*p, ref_params[p->name]->value), 5e-5,
                       "after training " + p->name);
}

void expect_grid_matches_one_rank(int tp, int pp, int steps,
                                  parallel::PipelineSchedule schedule = parallel::PipelineSchedule::OneFOneB,
                                  int micro = 1, const nn::GptConfig& cfg = small_gpt()) {
  for (bool sync : {true, false}) compare_grid_with_one_rank(cfg, sync, tp, pp, steps, schedule, micro);
}

// small_gpt's size as a Llama: RMSNorm, rotary positions, SwiGLU (hidden 48), 2 key/value heads
// for 4 query heads, no biases, an untied output layer.
nn::GptConfig small_llama() {
  nn::GptConfig c = small_gpt();
  c.kv_heads = 2;
  c.mlp_width = 48;
  nn::llama_shape(c);
  return c;
}

void expect_tp_matches_one_rank(int tp, int steps) { expect_grid_matches_one_rank(tp, 1, steps); }

}  // namespace

TEST(ProcessGrid, CoordinatesAndSubCommunicators) {
  const int n = world().size();
  for (auto [tp, pp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {1, 2}, {2, n / 2}, {n, 1}}) {
    if (n % (tp * pp) != 0) continue;
    parallel::ProcessGrid g(world(), tp, pp);
    EXPECT_EQ(g.dp_size() * g.tp_size() * g.pp_size(), n);
    EXPECT_EQ(g.rank_of(g.dp_rank(), g.tp_rank(), g.pp_rank()), world().rank());
    EXPECT_EQ(g.tp().size(), tp);
    EXPECT_EQ(g.pp().size(), pp);
    EXPECT_EQ(g.dp().size(), n / (tp * pp));
    EXPECT_EQ(g.tp().rank(), g.tp_rank());
    EXPECT_EQ(g.pp().rank(), g.pp_rank());
    EXPECT_EQ(g.dp().rank(), g.dp_rank());
    // The tp group sums exactly the world ranks that share this rank's (dp, pp) coordinates.
    Tensor t = Tensor::full({1}, static_cast<float>(world().rank()));
    g.tp().allreduce(t)->wait();
    float want = 0;
    for (int r = 0; r < tp; ++r) want += static_cast<float>(g.rank_of(g.dp_rank(), r, g.pp_rank()));
    EXPECT_EQ(t.f32()[0], want);
    Tensor u = Tensor::full({1}, static_cast<float>(world().rank()));
    g.pp().allreduce(u)->wait();
    want = 0;
    for (int r = 0; r < pp; ++r) want += static_cast<float>(g.rank_of(g.dp_rank(), g.tp_rank(), r));
    EXPECT_EQ(u.f32()[0], want);
  }
  EXPECT_THROW(parallel::ProcessGrid(world(), 3, 1), InputError);
}

TEST(TensorParallel, GptTp2MatchesOneRank) { expect_tp_matches_one_rank(2, 10); }

TEST(TensorParallel, GptTpOverAllRanksMatchesOneRank) {
  if (world().size() > 4) GTEST_SKIP() << "4 heads";
  expect_tp_matches_one_rank(world().size(), 10);
}

// Each parameter carries its placement over the tp ranks, and the gathers and the clipping norm
// read it: over tp = every rank, the Llama's (2 key/value heads: replicated past tp 2) gathered
// parameters equal the one-rank model's, and its norm (gradients set to the values) the one-rank
// norm. A split weight marked replicated (a wrong placement) fails both.
TEST(TensorParallel, PlacementIsWhatGathersAndTheNormRead) {
  if (world().size() > 4) GTEST_SKIP() << "4 heads";
  const nn::GptConfig cfg = small_llama();
  parallel::ProcessGrid grid(world(), world().size(), 1);
  nn::Gpt ref(cfg);
  const int tp = grid.tp_size();
  const nn::GptVocabShard vocab = tp > 1 ? parallel::vocab_parallel_shard(cfg.vocab, grid.tp()) : nn::GptVocabShard();
  nn::Gpt model(cfg, parallel::tensor_parallel_gpt_blocks(cfg, grid.tp()), nn::GptPart{0, cfg.layers, true, true},
                false, vocab);
  double squares = 0;
  for (nn::Parameter* p : ref.parameters()) squares += engine_for(p->value.device()).sum_squares(p->value);
  for (nn::Parameter* p : model.parameters()) p->grad.copy_from(p->value);
  auto gathered_match = [&] {
    const std::map<std::string, Tensor> full = parallel::gather_full_parameters(model, &grid.tp());
    bool same = true;
    for (nn::Parameter* p : ref.parameters()) {
      const Tensor& got = full.at(p->name);
      same = same && got.shape() == p->value.shape() &&
             std::memcmp(got.raw(), p->value.raw(), static_cast<size_t>(p->value.nbytes())) == 0;
    }
    return same;
  };
  auto norm_error = [&] {
    const double norm = parallel::clip_grad_norm_tp(model, grid.tp(), 0, nullptr, nullptr, nullptr, {});
    return std::abs(norm - std::sqrt(squares)) / std::sqrt(squares);
  };
  EXPECT_TRUE(gathered_match());
  EXPECT_LT(norm_error(), 1e-6);
  if (tp == 1) return;
  nn::Parameter* wrong = nullptr;  // the first block's fused q/k/v weight, split by output rows
  for (nn::Parameter* p : model.parameters())
    if (!wrong && p->placement.split() && p->value.dim() == 2 && p->name.starts_with("blocks.0.")) wrong = p;
  ASSERT_NE(wrong, nullptr);
  wrong->placement = nn::Placement{};
  EXPECT_FALSE(gathered_match()) << wrong->name << " marked replicated still gathers";
  EXPECT_GT(norm_error(), 1e-3) << wrong->name << " marked replicated still counts once";
}

namespace {
// A small text corpus converted to token shards in a fresh directory (rank 0 writes it).
std::filesystem::path make_corpus(const std::string& tag) {
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::filesystem::path dir = "/tmp/dtrain-" + tag + "-" + std::to_string(pid);
  if (world().rank() == 0) test::write_lm_corpus(dir, "the quick brown fox", 600);
  world().barrier();
  return dir;
}

// Prompt/completion samples of unequal lengths (120 records, 20 % held out) converted to token
// files in a fresh directory, dir/tok (rank 0 writes them).
std::filesystem::path make_sft_corpus(const std::string& tag) {
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const std::filesystem::path dir = "/tmp/dtrain-" + tag + "-" + std::to_string(pid);
  if (world().rank() == 0) {
    std::filesystem::create_directories(dir);
    std::ofstream out(dir / "data.jsonl");
    const char* names[] = {"red", "green and blue", "white", "a very dark black", "grey"};
    for (int i = 0; i < 120; ++i)
      out << "{\"prompt\": \"colour " << i % 7 << ": \", \"completion\": \"" << names[i % 5] << ".\"}\n";
    out.close();
    data::SftConvertOptions opt;
    opt.val_fraction = 0.2;
    data::convert_sft({(dir / "data.jsonl").string()}, (dir / "tok").string(), opt);
  }
  world().barrier();
  return dir;
}

// ZeRO 1, 2 and 3 with config `c` over the world: every step's loss and the validation equal
// `want`'s within 1e-5 (by default ZeRO-0's).
// `also` checks each run further (ZeRO-0's too when it runs here), given its stage.
void expect_zero_stages_match_zero0(train::TrainConfig c, const train::TrainResult* reference = nullptr,
                                    const std::function<void(const train::TrainResult&, int)>& also = {}) {
  c.zero = 0;
  const train::TrainResult want = reference ? *reference : train::train_lm(c, &world());
  if (also && !reference) also(want, 0);
  for (int zero : {1, 2, 3}) {
    c.zero = zero;
    const train::TrainResult got = train::train_lm(c, &world());
    if (also) also(got, zero);
    ASSERT_EQ(got.step_losses.size(), want.step_losses.size()) << "ZeRO-" << zero;
    for (size_t i = 0; i < want.step_losses.size(); ++i)
      EXPECT_NEAR(got.step_losses[i], want.step_losses[i], 1e-5 * want.step_losses[i])
          << "ZeRO-" << zero << " step " << i;
    EXPECT_NEAR(got.last_eval.loss, want.last_eval.loss, 1e-5 * want.last_eval.loss) << "ZeRO-" << zero;
  }
}
}  // namespace

// The language-model trainer with --tp 2 over the world gives the losses of one rank (dp groups
// draw their own windows, so the comparison runs at dp = 1), and its checkpoint, gathered into the
// one-rank layout, reloads on one rank to the same validation loss.
TEST(TensorParallel, LmTrainerTp2MatchesOneRankAndCheckpointReloads) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2, dp 1)";
  const std::filesystem::path dir = make_corpus("tp-lm");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  auto solo = world().split(world().rank(), 0, "solo");
  train::TrainResult ref = train::train_lm(c, solo.get());
  c.tp = 2;
  c.checkpoint_dir = (dir / "ckpt").string();
  train::TrainResult got = train::train_lm(c, &world());
  EXPECT_NEAR(got.train_loss, ref.train_loss, 1e-5 * ref.train_loss);
  EXPECT_NEAR(got.last_eval.loss, ref.last_eval.loss, 1e-5 * ref.last_eval.loss);
  if (world().rank() == 0) {
    auto one = train::gpt_from_checkpoint(train::load_checkpoint(got.checkpoint));
    double reloaded =
        train::evaluate_lm(*one, (dir / "tok" / "val.h5").string(), c.batch_size, c.context, c.eval_batches);
    EXPECT_NEAR(reloaded, got.last_eval.loss, 1e-5 * got.last_eval.loss);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// LoRA through the trainer at tp 2: the losses of one rank, the adapters' gathered checkpoint
// tensors (B's rows and A's columns joined from their parts) those of one rank, and the base
// weights untouched.
TEST(TensorParallel, LmTrainerLoraTp2MatchesOneRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2, dp 1)";
  const std::filesystem::path dir = make_corpus("tp-lora");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_llama());
  c.lora_rank = 2;
  c.lora_targets = "q,k,v,o,gate,up,down";
  c.lr = 2e-2f;
  auto solo = world().split(world().rank(), 0, "solo");
  c.checkpoint_dir = (dir / ("solo" + std::to_string(world().rank()))).string();
  train::TrainResult ref = train::train_lm(c, solo.get());
  c.tp = 2;
  c.checkpoint_dir = (dir / "tp2").string();
  train::TrainResult got = train::train_lm(c, &world());
  EXPECT_NEAR(got.train_loss, ref.train_loss, 1e-5 * ref.train_loss);
  EXPECT_NEAR(got.last_eval.loss, ref.last_eval.loss, 1e-5 * ref.last_eval.loss);
  if (world().rank() == 0) {
    const train::CheckpointState a = train::load_checkpoint(ref.checkpoint), b = train::load_checkpoint(got.checkpoint);
    int adapters = 0;
    for (const auto& [name, want] : a.tensors) {
      if (!name.starts_with("param/")) continue;
      const Tensor& have = b.tensors.at(name);
      ASSERT_EQ(have.shape(), want.shape()) << name;
      double diff = 0, scale = 1e-3;
      for (int64_t i = 0; i < want.numel(); ++i) {
        diff = std::max(diff, std::abs(double(have.f32()[i]) - want.f32()[i]));
        scale = std::max(scale, std::abs(double(want.f32()[i])));
      }
      EXPECT_LE(diff, 5e-5 * scale) << name;  // Adam's steps carry the rounding (AMD EPYC: 1.1e-5)
      adapters += nn::is_lora_adapter(name);
    }
    EXPECT_EQ(adapters, 2 * 4 * 4) << "A and B of the fused q/k/v, o, gate/up and down in 4 layers";
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// One key/value head at tp 2 through the trainer, clipping every step (the replicated head's
// squares counted once in the norm, by the rank that writes them): one rank's losses.
TEST(TensorParallel, LmTrainerKvHeadReplicatedTp2MatchesOneRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2, dp 1)";
  const std::filesystem::path dir = make_corpus("tp-kv");
  nn::GptConfig shape = small_llama();
  shape.kv_heads = 1;
  train::TrainConfig c = test::small_lm_config(dir / "tok", shape);
  c.clip_grad_norm = 0.05f;
  auto solo = world().split(world().rank(), 0, "solo");
  const train::TrainResult want = train::train_lm(c, solo.get());
  c.tp = 2;
  test::expect_lm_losses_match(train::train_lm(c, &world()), want, true);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// ZeRO within the data-parallel group of a tp 2 layout (at 4 ranks dp 2 x tp 2): every stage ends
// each step with the loss of tp 2 without ZeRO within 1e-5, with a clipping threshold low enough
// to clip every step (the norm then adds the optimizer's pieces over dp and tp, each element once);
// for a Llama whose one key/value head is replicated over tp, against the data-parallel ranks alone.
TEST(TensorParallel, ZeroStagesWithinTheDataParallelGroupMatchTp2) {
  const std::filesystem::path dir = make_corpus("tp-zero");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  c.tp = 2;
  c.lr = 3e-3f;
  c.clip_grad_norm = 0.05f;
  expect_zero_stages_match_zero0(c);
  // A Llama whose one key/value head is replicated over tp (each copy of its rows counted once)
  // against the same data-parallel ranks without tp.
  nn::GptConfig llama = small_llama();
  llama.kv_heads = 1;
  c = test::small_lm_config(dir / "tok", llama);
  c.lr = 3e-3f;
  c.clip_grad_norm = 0.05f;
  auto dp_group = world().split(world().rank() % 2, world().rank(), "dp");  // tp innermost
  const train::TrainResult without_tp = train::train_lm(c, dp_group.get());
  c.tp = 2;
  expect_zero_stages_match_zero0(c, &without_tp);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// LoRA under every ZeRO stage (the frozen base weights sharded with the rest under ZeRO-3; at 4
// ranks dp 2 x tp 2): every step's loss and the validation equal ZeRO-0's within 1e-5, and no stage
// holds gradients of the frozen weights: this rank's gradient memory (whole, shards and buffers)
// stays within 2x the one-rank model's adapters (the base weights' would be about 10x).
TEST(TensorParallel, LoraUnderZeroStagesMatchesDataParallel) {
  const std::filesystem::path dir = make_corpus("lora-zero");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_llama());
  c.tp = world().size() >= 4 ? 2 : 1;
  c.lora_rank = 2;
  c.lora_targets = "q,k,v,o,gate,up,down";
  c.lr = 2e-2f;
  const int64_t adapters = test::adapter_bytes(c, c.vocab);
  expect_zero_stages_match_zero0(c, nullptr, [&](const train::TrainResult& r, int zero) {
    EXPECT_GT(test::gradient_bytes(r), 0) << "ZeRO-" << zero;
    EXPECT_LE(test::gradient_bytes(r), 2 * adapters) << "ZeRO-" << zero << ": gradient bytes against the adapters'";
  });
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// ZeRO under a pipeline: each stage's parameters sharded over its data-parallel group (at 4 ranks
// pp 2 x dp 2); every step's loss and the validation equal ZeRO-0's within 1e-5, for the Llama and
// for GPT-2's tied embedding (its copies' gradients, each spread over its stage's shards, summed
// between the first and last stage), clipping every step. A tied ZeRO-3 set written at step 5 is
// every rank's shard part (the last stage leaves out its copy of the embedding) beside stage files
// without parameters, and continues at ZeRO-3 (each rank's pieces, the copy's from the first
// stage's) and at ZeRO-0 where the ZeRO-3 run goes on.
TEST(Pipeline, ZeroStagesPerStageMatchDataParallel) {
  const std::filesystem::path dir = make_corpus("pp-zero");
  for (const nn::GptConfig& model : {small_llama(), small_gpt()}) {
    SCOPED_TRACE(model.llama() ? "llama" : "gpt");
    train::TrainConfig c = test::small_lm_config(dir / "tok", model);
    c.pp = 2;
    c.lr = 1e-2f;
    c.clip_grad_norm = 0.05f;  // every step: the norm adds the pieces over dp and the stages
    expect_zero_stages_match_zero0(c);
  }
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  c.pp = 2;
  c.zero = 3;
  c.checkpoint_every = 5;
  c.checkpoint_dir = (dir / "zero3").string();
  const train::TrainResult straight = train::train_lm(c, &world());
  const std::string set = (dir / "zero3" / "ckpt-step000000005.h5").string();
  for (const std::string& f : {set, train::stage_part_file(set, 1)})
    for (const auto& [name, t] : train::load_checkpoint(f).tensors)
      EXPECT_FALSE(name.starts_with("param/") || name.starts_with("optim/")) << name << " is in " << f;
  EXPECT_TRUE(std::filesystem::exists(train::shard_part_file(set, world().size() - 1)));
  c.checkpoint_dir.clear();
  c.resume = set;
  for (int zero : {3, 0}) {
    c.zero = zero;
    const train::TrainResult resumed = train::train_lm(c, &world());
    if (world().rank() != 0) continue;
    ASSERT_EQ(resumed.step_losses.size(), 5u);
    for (size_t i = 0; i < 5; ++i)
      EXPECT_NEAR(resumed.step_losses[i], straight.step_losses[5 + i], 1e-5 * straight.step_losses[5 + i])
          << "resumed at ZeRO-" << zero << ", step " << 5 + i;
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// A ZeRO-3 set written under tp 2 (at 4 ranks dp 2 x tp 2) is every rank's shard part: the main
// file holds no parameters or optimizer state, row-parallel pieces are written as several runs of
// the one-rank tensor, and the parts assemble into the tensors that ZeRO-0 gathers into its set
// (within 1e-5). For a Llama whose one key/value head is replicated over tp (its rows written by
// one of the two ranks) and for GPT-2 (biases, a vocabulary-parallel tied embedding). The set
// resumes at ZeRO-3 and ZeRO-0 under tp 2, and at ZeRO-3 without tp over the same data-parallel
// ranks, each continuing the uninterrupted run's losses within 1e-5.
TEST(TensorParallel, ZeroSetUnderTpIsEveryRanksPiecesAndResumesWithoutTp) {
  const std::filesystem::path dir = make_corpus("tp-zero-set");
  nn::GptConfig llama = small_llama();
  llama.kv_heads = 1;
  for (const nn::GptConfig& model : {llama, small_gpt()}) {
    SCOPED_TRACE(model.llama() ? "llama" : "gpt");
    train::TrainConfig c = test::small_lm_config(dir / "tok", model);
    c.tp = 2;
    c.clip_grad_norm = 0;
    c.checkpoint_every = 5;
    c.checkpoint_dir = (dir / "gathered").string();
    train::train_lm(c, &world());
    c.zero = 3;
    c.checkpoint_dir = (dir / "zero3").string();
    const train::TrainResult straight = train::train_lm(c, &world());
    const std::string set = (dir / "zero3" / "ckpt-step000000005.h5").string();
    if (world().rank() == 0) {
      for (const auto& [name, t] : train::load_checkpoint(set).tensors)
        EXPECT_FALSE(name.starts_with("param/") || name.starts_with("optim/")) << name << " is in the main file";
      bool runs = false;
      for (int r = 0; r < world().size(); ++r)
        for (const auto& [name, t] : train::load_checkpoint(train::shard_part_file(set, r)).tensors)
          runs = runs || name.starts_with("runs/");
      EXPECT_TRUE(runs) << "no piece was written as several runs of its tensor";
      const train::CheckpointState pieces = train::load_checkpoint_set(set);
      const train::CheckpointState gathered =
          train::load_checkpoint_set((dir / "gathered" / "ckpt-step000000005.h5").string());
      int compared = 0;
      for (const auto& [name, want] : gathered.tensors) {
        if (!name.starts_with("param/") && !name.starts_with("optim/")) continue;
        const auto it = pieces.tensors.find(name);
        if (it == pieces.tensors.end() || it->second.shape() != want.shape()) {
          ADD_FAILURE() << name << " is missing from the shard parts or misshapen";
          continue;
        }
        double diff = 0, scale = 1e-3;
        for (int64_t i = 0; i < want.numel(); ++i) {
          diff = std::max(diff, std::abs(double(it->second.f32()[i]) - want.f32()[i]));
          scale = std::max(scale, std::abs(double(want.f32()[i])));
        }
        EXPECT_LE(diff, 1e-5 * scale) << name;
        ++compared;
      }
      EXPECT_GT(compared, 0);
    }
    c.checkpoint_dir.clear();
    c.resume = set;
    auto continues = [&](const train::TrainResult& resumed, const std::string& how) {
      ASSERT_EQ(resumed.step_losses.size(), 5u) << how;
      for (size_t i = 0; i < 5; ++i)
        EXPECT_NEAR(resumed.step_losses[i], straight.step_losses[5 + i], 1e-5 * straight.step_losses[5 + i])
            << how << ", step " << 5 + i;
    };
    for (int zero : {3, 0}) {
      c.zero = zero;
      continues(train::train_lm(c, &world()), "resumed under tp 2 at ZeRO-" + std::to_string(zero));
    }
    c.zero = 3;
    c.tp = 1;
    auto dp_group = world().split(world().rank() % 2, world().rank(), "dp");  // tp innermost: one tp rank's dp group
    continues(train::train_lm(c, dp_group.get()), "resumed without tp at ZeRO-3");
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir / "zero3"), std::filesystem::remove_all(dir / "gathered");
    world().barrier();
  }
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// --shard-scope node at ZeRO-3 on 2 nodes of 2 ranks (the DTRAIN_TEST_RANKS_PER_NODE hook): the
// GPT is built in its node's blocks (a mismatch with the node's shard group stops the set-up) and
// every step's loss equals plain data parallel's within 1e-5; its checkpoint set resumes in node
// scope and at ZeRO-0 to the same losses.
TEST(TensorParallel, ZeroShardScopeNodeBuildsTheGptInNodeBlocks) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks (2 emulated nodes of 2)";
  const std::filesystem::path dir = make_corpus("node-zero");
  ::setenv("DTRAIN_TEST_RANKS_PER_NODE", "2", 1);
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  const train::TrainResult want = train::train_lm(c, &world());
  c.zero = 3;
  c.shard_scope = "node";
  c.checkpoint_every = 5;
  c.checkpoint_dir = (dir / "node").string();
  const train::TrainResult got = train::train_lm(c, &world());
  ASSERT_EQ(got.step_losses.size(), want.step_losses.size());
  for (size_t i = 0; i < want.step_losses.size(); ++i)
    EXPECT_NEAR(got.step_losses[i], want.step_losses[i], 1e-5 * want.step_losses[i]) << "step " << i;
  // Its set (the first node's ranks write the pieces; the other node's are the same) resumes in
  // node scope and at ZeRO-0.
  c.checkpoint_dir.clear();
  c.resume = (dir / "node" / "ckpt-step000000005.h5").string();
  for (int zero : {3, 0}) {
    c.zero = zero;
    c.shard_scope = zero == 3 ? "node" : "all";
    const train::TrainResult resumed = train::train_lm(c, &world());
    ASSERT_EQ(resumed.step_losses.size(), 5u) << "ZeRO-" << zero;
    for (size_t i = 0; i < 5; ++i)
      EXPECT_NEAR(resumed.step_losses[i], want.step_losses[5 + i], 1e-5 * want.step_losses[5 + i])
          << "resumed at ZeRO-" << zero << ", step " << 5 + i;
  }
  ::unsetenv("DTRAIN_TEST_RANKS_PER_NODE");
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// ------------------------------------------------------------------ pipeline parallel

TEST(Pipeline, SchedulesRunEveryMicroBatchOnceForwardBeforeBackward) {
  for (auto sched : {parallel::PipelineSchedule::GPipe, parallel::PipelineSchedule::OneFOneB})
    for (int stages : {1, 2, 4})
      for (int m : {1, 3, 8})
        for (int s = 0; s < stages; ++s) {
          auto ops = parallel::pipeline_ops(sched, s, stages, m);
          ASSERT_EQ(ops.size(), static_cast<size_t>(2 * m));
          std::vector<int> fwd(m, 0), bwd(m, 0);
          int in_flight = 0, most = 0, next_b = 0;
          for (auto& op : ops) {
            if (op.forward) {
              EXPECT_EQ(bwd[op.micro_batch], 0);
              ++fwd[op.micro_batch];
              most = std::max(most, ++in_flight);
            } else {
              EXPECT_EQ(fwd[op.micro_batch], 1);
              EXPECT_EQ(op.micro_batch, next_b++);  // backwards in order: data parallel syncs on the last
              ++bwd[op.micro_batch];
              --in_flight;
            }
          }
          for (int i = 0; i < m; ++i) EXPECT_TRUE(fwd[i] == 1 && bwd[i] == 1);
          // GPipe holds every micro-batch; 1F1B at most stages - stage of them.
          EXPECT_EQ(most, sched == parallel::PipelineSchedule::GPipe ? m : std::min(m, stages - s));
        }
  EXPECT_NEAR(parallel::pipeline_ideal_bubble(4, 8), 3.0 / 11.0, 1e-12);
}

TEST(Pipeline, BalanceStagesMinimisesTheLargestStage) {
  EXPECT_EQ(parallel::balance_stages({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(parallel::balance_stages({5, 1, 1, 1, 1, 1}, 2), (std::vector<int>{0, 1, 6}));
  EXPECT_EQ(parallel::balance_stages({1, 2, 3, 4, 5}, 3), (std::vector<int>{0, 3, 4, 5}));
  EXPECT_EQ(parallel::balance_stages({1, 1, 1}, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THROW(parallel::balance_stages({1, 1}, 3), InputError);
}

TEST(Pipeline, GptPp2GPipeMatchesOneRank) {
  expect_grid_matches_one_rank(1, 2, 10, parallel::PipelineSchedule::GPipe, 4);
}

TEST(Pipeline, GptPp2OneFOneBMatchesOneRank) {
  expect_grid_matches_one_rank(1, 2, 10, parallel::PipelineSchedule::OneFOneB, 4);
}

TEST(Pipeline, GptPpOverAllRanksOneFOneBMatchesOneRank) {
  if (world().size() > 4) GTEST_SKIP() << "4 layers";
  expect_grid_matches_one_rank(1, world().size(), 10, parallel::PipelineSchedule::OneFOneB, 4);
}

TEST(Pipeline, GptTp2Pp2MatchesOneRank) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  expect_grid_matches_one_rank(2, 2, 10, parallel::PipelineSchedule::OneFOneB, 2);
}

// The head fused with its cross-entropy (chunks of 5 rows) under tp 2 (the statistics over the
// vocabulary slices), pp 2 (targets given where the last stage runs its forward, the chunk kept
// with each micro-batch's activations) and tp 2 x pp 2: the gradients and losses of one rank's
// whole logits.
TEST(TensorParallel, ScoringHeadMatchesOneRanksWholeLogits) {
  nn::GptConfig gpt = small_gpt(), llama = small_llama();
  gpt.head_chunk_rows = llama.head_chunk_rows = 5;
  const auto one_f_one_b = parallel::PipelineSchedule::OneFOneB;
  compare_grid_with_one_rank(gpt, true, 2, 1, 3, one_f_one_b, 1, true);
  compare_grid_with_one_rank(llama, true, 2, 1, 3, one_f_one_b, 1, true);
  compare_grid_with_one_rank(gpt, true, 1, 2, 3, one_f_one_b, 2, true);
  if (world().size() == 4) compare_grid_with_one_rank(llama, true, 2, 2, 3, one_f_one_b, 2, true);
}

// The Llama's blocks under every layout the GPT has: tp 2 (kv heads split), pp 2, dp 2 x tp 2 and
// tp 2 x pp 2 at 4 ranks, each equal to one rank.
TEST(TensorParallel, LlamaTp2MatchesOneRank) {
  expect_grid_matches_one_rank(2, 1, 10, parallel::PipelineSchedule::OneFOneB, 1, small_llama());
}

// LoRA on every projection: A whole and B split by rows on a column-parallel layer, A split by
// columns and B whole on a row-parallel one; the adapters' x A^T and its gradient summed over tp.
nn::GptConfig small_llama_lora() {
  nn::GptConfig c = small_llama();
  c.lora_rank = 2;
  c.lora_targets = "q,k,v,o,gate,up,down";
  return c;
}

TEST(TensorParallel, LlamaLoraTp2MatchesOneRank) {
  expect_grid_matches_one_rank(2, 1, 10, parallel::PipelineSchedule::OneFOneB, 1, small_llama_lora());
}

// Fewer key/value heads than tp ranks (tp 2: 1 head; tp 4: 2): each rank holds the head its query
// heads read, the ranks sharing it sum its gradient; the same with LoRA on q, k and v (B's rows of
// the shared head summed alike).
TEST(TensorParallel, LlamaKvHeadsReplicatedOverTpMatchOneRank) {
  if (world().size() > 4) GTEST_SKIP() << "4 heads";
  nn::GptConfig cfg = small_llama();
  cfg.kv_heads = world().size() / 2;
  expect_grid_matches_one_rank(world().size(), 1, 6, parallel::PipelineSchedule::OneFOneB, 1, cfg);
  cfg.lora_rank = 2;
  cfg.lora_targets = "q,k,v";
  // Gradients at the same parameters every step: trained apart, B (growing from zero) drifts by
  // summation order alone to 1.1-1.5e-5 of its scale within a few steps of SGD with momentum.
  compare_grid_with_one_rank(cfg, true, world().size(), 1, 6, parallel::PipelineSchedule::OneFOneB, 1);
}

TEST(Pipeline, LlamaLoraTp2Pp2MatchesOneRank) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  expect_grid_matches_one_rank(2, 2, 10, parallel::PipelineSchedule::OneFOneB, 2, small_llama_lora());
}

TEST(Pipeline, LlamaPp2MatchesOneRank) {
  expect_grid_matches_one_rank(1, 2, 10, parallel::PipelineSchedule::OneFOneB, 4, small_llama());
}

TEST(Pipeline, LlamaTp2Pp2MatchesOneRank) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  expect_grid_matches_one_rank(2, 2, 10, parallel::PipelineSchedule::OneFOneB, 2, small_llama());
}

// 1F1B keeps at most (stages - stage) micro-batches' activations; GPipe all of them.
TEST(Pipeline, OneFOneBHoldsFewerActivationsThanGPipe) {
  const int pp = world().size() >= 4 ? 4 : 2, m = 8;
  if (world().size() % pp) GTEST_SKIP();
  parallel::ProcessGrid grid(world(), 1, pp);
  nn::GptConfig cfg = small_gpt();
  std::vector<int> starts = parallel::balance_stages(std::vector<double>(cfg.layers, 1.0), pp);
  const int s = grid.pp_rank();
  size_t peak[2];
  int i = 0;
  for (auto sched : {parallel::PipelineSchedule::GPipe, parallel::PipelineSchedule::OneFOneB}) {
    nn::Gpt model(cfg, nullptr, {starts[s], starts[s + 1], s == 0, s == pp - 1});
    parallel::PipelineStage pipe(model, grid.pp(), sched, m);
    Tensor ids = Tensor::zeros({m, 6}, DType::I32), tg = Tensor::zeros({m * 6}, DType::I32);
    nn::SoftmaxCrossEntropy xent;
    pipe.train_step([&](int k) { return ids.slice0(k, k + 1); },
                    [&](const Tensor& out, int k) {
                      xent.forward(out, tg.slice0(6 * k, 6 * k + 6));
                      return xent.backward();
                    },
                    parallel::StageShapes{{1, 6, cfg.width}, {1, 6, cfg.width}});
    peak[i++] = pipe.stats().peak_activation_bytes;
  }
  ASSERT_GT(peak[1], 0u);
  // Equal micro-batches hold equal bytes: GPipe m of them, 1F1B pp - s.
  EXPECT_EQ(peak[0] * static_cast<size_t>(pp - s), peak[1] * static_cast<size_t>(m)) << "stage " << s;
}

namespace {

// The LM trainer in layout (tp, pp) over the whole world (dp 1) against one rank: every step's
// loss and the validation loss within 1e-5; the checkpoint, one part per stage, reloads on one
// rank to the same validation loss.
void expect_lm_layout_matches_one_rank(int tp, int pp, const std::string& schedule, bool recompute,
                                       const nn::GptConfig& model = small_gpt()) {
  std::filesystem::path dir = make_corpus("lm-" + std::to_string(tp) + "x" + std::to_string(pp));
  train::TrainConfig c = test::small_lm_config(dir / "tok", model);
  auto solo = world().split(world().rank(), 0, "solo");
  train::TrainResult ref = train::train_lm(c, solo.get());
  c.tp = tp;
  c.pp = pp;
  c.schedule = schedule;
  c.checkpoint_activations = recompute;
  c.checkpoint_dir = (dir / "ckpt").string();
  train::TrainResult got = train::train_lm(c, &world());
  test::expect_lm_losses_match(got, ref, world().rank() == 0);
  if (world().rank() == 0) {
    auto one = train::gpt_from_checkpoint(train::load_checkpoint_set(got.checkpoint));
    double reloaded =
        train::evaluate_lm(*one, (dir / "tok" / "val.h5").string(), c.batch_size, c.context, c.eval_batches);
    EXPECT_NEAR(reloaded, got.last_eval.loss, 1e-5 * got.last_eval.loss);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Resuming across layouts: a one-rank run checkpointed at step 5 continues in layout (tp, pp) with
// the losses of the uninterrupted one-rank run, and a checkpoint of the layout run continues on
// one rank the same way (parameters and AdamW moments go through the one-rank layout).
void expect_resume_across_layouts(int tp, int pp, const nn::GptConfig& model = small_gpt()) {
  std::filesystem::path dir = make_corpus("resume-" + std::to_string(tp) + "x" + std::to_string(pp));
  train::TrainConfig c = test::small_lm_config(dir / "tok", model);
  c.checkpoint_every = 5;
  auto solo = world().split(world().rank(), 0, "solo");
  train::TrainConfig one = c;  // every rank runs it alone, into its own directory
  one.checkpoint_dir = (dir / ("one" + std::to_string(world().rank()))).string();
  train::TrainResult ref = train::train_lm(one, solo.get());
  ASSERT_EQ(ref.step_losses.size(), 10u);
  world().barrier();

  train::TrainConfig layout = c;
  layout.tp = tp;
  layout.pp = pp;
  layout.resume = (dir / "one0" / "ckpt-step000000005.h5").string();
  layout.checkpoint_dir = (dir / "layout").string();
  train::TrainResult got = train::train_lm(layout, &world());
  if (world().rank() == 0) {
    ASSERT_EQ(got.step_losses.size(), 5u);
    for (size_t i = 0; i < 5; ++i)
      EXPECT_NEAR(got.step_losses[i], ref.step_losses[5 + i], 1e-5 * ref.step_losses[5 + i]) << "step " << 5 + i;
  }
  EXPECT_NEAR(got.last_eval.loss, ref.last_eval.loss, 1e-5 * ref.last_eval.loss);

  // And back: the layout run, checkpointed at step 5, continued on one rank.
  layout.resume.clear();
  layout.checkpoint_dir = (dir / "layout2").string();
  train::train_lm(layout, &world());
  train::TrainConfig back = c;
  back.checkpoint_every = 0;
  back.resume = (dir / "layout2" / "ckpt-step000000005.h5").string();
  train::TrainResult again = train::train_lm(back, solo.get());
  ASSERT_EQ(again.step_losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(again.step_losses[i], ref.step_losses[5 + i], 1e-5 * ref.step_losses[5 + i]) << "step " << 5 + i;
  EXPECT_NEAR(again.last_eval.loss, ref.last_eval.loss, 1e-5 * ref.last_eval.loss);
  // A checkpoint that is not there, or past --steps, is named.
  back.resume = (dir / "nothing.h5").string();
  EXPECT_THROW(train::train_lm(back, solo.get()), InputError);
  back.resume = (dir / "layout2").string();  // its newest is step 10 = --steps
  try {
    train::train_lm(back, solo.get());
    ADD_FAILURE() << "resuming at --steps should fail";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-step000000010.h5"), std::string::npos) << e.what();
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}
}  // namespace

// Prompt/completion samples through a 2-stage pipeline (4 micro-batches of a batch of 4, each
// with its own count of completion tokens): every step's loss, the mean over the step's completion
// tokens, and the validation over held-out records equal one rank's.
TEST(Pipeline, SftPp2MatchesOneRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  const std::filesystem::path dir = make_sft_corpus("sft-pp");
  nn::GptConfig shape = small_llama();
  shape.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", shape);
  c.eval_batches = 0;
  auto solo = world().split(world().rank(), 0, "solo");
  const train::TrainResult want = train::train_lm(c, solo.get());
  c.pp = 2;
  c.micro_batches = 4;
  test::expect_lm_losses_match(train::train_lm(c, &world()), want, true);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(Pipeline, LmResumesFromOneRankInPp2AndBack) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  expect_resume_across_layouts(1, 2);
}

TEST(TensorParallel, LmResumesFromOneRankInTp2AndBack) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2)";
  expect_resume_across_layouts(2, 1);
}

// The Llama through the trainer: resumed across layouts (tp 2 at 2 ranks, tp 2 x pp 2 at 4), and
// trained with recompute in tp 2 x pp 2 equal to one rank, its checkpoint reloading on one rank.
TEST(TensorParallel, LlamaResumesFromOneRankInALayoutAndBack) {
  if (world().size() == 2) expect_resume_across_layouts(2, 1, small_llama());
  if (world().size() == 4) expect_resume_across_layouts(2, 2, small_llama());
}

// --init-from: pretrained weights under Hugging Face's names (a model drawn from another seed) start
// every layout at the same point: the losses of tp 2 and pp 2 (2 ranks) or tp 2 x pp 2 (4 ranks)
// equal one rank's, for the Llama and the GPT, and differ from the run that does not import them.
TEST(TensorParallel, InitFromPretrainedStartsEveryLayoutAlike) {
  for (const nn::GptConfig& model : {small_llama(), small_gpt()}) {
    std::filesystem::path dir = make_corpus(model.llama() ? "init-llama" : "init-gpt");
    nn::GptConfig other = model;
    other.seed = 99;
    other.vocab = 256;
    if (world().rank() == 0) {
      nn::Gpt pretrained(other);
      test::write_pretrained((dir / "pretrained.safetensors").string(), pretrained);
    }
    world().barrier();
    train::TrainConfig c = test::small_lm_config(dir / "tok", model);
    auto solo = world().split(world().rank(), 0, "solo");
    const train::TrainResult fresh = train::train_lm(c, solo.get());
    c.init_from = (dir / "pretrained.safetensors").string();
    const train::TrainResult ref = train::train_lm(c, solo.get());
    EXPECT_GT(std::abs(ref.step_losses[0] - fresh.step_losses[0]), 1e-4) << "the import changed nothing";
    for (auto [tp, pp] : world().size() == 4 ? std::vector<std::pair<int, int>>{{2, 2}}
                                             : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}}) {
      c.tp = tp;
      c.pp = pp;
      test::expect_lm_losses_match(train::train_lm(c, &world()), ref, world().rank() == 0);
    }
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
}

// The layouts of dp 1 over the world (the one rank's windows): tp over every rank, and at 2 ranks
// pp 2, at 4 tp 2 x pp 2 (a teacher on the last stage's ranks).
namespace {
std::vector<std::pair<int, int>> one_group_layouts() {
  const int n = world().size();
  return {{n, 1}, n == 4 ? std::pair{2, 2} : std::pair{1, n}};
}
}  // namespace

// Distillation of a language model: a GPT student of a Llama teacher (T 2, weight 0.5) gives one
// rank's losses at tp 2 and 4 (the student's softened distribution over the split vocabulary by
// allreduced maxima and sums) and under pp (the teacher beside the last stage), and the teacher
// changes the trajectory.
TEST(TensorParallel, LmDistillationUnderTpMatchesOneRank) {
  std::filesystem::path dir = make_corpus("distill");
  auto solo = world().split(world().rank(), 0, "solo");
  train::TrainConfig teacher = test::small_lm_config(dir / "tok", small_llama());
  teacher.checkpoint_dir = (dir / ("teacher" + std::to_string(world().rank()))).string();
  train::train_lm(teacher, solo.get());
  world().barrier();
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  const train::TrainResult alone = train::train_lm(c, solo.get());
  c.teacher = (dir / "teacher0").string();
  c.distill_temperature = 2.f;
  c.distill_weight = 0.5f;
  const train::TrainResult ref = train::train_lm(c, solo.get());
  EXPECT_GT(std::abs(ref.step_losses.back() - alone.step_losses.back()), 1e-4) << "the teacher changed nothing";
  for (auto [tp, pp] : one_group_layouts()) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " pp " + std::to_string(pp));
    c.tp = tp;
    c.pp = pp;
    test::expect_lm_losses_match(train::train_lm(c, &world()), ref, world().rank() == 0);
  }
  c.teacher = (dir / "tok").string();  // not a checkpoint: refused on every rank, the stages without it too
  EXPECT_THROW(train::train_lm(c, &world()), InputError);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Distillation's gradient with targets: a row whose target is -1 gets none, every other row the
// gradient without targets (this rank's columns of one rank's).
TEST(TensorParallel, SoftTargetsSkipRowsWithoutATarget) {
  const int tp = world().size();
  const int64_t rows = 6, vocab = 8 * tp;
  Rng rng(5);
  Tensor student = Tensor::empty({rows, vocab}), teacher = Tensor::empty({rows, vocab});
  for (int64_t i = 0; i < rows * vocab; ++i) {
    student.f32()[i] = rng.normal();
    teacher.f32()[i] = rng.normal();
  }
  Tensor targets = Tensor::empty({rows}, DType::I32);
  const int32_t given[] = {3, -1, -1, 7, -1, 2};
  std::copy(given, given + rows, targets.data<int32_t>());
  auto solo = world().split(world().rank(), 0, "solo");
  parallel::VocabParallelSoftTargets whole(*solo, 0, 2.f);
  const Tensor want = whole.gradient(student, teacher, 0.5f).clone();
  const int64_t n = vocab / tp, offset = world().rank() * n;
  Tensor mine = Tensor::empty({rows, n});
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) mine.f32()[i * n + j] = student.f32()[i * vocab + offset + j];
  parallel::VocabParallelSoftTargets split(world(), offset, 2.f);
  const Tensor got = split.gradient(mine, teacher, 0.5f, &targets);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float expect = targets.data<int32_t>()[i] < 0 ? 0.f : want.f32()[i * vocab + offset + j];
      EXPECT_NEAR(got.f32()[i * n + j], expect, 1e-6) << "row " << i << " column " << offset + j;
    }
}

// A teacher on prompt/completion samples: the distillation term over completion tokens only, at tp
// = the world's ranks and under pp, gives one rank's losses, and the teacher changes the trajectory.
TEST(TensorParallel, SftDistillationUnderTpMatchesOneRank) {
  if (world().size() > 4) GTEST_SKIP() << "4 heads";
  const std::filesystem::path dir = make_sft_corpus("sft-distill");
  auto solo = world().split(world().rank(), 0, "solo");
  nn::GptConfig shape = small_llama();
  shape.context = 16;
  train::TrainConfig teacher = test::small_lm_config(dir / "tok", shape);
  teacher.checkpoint_dir = (dir / ("teacher" + std::to_string(world().rank()))).string();
  train::train_lm(teacher, solo.get());
  world().barrier();
  nn::GptConfig student = small_gpt();
  student.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", student);
  c.eval_batches = 0;
  const train::TrainResult alone = train::train_lm(c, solo.get());
  c.teacher = (dir / "teacher0").string();
  c.distill_temperature = 2.f;
  c.distill_weight = 0.5f;
  const train::TrainResult ref = train::train_lm(c, solo.get());
  EXPECT_GT(std::abs(ref.step_losses.back() - alone.step_losses.back()), 1e-4) << "the teacher changed nothing";
  for (auto [tp, pp] : one_group_layouts()) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " pp " + std::to_string(pp));
    c.tp = tp;
    c.pp = pp;
    test::expect_lm_losses_match(train::train_lm(c, &world()), ref, world().rank() == 0);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(Pipeline, LlamaTrainerWithRecomputeMatchesOneRankAndCheckpointReloads) {
  if (world().size() == 2) expect_lm_layout_matches_one_rank(1, 2, "1f1b", true, small_llama());
  if (world().size() == 4) expect_lm_layout_matches_one_rank(2, 2, "1f1b", true, small_llama());
}

TEST(Pipeline, LmResumesFromOneRankInTp2Pp2AndBack) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks (tp 2 x pp 2)";
  expect_resume_across_layouts(2, 2);
}

// A stage file only stage 1's writer cannot write: both ranks throw the same InputError naming the
// file, neither waits in a collective for the other, and no checkpoint without its stage part
// appears. Then a broken stage part on resume: every rank fails naming it; and a metrics file
// rank 0 cannot open.
// The token files are read by every rank; one rank that cannot read them (a node without the
// shared file system) fails every rank with the file's name, instead of a hang in the grid.
TEST(Pipeline, LmTokensOneRankCannotReadFailEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  std::filesystem::path dir = make_corpus("lm-tokens-fail");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  c.pp = 2;
  if (world().rank() == 1) c.data = (dir / "not-on-this-node").string();
  try {
    train::train_lm(c, &world());
    ADD_FAILURE() << "rank " << world().rank() << " trained although rank 1 has no token files";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not-on-this-node"), std::string::npos) << e.what();
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(Pipeline, LmOneStagesCheckpointFailureFailsEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  std::filesystem::path dir = make_corpus("lm-ckpt-fail");
  train::TrainConfig c = test::small_lm_config(dir / "tok", small_gpt());
  c.pp = 2;
  c.checkpoint_every = 5;
  c.checkpoint_dir = (dir / "ckpt").string();
  const std::string main_file = c.checkpoint_dir + "/ckpt-step000000005.h5";
  const std::string part = c.checkpoint_dir + "/ckpt-step000000005.stage1.h5";
  if (world().rank() == 0) std::filesystem::create_directories(part + ".tmp");
  world().barrier();
  try {
    train::train_lm(c, &world());
    ADD_FAILURE() << "rank " << world().rank() << " finished although stage 1 could not write its part";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("stage1.h5.tmp"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(main_file)) << "a checkpoint without its stage 1 part";
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(part + ".tmp");
  world().barrier();
  train::train_lm(c, &world());
  world().barrier();
  train::TrainConfig r = c;
  r.resume = main_file;
  r.checkpoint_dir.clear();
  if (world().rank() == 1) std::ofstream(part, std::ios::trunc) << "not a checkpoint";
  world().barrier();
  try {
    train::train_lm(r, &world());
    ADD_FAILURE() << "rank " << world().rank() << " resumed from a broken stage part";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("stage1.h5"), std::string::npos) << e.what();
  }
  // A metrics file only rank 0 opens, and cannot: every rank fails naming the option.
  train::TrainConfig m = c;
  m.checkpoint_dir.clear();
  m.metrics = "/proc/dtrain-no-such-dir/metrics.jsonl";
  try {
    train::train_lm(m, &world());
    ADD_FAILURE() << "rank " << world().rank() << " trained although rank 0 could not open --metrics";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--metrics"), std::string::npos) << e.what();
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Mixed precision's weight copies change no number in a pipeline either: the bf16 LM trainer at pp 2
// with 4 micro-batches (every micro-batch's GEMMs read the copies, which are made once per step)
// gives every step's loss and the validation loss bit for bit as when the GEMMs round the fp32
// masters on every call (DTRAIN_WORKING_COPIES=0).
TEST(Pipeline, LmBf16WeightCopiesChangeNoLoss) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  std::filesystem::path dir = make_corpus("lm-copies");
  nn::GptConfig g = small_gpt();
  g.width = 32;  // every GEMM at least 16 x 16: all of them multiply in bf16 and read the copies
  g.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", g);
  c.precision = "bf16";
  c.pp = 2;
  c.micro_batches = 4;
  c.eval_every = 5;
  train::TrainResult r[2];
  for (int copies = 0; copies < 2; ++copies) {
    ::setenv("DTRAIN_WORKING_COPIES", copies ? "1" : "0", 1);
    r[copies] = train::train_lm(c, &world());
  }
  ::unsetenv("DTRAIN_WORKING_COPIES");
  cpu_engine().set_math_precision(MathPrecision::F32);
  if (world().rank() == 0) {
    ASSERT_EQ(r[0].step_losses.size(), 10u);
    ASSERT_EQ(r[1].step_losses.size(), 10u);
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(r[0].step_losses[i], r[1].step_losses[i]) << "step " << i;
    EXPECT_EQ(r[0].last_eval.loss, r[1].last_eval.loss);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// fp16 in a pipeline: with a first loss scale of 2^24 the scaled gradients overflow half precision
// in the first steps; every stage must skip the same steps (the verdict is agreed over the world),
// so pp 2 (4 micro-batches) keeps the one-rank run's losses, skipped steps and final scale.
TEST(Pipeline, LmFp16SkipsTheSameStepsAsOneRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2)";
  std::filesystem::path dir = make_corpus("lm-fp16");
  nn::GptConfig g = small_gpt();
  g.width = 32;
  g.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", g);
  c.precision = "fp16";
  c.loss_scale_init = 16777216.f;
  auto solo = world().split(world().rank(), 0, "solo");
  train::TrainResult ref = train::train_lm(c, solo.get());
  c.pp = 2;
  c.micro_batches = 4;
  train::TrainResult got = train::train_lm(c, &world());
  cpu_engine().set_math_precision(MathPrecision::F32);
  EXPECT_GE(ref.skipped_steps, 1);
  EXPECT_EQ(got.skipped_steps, ref.skipped_steps);
  EXPECT_EQ(got.loss_scale, ref.loss_scale);
  test::expect_lm_losses_match(got, ref, world().rank() == 0);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// The language model data parallel on GPUs (one per rank, gradients through NCCL on its own stream)
// logs the losses of the same data-parallel run on the CPU engine: each dp rank draws the same
// windows on both; only the engines' summation orders differ.
TEST(DataParallel, LmOnGpusThroughNcclMatchesTheCpu) {
  const comm::Topology& topo = comm::Runtime::get().topology();
  if (!comm::nccl_compiled() || enable_cuda() == 0)
    GTEST_SKIP() << "no GPU on this machine (or dtrain built without CUDA/NCCL): the GPT data parallel on GPUs not "
                    "exercised";
  if (topo.cuda_device_count < topo.local_size)
    GTEST_SKIP() << topo.local_size << " ranks share " << topo.cuda_device_count << " GPU(s); NCCL needs one per rank";
  std::filesystem::path dir = make_corpus("lm-gpu-dp");
  nn::GptConfig g = small_gpt();
  g.width = 32;
  g.context = 16;
  train::TrainConfig c = test::small_lm_config(dir / "tok", g);
  train::TrainResult cpu = train::train_lm(c, &world());
  c.device = "cuda";
  train::TrainResult gpu = train::train_lm(c, &world());
  if (world().rank() == 0) {
    ASSERT_EQ(gpu.step_losses.size(), cpu.step_losses.size());
    for (size_t i = 0; i < cpu.step_losses.size(); ++i)
      EXPECT_NEAR(gpu.step_losses[i], cpu.step_losses[i], 1e-4 * cpu.step_losses[i]) << "step " << i;
  }
  EXPECT_NEAR(gpu.last_eval.loss, cpu.last_eval.loss, 1e-4 * cpu.last_eval.loss);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(Pipeline, LmTrainerPp2MatchesOneRankAndCheckpointReloads) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (pp 2, dp 1)";
  expect_lm_layout_matches_one_rank(1, 2, "gpipe", false);
}

TEST(Pipeline, LmTrainerTp2Pp2WithRecomputeMatchesOneRankAndCheckpointReloads) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks (tp 2 x pp 2)";
  expect_lm_layout_matches_one_rank(2, 2, "1f1b", true);
}

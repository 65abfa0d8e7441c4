// The process grid and tensor-parallel GPT under a real mpiexec: a GPT split over tp ranks (and
// data parallel over the rest) trains like the same GPT on one rank, step for step. The one-rank
// reference runs on every rank over a communicator of its own.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "dtrain/comm/runtime.h"
#include "dtrain/data/text.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/lm_trainer.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

// Every parameter of `m` with the innermost module that holds it (to find the shard of a full tensor).
void owners(nn::Module& m, const std::string& prefix, std::map<std::string, nn::Module*>& out) {
  for (nn::Parameter* p : m.parameters())
    out[prefix + p->name] = &m;  // children, visited later, overwrite: the innermost owner wins
  for (auto& [name, child] : m.children()) owners(*child, nn::Module::child_prefix(prefix, name), out);
}

// The part of a one-rank tensor that a tp rank holds for parameter `name` owned by `owner`.
Tensor expected_shard(nn::Module* owner, const std::string& name, const Tensor& full) {
  bool is_weight = name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0;
  if (auto* c = dynamic_cast<parallel::ColumnParallelLinear*>(owner)) return c->shard_of(full);
  if (auto* r = dynamic_cast<parallel::RowParallelLinear*>(owner)) return is_weight ? r->shard_of(full) : full;
  return full;
}

// max |got - want| <= tol * max(floor, max |want|)
void expect_rel_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                      double floor = 1e-12) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  double diff = 0, scale = floor;
  for (int64_t i = 0; i < want.numel(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(got.f32()[i] - want.f32()[i])));
    scale = std::max(scale, static_cast<double>(std::abs(want.f32()[i])));
  }
  EXPECT_LE(diff / scale, tol) << what << ": max diff " << diff << " vs scale " << scale;
}

nn::GptConfig small_gpt() {
  nn::GptConfig c;
  c.vocab = 40;
  c.context = 8;
  c.layers = 2;
  c.heads = 4;
  c.width = 16;
  c.seed = 9;
  return c;
}

// Trains `steps` SGD (momentum) steps of the GPT on a fixed sequence of batches, tp x dp over the
// world, against the one-rank model on the whole batch; compares losses, gradients and parameters.
// (Not Adam: the key bias has an exactly zero gradient, softmax being shift-invariant, and Adam
// turns its rounding noise into full-size steps that differ between any two summation orders.)
void expect_tp_matches_one_rank(int tp, int steps) {
  parallel::ProcessGrid grid(world(), tp, 1);
  auto solo = world().split(world().rank(), 0, "solo");
  nn::GptConfig cfg = small_gpt();
  nn::Gpt ref(cfg);
  nn::Gpt model(cfg, parallel::tensor_parallel_gpt_blocks(cfg.width, cfg.heads, grid.tp()));
  std::map<std::string, nn::Module*> own;
  owners(model, "", own);
  std::map<std::string, nn::Parameter*> ref_params;
  for (nn::Parameter* p : ref.parameters()) ref_params[p->name] = p;
  ASSERT_EQ(ref_params.size(), model.parameters().size());
  for (nn::Parameter* p : model.parameters())
    expect_rel_close(p->value, expected_shard(own[p->name], p->name, ref_params[p->name]->value), 0, "init " + p->name);

  std::unique_ptr<parallel::DataParallel> ddp;
  if (grid.dp_size() > 1) ddp = std::make_unique<parallel::DataParallel>(model, grid.dp());
  optim::SgdOptions so;
  so.momentum = 0.9f;
  so.weight_decay = 1e-4f;
  optim::SGD opt_ref(ref.parameters(), so), opt(model.parameters(), so);
  const int64_t per_rank = 2, t = 6, total = per_rank * grid.dp_size();
  Rng data_rng(77);
  nn::SoftmaxCrossEntropy xent_ref, xent;
  for (int step = 0; step < steps; ++step) {
    Tensor ids = Tensor::empty({total, t}, DType::I32), tg = Tensor::empty({total * t}, DType::I32);
    for (int64_t i = 0; i < total * t; ++i) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(data_rng.below(40));
      tg.data<int32_t>()[i] = static_cast<int32_t>(data_rng.below(40));
    }
    opt_ref.zero_grad();
    float loss_ref = xent_ref.forward(ref.forward(ids), tg);
    ref.backward(xent_ref.backward());
    // This dp rank's rows of the batch.
    Tensor my_ids = ids.slice0(grid.dp_rank() * per_rank, (grid.dp_rank() + 1) * per_rank).clone();
    Tensor my_tg = tg.slice0(grid.dp_rank() * per_rank * t, (grid.dp_rank() + 1) * per_rank * t).clone();
    opt.zero_grad();
    if (ddp) ddp->begin_backward(true);
    Tensor loss = Tensor::full({1}, xent.forward(model.forward(my_ids), my_tg));
    model.backward(xent.backward());
    if (ddp) ddp->finish();
    if (grid.dp_size() > 1) grid.dp().allreduce(loss, comm::ReduceOp::Avg)->wait();
    EXPECT_NEAR(loss.f32()[0], loss_ref, 1e-5 * std::abs(loss_ref)) << "step " << step;
    for (nn::Parameter* p : model.parameters())
      expect_rel_close(p->grad, expected_shard(own[p->name], p->name, ref_params[p->name]->grad), 1e-5,
                       "step " + std::to_string(step) + " gradient " + p->name, 1e-3);
    opt_ref.step(0.1f);
    opt.step(0.1f);
  }
  for (nn::Parameter* p : model.parameters())
    expect_rel_close(p->value, expected_shard(own[p->name], p->name, ref_params[p->name]->value), 1e-5,
                     "after training " + p->name);
}

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

// The language-model trainer with --tp 2 over the world gives the losses of one rank (dp groups
// draw their own windows, so the comparison runs at dp = 1), and its checkpoint, gathered into the
// one-rank layout, reloads on one rank to the same validation loss.
TEST(TensorParallel, LmTrainerTp2MatchesOneRankAndCheckpointReloads) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2, dp 1)";
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::filesystem::path dir = "/tmp/dtrain-tp-lm-" + std::to_string(pid);
  if (world().rank() == 0) {
    std::filesystem::create_directories(dir / "text");
    std::ofstream out(dir / "text" / "a.txt");
    for (int i = 0; i < 600; ++i) out << "the quick brown fox " << i % 7 << ". ";
    out.close();
    data::convert_text({(dir / "text").string()}, (dir / "tok").string());
  }
  world().barrier();
  train::LmConfig c;
  c.data = (dir / "tok").string();
  c.model = small_gpt();
  c.model.vocab = 256;
  c.batch_size = 4;
  c.steps = 10;
  c.lr = 3e-3f;
  c.warmup_steps = 2;
  c.eval_every = 0;
  c.eval_batches = 4;
  c.log_every = 5;
  c.quiet = true;
  auto solo = world().split(world().rank(), 0, "solo");
  train::LmResult ref = train::train_lm(c, solo.get());
  c.tp = 2;
  c.checkpoint_dir = (dir / "ckpt").string();
  train::LmResult got = train::train_lm(c, &world());
  EXPECT_NEAR(got.train_loss, ref.train_loss, 1e-5 * ref.train_loss);
  EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss);
  if (world().rank() == 0) {
    auto one = train::gpt_from_checkpoint(train::load_checkpoint(got.checkpoint));
    double reloaded =
        train::evaluate_lm(*one, (dir / "tok" / "val.h5").string(), c.batch_size, c.model.context, c.eval_batches);
    EXPECT_NEAR(reloaded, got.val_loss, 1e-5 * got.val_loss);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

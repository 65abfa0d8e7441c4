// ZeRO-1 with optimizer parameter groups under a real mpiexec: a GPT trained with AdamW that decays
// matrices only equals the same run without ZeRO-1, and its optimizer state moves between the
// ZeRO-1 and the plain layout through the one-rank layout (gather_state, load_state).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/parallel/data_parallel.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

using ParamValues = std::map<std::string, Tensor>;

constexpr int64_t kRows = 2, kSeq = 16;  // windows per rank and step, tokens per window
constexpr float kLr = 1e-2f;

nn::GptConfig tiny_gpt() {
  nn::GptConfig c;
  c.vocab = 32;
  c.context = 16;
  c.layers = 2;
  c.heads = 2;
  c.width = 32;
  c.seed = 5;
  return c;
}

// How the optimizer sees the parameters: whole (plain data parallel), or as the pieces in this
// rank's ZeRO-1 slice (optimizer_groups).
enum class Sharding { none, pieces };

// A data-parallel GPT with AdamW over `model_groups(parameters)`, stepped on fixed batches: step s
// draws the same global batch in every run and each rank takes its rows, so two runs differ only
// in how the optimizer sees the parameters.
struct GptRun {
  using Groups = std::function<std::vector<optim::ParamGroup>(const std::vector<nn::Parameter*>&)>;
  nn::Gpt model{tiny_gpt()};
  parallel::ReplicatedDataParallel dp;
  optim::Adam opt;
  nn::SoftmaxCrossEntropy xent;

  GptRun(Sharding sharding, const Groups& model_groups)
      : dp(model, world(), options(sharding != Sharding::none)),
        opt(dp.optimizer_groups(model_groups(model.parameters())), adamw()) {}

  static parallel::DataParallelOptions options(bool zero1) {
    parallel::DataParallelOptions o;
    o.zero = zero1 ? 1 : 0;
    return o;
  }
  // eps 1e-4, not 1e-8: the attention's key bias has an exactly zero gradient (softmax is
  // shift-invariant), so what it gets is rounding noise, and Adam with a tiny eps turns noise into
  // lr-sized steps. ZeRO-1's reduce-scatter sums the ranks in another order than
  // the allreduce from 4 ranks on, so the noise differs, and with eps 1e-8 the key bias alone ends
  // 2.6e-4 apart after 10 steps (1e-6: 2.9e-6; 1e-5: 3.8e-7; 1e-4: no difference above the other
  // parameters' 1.2e-7). The decoupled weight decay these tests are about does not depend on eps.
  static optim::AdamOptions adamw() {
    optim::AdamOptions o;
    o.decoupled = true;
    o.eps = 1e-4f;
    return o;
  }

  void train(int first_step, int end_step) {
    for (int step = first_step; step < end_step; ++step) {
      Rng rng(1000 + static_cast<uint64_t>(step));
      const int64_t n = kRows * kSeq * world().size(), mine = kRows * kSeq * world().rank();
      Tensor ids = Tensor::empty({n}, DType::I32), targets = Tensor::empty({n}, DType::I32);
      for (int64_t i = 0; i < n; ++i) {
        ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(32));
        targets.data<int32_t>()[i] = static_cast<int32_t>(rng.below(32));
      }
      // Under ZeRO-1 the optimizer holds the slice's gradients, not the model's: clear the model's.
      for (nn::Parameter* p : model.parameters()) p->grad.zero_();
      dp.begin_backward(true);
      xent.forward(model.forward(ids.slice0(mine, mine + kRows * kSeq).reshape({kRows, kSeq})),
                   targets.slice0(mine, mine + kRows * kSeq));
      model.backward(xent.backward());
      dp.finish();
      opt.step(kLr);
      dp.after_step();
    }
  }

  ParamValues params() {
    ParamValues out;
    for (nn::Parameter* p : model.parameters()) out[p->name] = p->value.clone();
    return out;
  }
  void load_params(const ParamValues& values) {
    for (nn::Parameter* p : model.parameters()) p->value.copy_from(values.at(p->name));
    dp.broadcast_state(0);  // also refreshes ZeRO-1's master slice
  }
};

std::vector<optim::ParamGroup> decay_matrices(const std::vector<nn::Parameter*>& params) {
  return optim::decay_groups(params, 0.1f, {"wpe"});
}
std::vector<optim::ParamGroup> decay_everything(const std::vector<nn::Parameter*>& params) {
  return {optim::ParamGroup{params, 0.1f}};
}

// The largest absolute difference between two runs' parameters, naming where it is.
std::pair<double, std::string> max_abs_diff(const ParamValues& got, const ParamValues& want) {
  std::pair<double, std::string> worst{0, ""};
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    const Tensor& g = got.at(name);
    EXPECT_EQ(g.shape(), w.shape()) << name;
    for (int64_t i = 0; i < w.numel(); ++i)
      if (double d = std::abs(double(g.f32()[i]) - w.f32()[i]); d > worst.first) worst = {d, name};
  }
  return worst;
}

void expect_params_equal(const ParamValues& got, const ParamValues& want, const std::string& what) {
  const auto [diff, where] = max_abs_diff(got, want);
  EXPECT_LE(diff, 1e-5) << what << ": " << where << " differs by " << diff;
  if (world().rank() == 0)
    std::printf("[ measured ] %s: max abs difference %.3g (%s)\n", what.c_str(), diff, where.c_str());
}

}  // namespace

// Every parameter's part in a rank's slice is in its parameter's group, with the group's decay, and
// the parts of all ranks cover every parameter exactly once.
TEST(Zero1Groups, PiecesKeepTheirGroupAndCoverEveryParameterOnce) {
  nn::Gpt model(tiny_gpt());
  parallel::ReplicatedDataParallel dp(model, world(), GptRun::options(true));
  const std::vector<optim::ParamGroup> model_groups = decay_matrices(model.parameters());
  const std::vector<optim::ParamGroup> groups = dp.optimizer_groups(model_groups);
  ASSERT_EQ(groups.size(), model_groups.size());
  std::map<std::string, int64_t> held;  // elements of each parameter on this rank
  for (size_t g = 0; g < groups.size(); ++g) {
    EXPECT_EQ(groups[g].weight_decay, model_groups[g].weight_decay);
    for (const nn::Parameter* piece : groups[g].params) {
      auto in_group = [&](const nn::Parameter* p) { return p->name == piece->name; };
      EXPECT_TRUE(std::any_of(model_groups[g].params.begin(), model_groups[g].params.end(), in_group)) << piece->name;
      EXPECT_EQ(piece->value.dim(), 1) << piece->name;
      held[piece->name] += piece->value.numel();
    }
  }
  const std::vector<nn::Parameter*> params = model.parameters();
  Tensor counts = Tensor::zeros({static_cast<int64_t>(params.size())});
  for (size_t i = 0; i < params.size(); ++i) counts.f32()[i] = static_cast<float>(held[params[i]->name]);
  world().allreduce(counts, comm::ReduceOp::Sum)->wait();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(counts.f32()[i], static_cast<float>(params[i]->value.numel())) << params[i]->name;
}

// 10 AdamW steps of the GPT with decayed matrices and undecayed vectors and position table: ZeRO-1
// equals plain data parallel. Decaying everything moves the run by far more than the tolerance, so
// a ZeRO-1 that lost the groups would fail.
TEST(Zero1Groups, GptWithDecayGroupsMatchesPlainDataParallel) {
  GptRun plain(Sharding::none, decay_matrices), sharded(Sharding::pieces, decay_matrices),
      one_group(Sharding::none, decay_everything);
  plain.train(0, 10);
  sharded.train(0, 10);
  one_group.train(0, 10);
  expect_params_equal(sharded.params(), plain.params(), "ZeRO-1 against plain data parallel");
  const auto [lost, where] = max_abs_diff(one_group.params(), plain.params());
  EXPECT_GT(lost, 1e-3) << "decaying every parameter should show (largest at " << where << ")";
  if (world().rank() == 0)
    std::printf("[ measured ] one group instead of two: max abs difference %.3g (%s)\n", lost, where.c_str());
}

// Optimizer state saved at step 5 under ZeRO-1 continues in plain data parallel, and the reverse,
// ending within 1e-5 of the uninterrupted run.
TEST(Zero1Groups, StateMovesBetweenZero1AndPlainLayouts) {
  struct Move {
    Sharding from, to;
    const char* what;
  };
  GptRun whole(Sharding::none, decay_matrices);
  whole.train(0, 10);
  for (const Move& m : {Move{Sharding::pieces, Sharding::none, "pieces, then plain"},
                        Move{Sharding::none, Sharding::pieces, "plain, then pieces"}}) {
    GptRun first(m.from, decay_matrices);
    first.train(0, 5);
    const std::map<std::string, Tensor> state = first.dp.gather_state(first.opt.state());
    EXPECT_EQ(state.size(), 2 * first.model.parameters().size()) << m.what;  // exp_avg and exp_avg_sq of each
    GptRun second(m.to, decay_matrices);
    second.load_params(first.params());
    second.dp.load_state(state, second.opt.state());
    second.opt.set_steps(first.opt.steps());
    second.train(5, 10);
    expect_params_equal(second.params(), whole.params(), std::string(m.what) + ", against uninterrupted");
  }
}

// A state tensor that does not fit its parameter is named.
TEST(Zero1Groups, LoadStateNamesATensorThatDoesNotFit) {
  for (const Sharding sharding : {Sharding::pieces, Sharding::none}) {
    GptRun run(sharding, decay_matrices);
    std::map<std::string, Tensor> state = run.dp.gather_state(run.opt.state());
    for (auto& [name, t] : state) t = Tensor::zeros({t.numel() + 1});
    try {
      run.dp.load_state(state, run.opt.state());
      ADD_FAILURE() << "a state of the wrong shape was loaded";
    } catch (const InputError& e) {
      const std::string msg = e.what(), lead = "optimizer state ";
      const size_t at = msg.find(lead);
      ASSERT_NE(at, std::string::npos) << msg;
      const size_t begin = at + lead.size();
      const std::string name = msg.substr(begin, msg.find(' ', begin) - begin);
      ASSERT_TRUE(state.count(name)) << msg;
      EXPECT_NE(msg.find(name + " is " + state.at(name).str()), std::string::npos) << msg;
    }
  }
}

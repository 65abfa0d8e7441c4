// Image models cut into pipeline stages under a real mpiexec: simple_cnn and resnet20 as pp = 2
// (2 ranks) or dp 2 x pp 2 (4 ranks), and pp over all ranks, train like one rank under GPipe and
// 1F1B. Every rank draws its stage's layers from the same seed (parallel::draw_stage) and
// computes the one-rank reference itself, so each rank compares its own parameters, by name, with
// the reference's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>

#include "dtrain/comm/runtime.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optimizer.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/sync_batchnorm.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

Shape batch_of(int64_t n, const Shape& sample) {
  Shape s{n};
  s.insert(s.end(), sample.begin(), sample.end());
  return s;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0;
  for (int64_t i = 0; i < a.numel() && a.numel() == b.numel(); ++i)
    worst = std::max(worst, std::abs(double(a.f32()[i]) - b.f32()[i]));
  return worst;
}

// One step's data, the same on every rank: `samples` inputs and labels.
struct Batch {
  Tensor x, labels;
  Batch(const nn::ModelSpec& spec, int64_t samples, Rng& rng) {
    x = Tensor::empty(batch_of(samples, spec.input));
    labels = Tensor::empty({samples}, DType::I32);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
    for (int64_t i = 0; i < samples; ++i)
      labels.data<int32_t>()[i] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(spec.classes)));
  }
  Tensor x_of(int64_t k, int64_t mbs) const { return x.slice0(k * mbs, (k + 1) * mbs); }
  Tensor labels_of(int64_t k, int64_t mbs) const { return labels.slice0(k * mbs, (k + 1) * mbs); }
};

// The one-rank reference of a step in the layout's arithmetic: each of `groups` dp groups'
// gradient accumulated from zero over its `micro` micro-batches of `mbs` samples, each scaled by
// 1/micro (BatchNorm normalises each micro-batch by its own statistics, so the reference must see
// the pipeline's micro-batches), then the groups' gradients summed and divided by `groups`, as data
// parallel's allreduce does. The same sums in the same order: rounding differences would otherwise
// grow from step to step (a 2-sample BatchNorm amplifies them) and hide what the test compares.
// Returns the mean loss.
double reference_step(nn::Module& ref, optim::Optimizer& opt, const Batch& b, int groups, int micro, int64_t mbs,
                      float lr) {
  const std::vector<nn::Parameter*> params = ref.parameters();
  std::vector<Tensor> group_sum;
  nn::SoftmaxCrossEntropy xent;
  double loss = 0;
  for (int g = 0; g < groups; ++g) {
    opt.zero_grad();
    for (int k = 0; k < micro; ++k) {
      loss += xent.forward(ref.forward(b.x_of(g * micro + k, mbs)), b.labels_of(g * micro + k, mbs));
      ref.backward(xent.backward(1.f / static_cast<float>(micro)));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (g == 0)
        group_sum.push_back(params[i]->grad.clone());
      else
        cpu_engine().add(group_sum[i], params[i]->grad, group_sum[i]);
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    cpu_engine().scale(group_sum[i], 1.f / static_cast<float>(groups));  // exact for 1, 2, 4 groups
    params[i]->grad.copy_from(group_sum[i]);
  }
  opt.step(lr);
  return loss / static_cast<double>(groups * micro);
}

struct ImagePipeline {
  parallel::ProcessGrid& grid;
  parallel::PipelineStage& pipe;
  parallel::DataParallel* ddp;  // null at dp = 1
  parallel::StageShapes shapes;
  int micro;
  int64_t mbs;
};

// One pipelined step on this dp group's micro-batches (its own part of the global batch): the
// last stage's loss function feeds the cross-entropy and returns d(loss)/d(logits) scaled by
// 1/micro; data parallel exchanges gradients in the last micro-batch's backward. Returns the mean
// loss over the global batch, on every rank (summed over the pipeline, where only the last stage
// has it, and averaged over the dp groups).
double pipeline_step(ImagePipeline& p, optim::Optimizer& opt, const Batch& b, float lr) {
  const int64_t first = static_cast<int64_t>(p.grid.dp_rank()) * p.micro;
  nn::SoftmaxCrossEntropy xent;
  double loss_sum = 0;
  opt.zero_grad();
  p.pipe.train_step([&](int k) { return b.x_of(first + k, p.mbs); },
                    [&](const Tensor& out, int k) {
                      loss_sum += xent.forward(out, b.labels_of(first + k, p.mbs));
                      return xent.backward(1.f / static_cast<float>(p.micro));
                    },
                    p.shapes,
                    [&](int, bool last) {
                      if (p.ddp) p.ddp->begin_backward(last);
                    });
  if (p.ddp) p.ddp->finish();
  opt.step(lr);
  Tensor loss = Tensor::full({1}, p.pipe.last() ? static_cast<float>(loss_sum / p.micro) : 0.f);
  p.grid.pp().allreduce(loss)->wait();
  if (p.grid.dp_size() > 1) p.grid.dp().allreduce(loss, comm::ReduceOp::Avg)->wait();
  return loss.f32()[0];
}

// Every parameter (and at dp = 1 every buffer: with dp > 1 each replica's running statistics see
// only its dp group's samples) of this rank's stage within 1e-5 of the reference's of that name;
// and the stages of a pipeline hold every parameter of the model once.
void expect_stage_matches(nn::Module& stage, nn::Module& ref, parallel::ProcessGrid& grid, const std::string& what) {
  std::map<std::string, Tensor> want;
  for (nn::Parameter* p : ref.parameters()) want[p->name] = p->value;
  for (nn::Buffer* b : ref.buffers())
    if (b->value.dtype() == DType::F32) want["buffer " + b->name] = b->value;
  std::vector<std::pair<std::string, Tensor>> got;
  for (nn::Parameter* p : stage.parameters()) got.emplace_back(p->name, p->value);
  if (grid.dp_size() == 1)
    for (nn::Buffer* b : stage.buffers())
      if (b->value.dtype() == DType::F32) got.emplace_back("buffer " + b->name, b->value);
  double worst = 0;
  for (const auto& [name, value] : got) {
    ASSERT_TRUE(want.count(name)) << what << ": the stage's " << name << " is not the whole model's";
    const double d = max_abs_diff(value, want[name]);
    EXPECT_LE(d, 1e-5) << what << ": " << name;
    worst = std::max(worst, d);
  }
  Tensor count = Tensor::full({1}, static_cast<float>(stage.parameters().size()));
  grid.pp().allreduce(count)->wait();
  EXPECT_EQ(count.f32()[0], static_cast<float>(ref.parameters().size())) << what;
  Tensor w = Tensor::full({1}, static_cast<float>(worst));
  world().allreduce(w, comm::ReduceOp::Max)->wait();
  if (world().rank() == 0) std::printf("%s: largest parameter difference %.2e\n", what.c_str(), w.f32()[0]);
}

// The cut of the model: "3,5"-style, or empty to balance by measured layer costs.
std::vector<int> stage_starts(const parallel::LayerProbe& probe, const std::string& split, int pp) {
  if (!split.empty()) return parallel::parse_pp_split(split, pp, static_cast<int>(probe.seconds.size()));
  return parallel::balance_stages(parallel::least_over_ranks(probe.seconds, world()), pp);
}

// `steps` SGD steps (momentum 0.9, weight decay) of `spec` as `pp` stages cut by `split`, each
// step `micro` micro-batches of 2 samples per dp group, data parallel over the rest of the world,
// against the one-rank model on the same micro-batches: every step's loss, and every parameter at
// the end by name.
void expect_pipeline_matches_one_rank(const nn::ModelSpec& spec, int pp, const std::string& split,
                                      parallel::PipelineSchedule schedule, int micro, int steps = 10) {
  ASSERT_EQ(world().size() % pp, 0);
  parallel::ProcessGrid grid(world(), 1, pp);
  const int64_t mbs = 2;
  const Shape micro_shape = batch_of(mbs, spec.input);
  const parallel::LayerProbe probe = parallel::probe_layers(spec, micro_shape, Device::cpu());
  const std::vector<Shape>& shapes = probe.boundaries;
  const std::vector<int> starts = stage_starts(probe, split, pp);
  const int s = grid.pp_rank();
  std::unique_ptr<nn::Sequential> stage = parallel::draw_stage(spec, starts[s], starts[s + 1]);
  if (s == 0) stage->set_needs_input_grad(false);  // as the one-rank trainer: d(data) is not needed
  auto ref = nn::make_sequential_model(spec);
  ref->set_needs_input_grad(false);

  std::unique_ptr<parallel::DataParallel> ddp;
  if (grid.dp_size() > 1) ddp = std::make_unique<parallel::ReplicatedDataParallel>(*stage, grid.dp());
  parallel::PipelineStage pipe(*stage, grid.pp(), schedule, micro);
  ImagePipeline p{grid, pipe, ddp.get(), {shapes[starts[s]], shapes[starts[s + 1]]}, micro, mbs};
  optim::SgdOptions so;
  so.momentum = 0.9f;
  so.weight_decay = 1e-4f;
  optim::SGD opt_ref(ref->parameters(), so), opt(stage->parameters(), so);
  const std::string what = spec.name + " dp " + std::to_string(grid.dp_size()) + " x pp " + std::to_string(pp) + " " +
                           parallel::pipeline_schedule_name(schedule) + " cut at " + std::to_string(starts[1]);
  Rng data(31);
  for (int step = 0; step < steps; ++step) {
    const Batch b(spec, grid.dp_size() * micro * mbs, data);
    const double want = reference_step(*ref, opt_ref, b, grid.dp_size(), micro, mbs, 0.05f);
    const double got = pipeline_step(p, opt, b, 0.05f);
    EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, std::abs(want))) << what << ", step " << step;
  }
  expect_stage_matches(*stage, *ref, grid, what);
}

const nn::ModelSpec kSimpleCnn{"simple_cnn", {1, 28, 28}, 10};
const nn::ModelSpec kResnet20{"resnet20", {3, 32, 32}, 10};

}  // namespace

// Both stages of simple_cnn hold a max pool (its argmax must travel with each micro-batch).
TEST(ImagePipeline, SimpleCnnPp2GPipeMatchesOneRank) {
  expect_pipeline_matches_one_rank(kSimpleCnn, 2, "3,5", parallel::PipelineSchedule::GPipe, 3);
}

TEST(ImagePipeline, SimpleCnnPp2OneFOneBMatchesOneRank) {
  expect_pipeline_matches_one_rank(kSimpleCnn, 2, "3,5", parallel::PipelineSchedule::OneFOneB, 3);
}

// The cut after the first two blocks: BatchNorm and residual blocks on both sides, the second
// stage ending in the global average pool.
TEST(ImagePipeline, Resnet20Pp2GPipeMatchesOneRank) {
  expect_pipeline_matches_one_rank(kResnet20, 2, "5,9", parallel::PipelineSchedule::GPipe, 2);
}

TEST(ImagePipeline, Resnet20Pp2OneFOneBMatchesOneRank) {
  expect_pipeline_matches_one_rank(kResnet20, 2, "5,9", parallel::PipelineSchedule::OneFOneB, 2);
}

// As many stages as ranks, cut where the measured costs balance them.
TEST(ImagePipeline, Resnet20BalancedOverAllRanksMatchesOneRank) {
  expect_pipeline_matches_one_rank(kResnet20, world().size(), "", parallel::PipelineSchedule::OneFOneB, 4, 4);
}

TEST(ImagePipeline, SimpleCnnOverAllRanksMatchesOneRank) {
  const std::string split = world().size() == 4 ? "2,2,2,2" : "4,4";
  expect_pipeline_matches_one_rank(kSimpleCnn, world().size(), split, parallel::PipelineSchedule::GPipe, 4, 4);
}

// Every rank gets the same costs (so the same cut), one per layer, and the probe's shapes are those
// a whole model gives.
TEST(ImagePipeline, MeasuredCostsAgreeOverRanksAndShapesAreTheWholeModels) {
  const nn::ModelSpec spec{"resnet20", {3, 32, 32}, 10};
  const parallel::LayerProbe probe = parallel::probe_layers(spec, {2, 3, 32, 32}, Device::cpu());
  auto whole = nn::make_sequential_model(spec);
  EXPECT_EQ(probe.boundaries, nn::layer_boundary_shapes(*whole, {2, 3, 32, 32}));
  ASSERT_EQ(probe.seconds.size(), whole->size());
  for (size_t i = 0; i < probe.seconds.size(); ++i) EXPECT_GT(probe.seconds[i], 0) << "layer " << i;
  const std::vector<double> costs = parallel::least_over_ranks(probe.seconds, world());
  const std::vector<double> lowest = parallel::least_over_ranks(costs, world());
  for (size_t i = 0; i < costs.size(); ++i) {
    EXPECT_LE(costs[i], static_cast<float>(probe.seconds[i])) << "layer " << i;
    EXPECT_EQ(lowest[i], costs[i]) << "layer " << i;
  }
  if (world().rank() == 0) {
    std::printf("resnet20 layer costs (ms, batch 2 of 3x32x32):");
    for (double c : costs) std::printf(" %.2f", 1e3 * c);
    std::printf("\n");
  }
}

// A stage drawn alone holds the whole draw's values for its layers, under their names, and with
// repeats 0 the probe only finds the shapes.
TEST(ImagePipeline, StageDrawnAloneHasTheWholeDrawsValues) {
  const nn::ModelSpec spec{"resnet20", {3, 8, 8}, 10};
  const parallel::LayerProbe shapes = parallel::probe_layers(spec, {1, 3, 8, 8}, Device::cpu(), 0);
  EXPECT_EQ(shapes.seconds, std::vector<double>(shapes.boundaries.size() - 1, 0.0));
  for (const auto& [begin, end] : {std::pair{0, 3}, std::pair{3, 7}, std::pair{7, 14}}) {
    SCOPED_TRACE(std::to_string(begin) + ".." + std::to_string(end));
    std::unique_ptr<nn::Sequential> stage = parallel::draw_stage(spec, begin, end);
    std::unique_ptr<nn::Sequential> cut = nn::Sequential::stage_of(nn::make_sequential_model(spec), begin, end);
    const auto got = stage->parameters(), want = cut->parameters();
    ASSERT_EQ(got.size(), want.size());
    ASSERT_FALSE(got.empty());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i]->name, want[i]->name);
      EXPECT_EQ(max_abs_diff(got[i]->value, want[i]->value), 0.0) << want[i]->name;
    }
  }
}

// ZeRO-2 and ZeRO-3 under a real mpiexec, on the GPT (whose embedding and tied head are one unit):
// every stage and variant trains to plain data parallel's losses and parameters, the bytes each
// rank puts on the wire per step are the textbook ratios (read from the communicator's counter),
// and the model state each rank holds is ZeRO's share of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/model_file.h"
#include "dtrain/nn/models.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/sync_batchnorm.h"
#include "dtrain/parallel/zero/sharded_init.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

constexpr int64_t kRows = 2, kSeq = 16;  // windows per rank and step, tokens per window

nn::GptConfig tiny_gpt(int layers = 3, nn::UnitSink* sink = nullptr) {
  nn::GptConfig c;
  c.sink = sink;
  c.vocab = 64;
  c.context = 16;
  c.layers = layers;
  c.heads = 2;
  c.width = 32;
  c.seed = 7;
  return c;
}

parallel::DataParallelOptions with_built(parallel::DataParallelOptions o, parallel::ShardedInit* built) {
  o.built = built;
  return o;
}

struct Variant {
  const char* name;
  parallel::DataParallelOptions options;
};

parallel::DataParallelOptions zero(int stage, bool prefetch = true, bool reshard = true, DType wire = DType::F32) {
  parallel::DataParallelOptions o;
  o.zero = stage;
  o.prefetch = prefetch;
  o.reshard_after_forward = reshard;
  o.gather_dtype = wire;
  return o;
}

// A data-parallel GPT with AdamW (decoupled decay on matrices only), stepped on fixed batches: step
// s draws the same global batch in every run and each rank takes its rows.
struct GptRun {
  nn::Gpt model;
  std::unique_ptr<parallel::DataParallel> dp;
  std::unique_ptr<optim::Adam> opt;
  nn::SoftmaxCrossEntropy xent;
  std::vector<double> losses;

  // built: the model is built shard by shard into it (ZeRO-3).
  explicit GptRun(parallel::DataParallelOptions o, int layers = 3, parallel::ShardedInit* built = nullptr)
      : model(tiny_gpt(layers, built)), dp(parallel::make_data_parallel(model, world(), with_built(o, built))) {
    optim::AdamOptions a;
    a.decoupled = true;
    a.eps = 1e-4f;  // the attention key bias's gradient is rounding noise (see zero1_groups_test.cpp)
    opt =
        std::make_unique<optim::Adam>(dp->optimizer_groups(optim::decay_groups(model.parameters(), 0.1f, {"wpe"})), a);
    dp->broadcast_state(0);
  }

  void train(int steps, int micro_batches = 1) {
    for (int step = 0; step < steps; ++step) {
      Rng rng(1000 + static_cast<uint64_t>(step));
      const int64_t rows = kRows * kSeq, n = rows * world().size(), mine = rows * world().rank();
      Tensor ids = Tensor::empty({n}, DType::I32), targets = Tensor::empty({n}, DType::I32);
      for (int64_t i = 0; i < n; ++i) {
        ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(64));
        targets.data<int32_t>()[i] = static_cast<int32_t>((ids.data<int32_t>()[i] * 7 + 3) % 64);
      }
      for (nn::Parameter* p : model.parameters()) p->grad.zero_();
      double loss = 0;
      const int64_t part = rows / micro_batches;
      for (int k = 0; k < micro_batches; ++k) {
        const int64_t at = mine + k * part;
        dp->begin_backward(k + 1 == micro_batches);
        loss += xent.forward(model.forward(ids.slice0(at, at + part).reshape({part / kSeq, kSeq})),
                             targets.slice0(at, at + part));
        model.backward(xent.backward(1.f / static_cast<float>(micro_batches)));
      }
      dp->finish();
      opt->step(1e-2f);
      dp->after_step();
      losses.push_back(loss / micro_batches);
    }
  }

  std::map<std::string, Tensor> params() {
    parallel::WholeModel whole(dp.get());
    std::map<std::string, Tensor> out;
    for (nn::Parameter* p : model.parameters()) out[p->name] = to_host(p->value).clone();
    return out;
  }
};

double max_abs_diff(const std::map<std::string, Tensor>& got, const std::map<std::string, Tensor>& want,
                    std::string* where) {
  double worst = 0;
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    const Tensor& g = got.at(name);
    EXPECT_EQ(g.shape(), w.shape()) << name;
    for (int64_t i = 0; i < w.numel(); ++i)
      if (double d = std::abs(double(g.f32()[i]) - w.f32()[i]); d > worst) {
        worst = d;
        *where = name;
      }
  }
  return worst;
}

}  // namespace

// 30 steps of every stage and variant against plain data parallel: each step's loss and every
// parameter within 1e-5 (bf16 all-gathers round the values the passes read: each loss within 1 %).
TEST(Zero, EveryStageTrainsAsPlainDataParallel) {
  GptRun plain(zero(0));
  plain.train(30);
  const auto want = plain.params();
  const std::vector<Variant> variants = {
      {"ZeRO-1", zero(1)},
      {"ZeRO-2", zero(2)},
      {"ZeRO-3", zero(3)},
      {"ZeRO-3 without prefetch", zero(3, false)},
      {"ZeRO-3 keeping values to backward", zero(3, true, false)},
      {"ZeRO-3 without prefetch, keeping values", zero(3, false, false)},
  };
  for (const Variant& v : variants) {
    GptRun run(v.options);
    run.train(30);
    ASSERT_EQ(run.losses.size(), plain.losses.size()) << v.name;
    for (size_t i = 0; i < run.losses.size(); ++i)
      EXPECT_NEAR(run.losses[i], plain.losses[i], 1e-5 * plain.losses[i]) << v.name << " step " << i;
    std::string where;
    const double diff = max_abs_diff(run.params(), want, &where);
    EXPECT_LE(diff, 1e-5) << v.name << ": " << where;
    if (world().rank() == 0)
      std::printf("[ measured ] %s: max abs difference %.3g (%s)\n", v.name, diff, where.c_str());
  }
  GptRun bf16(zero(3, true, true, DType::BF16));
  bf16.train(30);
  for (size_t i = 0; i < bf16.losses.size(); ++i)
    EXPECT_NEAR(bf16.losses[i], plain.losses[i], 1e-2 * plain.losses[i]) << "bf16 all-gathers, step " << i;
}

// Every unit of `built` (its units by their first parameter, `units`) holds this rank's block of
// the numbers the whole build `whole_units` has at that place (zero in the padding), and the
// built model's values are empty. Returns the elements of the units.
int64_t expect_blocks_of_the_whole_build(const std::vector<std::vector<nn::Module*>>& units,
                                         const std::vector<std::vector<nn::Module*>>& whole_units,
                                         const parallel::ShardedInit& built) {
  const int r = built.rank(), n = built.ranks();
  EXPECT_EQ(whole_units.size(), units.size());
  int64_t total = 0;
  for (size_t u = 0; u < units.size() && u < whole_units.size(); ++u) {
    for (nn::Parameter* p : parallel::unit_parameters(units[u])) {
      EXPECT_EQ(p->value.numel(), 0) << p->name;
      EXPECT_EQ(p->grad.numel(), 0) << p->name;
    }
    const parallel::ShardedInit::Unit* got = built.find(parallel::unit_parameters(units[u]).front());
    EXPECT_NE(got, nullptr) << "unit " << u;
    if (!got) continue;
    std::vector<float> flat;
    for (nn::Parameter* p : parallel::unit_parameters(whole_units[u]))
      flat.insert(flat.end(), p->value.f32(), p->value.f32() + p->value.numel());
    total += static_cast<int64_t>(flat.size());
    const int64_t b = (static_cast<int64_t>(flat.size()) + n - 1) / n;
    EXPECT_EQ(got->block.numel(), b) << "unit " << u;
    for (int64_t j = 0; j < std::min(b, got->block.numel()); ++j) {
      const int64_t at = r * b + j;
      const float want = at < static_cast<int64_t>(flat.size()) ? flat[static_cast<size_t>(at)] : 0.f;
      if (got->block.f32()[j] == want) continue;
      ADD_FAILURE() << "unit " << u << " element " << at << ": " << got->block.f32()[j] << ", the whole build " << want;
      break;
    }
  }
  EXPECT_EQ(built.parameter_count(), total);
  return total;
}

// ZeRO-3 built shard by shard: after the GPT's constructor every value is empty and each unit's
// block holds the numbers a whole (one-rank) build has at that place; it trains as plain data
// parallel, bit for bit as ZeRO-3 over a whole build.
TEST(Zero, ShardByShardInitialisationKeepsOnlyEachRanksBlocks) {
  const int r = world().rank(), n = world().size();
  parallel::ShardedInit built(r, n);
  nn::Gpt sharded(tiny_gpt(3, &built));
  nn::Gpt whole(tiny_gpt(3));
  for (nn::Parameter* p : sharded.parameters()) EXPECT_EQ(p->value.numel(), 0) << p->name;
  const std::vector<std::vector<nn::Module*>> units = sharded.shard_units().by_unit();
  ASSERT_EQ(units.size(), 4u);  // the embedding with the tied head, three blocks
  EXPECT_EQ(expect_blocks_of_the_whole_build(units, whole.shard_units().by_unit(), built), whole.parameter_count());

  GptRun plain(zero(3));
  plain.train(10);
  parallel::ShardedInit into(r, n);
  GptRun blocks(zero(3), 3, &into);
  blocks.train(10);
  EXPECT_EQ(blocks.losses, plain.losses);
  std::string where;
  EXPECT_EQ(max_abs_diff(blocks.params(), plain.params(), &where), 0.0) << where;
}

// The image models and a model file built shard by shard: each top-level layer with parameters
// is handed to the sink as it is added, so no rank holds more than one of them whole; the blocks
// are the whole build's numbers and every value is left empty.
TEST(Zero, ImageModelsBuildShardByShard) {
  const char* const file = R"({"name": "tiny", "layers": [
      {"name": "conv1", "type": "conv", "out": 4, "kernel": 3, "padding": 1}, {"type": "batchnorm"},
      {"type": "relu"}, {"type": "global_avgpool"}, {"name": "fc", "type": "linear", "out": "classes"}]})";
  for (const std::string name : {"mlp", "simple_cnn", "resnet20", "tiny"}) {
    SCOPED_TRACE(name);
    nn::ModelSpec spec;
    spec.name = name;
    spec.input = name == "mlp" ? Shape{1, 8, 8} : Shape{3, 8, 8};
    spec.classes = 5;
    spec.seed = 3;
    if (name == "tiny") {
      const std::string path = "/tmp/dtrain-zero-tiny-" + std::to_string(world().rank()) + ".json";
      std::ofstream(path) << file;
      spec.definition = nn::read_model_file(path);
      std::filesystem::remove(path);
    }
    const nn::ModulePtr whole = nn::make_model(spec);
    parallel::ShardedInit built(world().rank(), world().size());
    spec.sink = &built;
    const nn::ModulePtr sharded = nn::make_model(spec);
    const std::vector<std::vector<nn::Module*>> units = sharded->shard_units().by_unit();
    EXPECT_GE(units.size(), 2u);
    EXPECT_EQ(expect_blocks_of_the_whole_build(units, whole->shard_units().by_unit(), built), whole->parameter_count());
  }
}

// How many modules below `m` (itself included) have a kind starting with `kind`.
int count_kind(nn::Module& m, const std::string& kind) {
  int n = m.kind().rfind(kind, 0) == 0 ? 1 : 0;
  for (auto& [name, child] : m.children()) n += count_kind(*child, kind);
  return n;
}

// A pipeline's stage with SyncBatchNorm is drawn shard by shard too: the stage's layers pass
// through the conversion into the blocks, which hold the whole build's numbers for the stage, and
// the other stages' values are never kept.
TEST(Zero, PipelineStageWithSyncBatchNormBuildsShardByShard) {
  nn::ModelSpec spec{"resnet20", {3, 8, 8}, 5};
  spec.seed = 3;
  for (const auto& [begin, end] : {std::pair{0, 5}, std::pair{5, 14}}) {
    SCOPED_TRACE(std::to_string(begin) + ".." + std::to_string(end));
    spec.sink = nullptr;
    const auto cut = nn::Sequential::stage_of(nn::make_sequential_model(spec), begin, end);
    parallel::ShardedInit built(world().rank(), world().size());
    parallel::SyncBatchNormSink sync(world(), &built);
    spec.sink = &sync;
    const auto stage = parallel::draw_stage(spec, begin, end);
    EXPECT_EQ(expect_blocks_of_the_whole_build(stage->shard_units().by_unit(), cut->shard_units().by_unit(), built),
              cut->parameter_count());
    EXPECT_GT(count_kind(*cut, "BatchNorm2d"), 0);
    EXPECT_EQ(count_kind(*stage, "SyncBatchNorm"), count_kind(*cut, "BatchNorm2d"));
    EXPECT_EQ(count_kind(*stage, "BatchNorm2d"), 0);
  }
}

// ZeRO-2/3 load a set's pieces into their own (a resume at any rank count): the whole tensors of a
// trained run, handed over in pieces of 7 elements (cut where no rank's block is), give a fresh run
// the trained parameters and optimizer state, and it goes on as the trained run does, bit for bit;
// a tensor left out is named on every rank that holds some of it.
TEST(Zero, LoadPiecesTakesEachRanksPartOfAnyCut) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("ZeRO-" + std::to_string(stage));
    GptRun trained(zero(stage));
    trained.train(3);
    std::map<std::string, Tensor> whole;
    for (const auto& [name, t] : trained.params()) whole["param/" + name] = t;
    for (const auto& [name, t] : trained.dp->gather_state(trained.opt->state())) whole["optim/" + name] = to_host(t);
    std::map<std::string, int64_t> unwanted;  // pieces the loading rank said it needs nothing of (left out)
    auto in_pieces = [&](const std::string& skip) {
      return [&whole, &unwanted, skip](const parallel::PieceTaker& take, const parallel::PieceWanted& wants) {
        for (const auto& [key, t] : whole) {
          if (key == skip) continue;
          const Tensor flat = t.reshape({t.numel()});
          for (int64_t from = 0; from < t.numel(); from += 7) {
            const int64_t count = std::min<int64_t>(7, t.numel() - from);
            if (wants(key, from, count, t.shape()))
              take(key, from, t.shape(), flat.slice0(from, from + count));
            else
              ++unwanted[key.substr(0, key.find('/'))];
          }
        }
      };
    };
    GptRun fresh(zero(stage));
    fresh.dp->load_pieces(in_pieces(""), fresh.opt->state());
    // Each rank takes 1/N of the values and the state: the rest is never read. ZeRO-2 then gathers
    // the whole values from the blocks' owners, as a resume does.
    if (world().size() > 1) {
      EXPECT_GT(unwanted["param"], 0);
      EXPECT_GT(unwanted["optim"], 0);
    }
    fresh.dp->broadcast_state(0);
    fresh.opt->set_steps(3);  // as a resume sets it
    std::string where;
    EXPECT_EQ(max_abs_diff(fresh.params(), trained.params(), &where), 0.0) << where;
    const std::map<std::string, Tensor> state = fresh.dp->gather_state(fresh.opt->state());
    for (const auto& [name, t] : trained.dp->gather_state(trained.opt->state())) {
      const Tensor want = to_host(t), got = to_host(state.at(name));
      for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(got.f32()[i], want.f32()[i]) << name << " element " << i;
    }
    fresh.train(2);
    trained.train(2);
    EXPECT_EQ(fresh.losses, std::vector<double>(trained.losses.end() - 2, trained.losses.end()));

    GptRun missing(zero(stage));
    // The ranks whose blocks reach into it (at ZeRO-2 too: the other blocks come from their owners).
    const bool holds = !missing.dp->gradient_parts(*missing.model.parameters().front()).parts.empty();
    const std::string first = "param/" + missing.model.parameters().front()->name;
    try {
      missing.dp->load_pieces(in_pieces(first), missing.opt->state());
      EXPECT_FALSE(holds) << "a rank holding part of " << first << " loaded without it";
    } catch (const InputError& e) {
      EXPECT_TRUE(holds) << e.what();
      EXPECT_NE(std::string(e.what()).find(first), std::string::npos) << e.what();
    }
  }
}

// Gradient accumulation under ZeRO-2/3 reduce-scatters every micro-batch into the shard: the same
// steps as plain data parallel accumulating locally.
TEST(Zero, AccumulationMatchesPlainDataParallel) {
  GptRun plain(zero(0));
  plain.train(10, 2);
  const auto want = plain.params();
  for (int stage : {2, 3}) {
    GptRun run(zero(stage));
    run.train(10, 2);
    std::string where;
    EXPECT_LE(max_abs_diff(run.params(), want, &where), 1e-5) << "ZeRO-" << stage << ": " << where;
  }
}

// Bytes on the wire per step, from the communicator's counter (a ring's bytes per call): ZeRO-2
// moves data parallel's (a reduce-scatter and an all-gather are one allreduce), ZeRO-3 1.5 x (the
// values are gathered for forward and again for backward), ZeRO-3 with bf16 all-gathers 1.0 x.
// Units are padded to the rank count one by one, the flat buffer once: within 2 %.
TEST(Zero, WireBytesPerStepAreZerosRatios) {
  if (world().size() == 1) GTEST_SKIP() << "needs several ranks";
  auto per_step = [](const parallel::DataParallelOptions& o) {
    GptRun run(o);
    run.train(1);  // the first step may differ (nothing does here, but warm-ups elsewhere do)
    const int64_t before = world().wire_bytes_sent();
    run.train(3);
    return static_cast<double>(world().wire_bytes_sent() - before) / 3;
  };
  const double plain = per_step(zero(0));
  const std::vector<std::pair<Variant, double>> expected = {
      {{"ZeRO-2", zero(2)}, 1.0},
      {{"ZeRO-3", zero(3)}, 1.5},
      {{"ZeRO-3 without prefetch", zero(3, false)}, 1.5},
      {{"ZeRO-3, bf16 all-gathers", zero(3, true, true, DType::BF16)}, 1.0},
  };
  for (const auto& [v, ratio] : expected) {
    const double got = per_step(v.options) / plain;
    EXPECT_NEAR(got, ratio, 0.02 * ratio) << v.name;
    if (world().rank() == 0) std::printf("[ measured ] %s: %.4f x data parallel's bytes per step\n", v.name, got);
  }
}

// The model state a rank holds, from memory_bytes() and the optimizer's state: ZeRO-2 at most
// 1.05 x (4 + 12/N) bytes a parameter; ZeRO-3 at most 1.05 x 16/N plus the largest units gathered
// at once (its peak: the embedding with the head, which spans the pass, a block, the next one and
// the spare buffer), never the whole model (8 blocks here).
TEST(Zero, ModelStatePerRankIsZerosShare) {
  const double n = world().size();
  auto bytes = [](GptRun& run) {
    double sum = 0;
    for (const auto& [kind, b] : run.dp->memory_bytes())
      if (kind != "gathered units (peak)" && kind != "gradient buffers (peak)") sum += static_cast<double>(b);
    for (const optim::StateTensor& st : run.opt->state()) sum += static_cast<double>(st.value->nbytes());
    return sum;
  };
  GptRun two(zero(2), 8);
  two.train(2);
  const double params = static_cast<double>(nn::gpt_parameter_count(tiny_gpt(8)));
  EXPECT_LE(bytes(two) / params, 1.05 * (4 + 12 / n));
  GptRun three(zero(3), 8);
  three.train(2);
  const double gathered = static_cast<double>(three.dp->memory_bytes().at("gathered units (peak)"));
  EXPECT_GT(gathered, 0);
  EXPECT_LE(bytes(three) / params, 1.05 * 16 / n);
  EXPECT_LT(gathered, 0.6 * 4 * params);  // never the whole model at once
  if (world().rank() == 0)
    std::printf("[ measured ] %d ranks: ZeRO-2 %.2f, ZeRO-3 %.2f bytes a parameter (+ %.0f gathered at the peak)\n",
                world().size(), bytes(two) / params, bytes(three) / params, gathered);
}

// The GPT's data parallel under a real mpiexec: every gradient compressor trains (PowerSGD and top-k
// close to the uncompressed run), compressed runs resume exactly from their per-rank parts, and
// --accumulate splits a batch without changing what it learns.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "../train/lm_test_util.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/data/text.h"
#include "dtrain/train/lm_trainer.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

// Sentences of words drawn at random (seeded): the spelling can be learnt, the word order cannot, so
// the loss levels off well above zero and relative differences between runs mean something.
void write_random_words(const std::filesystem::path& dir) {
  const char* words[] = {"time",   "river",  "stone",   "green",  "under",  "light",  "seven",
                         "paper",  "quiet",  "north",   "apple",  "moving", "garden", "window",
                         "silver", "before", "thunder", "market", "yellow", "winter", "bridge",
                         "forest", "candle", "mirror",  "engine", "harbor", "pocket", "castle"};
  std::filesystem::create_directories(dir / "text");
  {
    std::ofstream out(dir / "text" / "a.txt");
    Rng rng(11);
    for (int i = 0; i < 4000; ++i) out << words[rng.below(sizeof words / sizeof *words)] << (i % 9 == 8 ? ".\n" : " ");
  }
  data::convert_text({(dir / "text").string()}, (dir / "tok").string());
}

// A tiny GPT on a small corpus that rank 0 writes into a fresh directory.
struct Corpus {
  std::filesystem::path dir;
  explicit Corpus(const std::string& tag) {
    int pid = static_cast<int>(::getpid());
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    dir = "/tmp/dtrain-lmdp-" + tag + "-" + std::to_string(pid);
    if (world().rank() == 0) write_random_words(dir);
    world().barrier();
  }
  ~Corpus() {
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
  train::TrainConfig config() const {
    nn::GptConfig g;
    g.context = 16;
    g.layers = 2;
    g.heads = 2;
    g.width = 32;
    g.seed = 3;
    train::TrainConfig c = test::small_lm_config(dir / "tok", g);
    c.steps = 200;
    c.lr = 3e-3f;
    c.warmup_steps = 5;
    c.eval_batches = 8;
    c.compression_warmup = 10;
    return c;
  }
};

}  // namespace

// Every --compression kind trains the GPT on the dp group: after 200 steps the validation loss is
// finite, below the untrained model's (ln 256 = 5.55 nats) and within the stated distance of the
// uncompressed run's. Measured on this corpus (2 ranks): fp16/bf16 +0.00 %, top-k 0.1 +24.9 %,
// 0.3 +12.2 %, PowerSGD rank 2 +9.0 %, 4 +3.7 %, 8 +0.9 %, 1-bit +26.0 %, QSGD 16 +25.9 %: the
// sparser or coarser, the further behind AdamW falls in 200 steps. Top-k keeping everything is the
// uncompressed run (the compression path adds nothing of its own).
TEST(LmDataParallel, EveryCompressorTrainsNearTheUncompressedRun) {
  Corpus corpus("compress");
  train::TrainConfig c = corpus.config();
  const train::TrainResult plain = train::train_lm(c, &world());
  ASSERT_LT(plain.last_eval.loss, 3.0);
  struct Kind {
    const char* compression;
    double tolerance;
  };
  for (const Kind& k :
       {Kind{"topk:1", 1e-5}, Kind{"fp16", 1e-3}, Kind{"bf16", 1e-3}, Kind{"topk:0.1", 0.30}, Kind{"powersgd:2", 0.12},
        Kind{"powersgd:8", 0.02}, Kind{"onebit", 0.35}, Kind{"qsgd:16", 0.35}}) {
    c.compression = k.compression;
    const train::TrainResult got = train::train_lm(c, &world());
    EXPECT_TRUE(std::isfinite(got.last_eval.loss)) << k.compression;
    EXPECT_LT(got.last_eval.loss, std::log(256.0)) << k.compression;
    EXPECT_NEAR(got.last_eval.loss, plain.last_eval.loss, k.tolerance * plain.last_eval.loss) << k.compression;
    if (world().rank() == 0)
      std::printf("[ measured ] %-10s val_loss %.4f (uncompressed %.4f, %+.2f %%)\n", k.compression, got.last_eval.loss,
                  plain.last_eval.loss, 100 * (got.last_eval.loss / plain.last_eval.loss - 1));
  }
}

// A compressed run checkpointed at step 100 and resumed ends with the uninterrupted run's losses,
// bit for bit: each rank's error feedback (and PowerSGD's Q) comes back from its part.
TEST(LmDataParallel, CompressedRunsResumeExactly) {
  Corpus corpus("resume");
  for (const char* kind : {"topk:0.1", "powersgd:2"}) {
    train::TrainConfig c = corpus.config();
    c.compression = kind;
    c.checkpoint_every = 100;
    c.checkpoint_dir = (corpus.dir / (std::string("ckpt-") + kind)).string();
    const train::TrainResult whole = train::train_lm(c, &world());
    c.resume = c.checkpoint_dir + "/ckpt-step000000100.h5";
    c.checkpoint_dir = (corpus.dir / (std::string("again-") + kind)).string();
    const train::TrainResult resumed = train::train_lm(c, &world());
    if (world().rank() == 0) {
      ASSERT_EQ(resumed.step_losses.size(), 100u) << kind;
      for (size_t i = 0; i < 100; ++i)
        EXPECT_EQ(resumed.step_losses[i], whole.step_losses[100 + i]) << kind << " " << i;
    }
    EXPECT_EQ(resumed.last_eval.loss, whole.last_eval.loss) << kind;
    // Without compression the parts are not used, and the run says so instead of failing.
    c.compression = "none";
    c.checkpoint_dir = (corpus.dir / (std::string("plain-") + kind)).string();
    EXPECT_NO_THROW(train::train_lm(c, &world())) << kind;
  }
}

// --accumulate 2 of batch 4 sees the windows of one batch of 8 and learns the same: every step's loss
// within 1e-5 (the GEMMs differ in shape only; the loss is the mean over both micro-batches), and
// both final models give the same validation loss on the same windows within 1e-5.
TEST(LmDataParallel, AccumulateMatchesTheLargerBatch) {
  Corpus corpus("accumulate");
  train::TrainConfig c = corpus.config();
  c.steps = 20;
  c.batch_size = 8;
  c.checkpoint_dir = (corpus.dir / "big").string();
  const train::TrainResult big = train::train_lm(c, &world());
  c.batch_size = 4;
  c.accumulate = 2;
  c.checkpoint_dir = (corpus.dir / "split").string();
  const train::TrainResult split = train::train_lm(c, &world());
  if (world().rank() == 0) {
    ASSERT_EQ(split.step_losses.size(), big.step_losses.size());
    for (size_t i = 0; i < big.step_losses.size(); ++i)
      EXPECT_NEAR(split.step_losses[i], big.step_losses[i], 1e-5 * big.step_losses[i]) << "step " << i;
    const std::string val = (corpus.dir / "tok" / "val.h5").string();
    auto validate = [&](const train::TrainResult& r) {
      auto model = train::gpt_from_checkpoint(train::load_checkpoint_set(r.checkpoint));
      return train::evaluate_lm(*model, val, 8, c.context, 8);
    };
    const double want = validate(big);
    EXPECT_NEAR(validate(split), want, 1e-5 * want);
  }
  c.pp = 2;  // a pipeline step already runs micro-batches
  EXPECT_THROW(train::train_lm(c, &world()), InputError);
}

// --zero1 keeps AdamW's groups (no decay on vectors and the position table): the GPT trained with
// sharded optimizer state equals plain data parallel within 1e-5 (every parameter after 30 steps,
// and every step's loss), and a checkpoint written under ZeRO-1 resumes without it exactly there.
TEST(LmDataParallel, Zero1MatchesPlainDataParallel) {
  Corpus corpus("zero1");
  train::TrainConfig c = corpus.config();
  c.steps = 30;
  c.weight_decay = 0.1f;  // large enough that a lost group shows
  // Attention's key bias has an exactly zero gradient (softmax is shift-invariant per query), so it
  // receives rounding noise only, summed in another order by reduce-scatter than by allreduce; AdamW
  // with eps 1e-8 scales that noise up to whole steps (6e-5 apart after 30 steps, every other
  // parameter within 1e-6). eps 1e-4 keeps the noise noise; the decay groups still decide.
  c.eps = 1e-4f;
  comm::Runtime& rt = comm::Runtime::get();
  auto params_after = [&](const train::TrainConfig& cfg, std::vector<double>* losses) {
    train::Trainer t(cfg, rt, &world());
    train::TrainResult r = t.run();
    if (losses) *losses = r.step_losses;
    std::map<std::string, Tensor> out;
    for (nn::Parameter* p : t.model().parameters()) out[p->name] = p->value.clone();
    return out;
  };
  std::vector<double> plain_losses, zero1_losses;
  const auto plain = params_after(c, &plain_losses);
  train::TrainConfig z = c;
  z.zero = 1;
  z.checkpoint_dir = (corpus.dir / "ckpt").string();
  z.checkpoint_every = 15;
  const auto sharded = params_after(z, &zero1_losses);
  auto expect_close = [&](const std::map<std::string, Tensor>& got, const char* what) {
    ASSERT_EQ(got.size(), plain.size());
    for (const auto& [name, want] : plain) {
      const Tensor& g = got.at(name);
      double worst = 0;
      for (int64_t i = 0; i < want.numel(); ++i) worst = std::max(worst, std::abs(double(g.f32()[i]) - want.f32()[i]));
      EXPECT_LE(worst, 1e-5) << what << ": " << name;
    }
  };
  expect_close(sharded, "ZeRO-1");
  ASSERT_EQ(zero1_losses.size(), plain_losses.size());
  for (size_t i = 0; i < plain_losses.size(); ++i)
    EXPECT_NEAR(zero1_losses[i], plain_losses[i], 1e-5 * plain_losses[i]) << "step " << i;
  train::TrainConfig resume = c;
  resume.resume = (corpus.dir / "ckpt" / "ckpt-step000000015.h5").string();
  expect_close(params_after(resume, nullptr), "resumed without ZeRO-1");
}

// Data parallel under a real mpiexec: every layout trains to the same parameters as one rank with
// the whole batch. The single-rank reference runs on every rank over a communicator of its own.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "../train/train_test_util.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/parallel/sync_batchnorm.h"
#include "dtrain/train/trainer.h"
#include "trainer_params.h"

using namespace dtrain;

namespace {

// One dataset directory for the whole job: rank 0 writes it, the others wait.
const std::string& dataset() {
  static std::string dir = [] {
    int pid = static_cast<int>(::getpid());
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    std::string d = "/tmp/dtrain-parallel-test-" + std::to_string(pid);
    if (comm::Runtime::get().topology().rank == 0) test::make_band_dataset(d, 384, 8, 4, 128);
    MPI_Barrier(MPI_COMM_WORLD);
    return d;
  }();
  return dir;
}

train::TrainConfig config(std::vector<std::string> args) {
  return test::trainer_config(dataset(), 20, std::move(args));
}

using test::expect_params_close;
using test::ParamValues;
using test::train_params;
using test::with;

// Parameters of `layout` on all ranks equal the single-rank run of `reference` (relative 1e-5).
void expect_same_training(const std::vector<std::string>& layout, const std::vector<std::string>& reference) {
  comm::Communicator& world = comm::Runtime::get().world();
  auto solo = world.split(world.rank(), 0, "solo");
  auto ref = train_params(config(reference), *solo);
  expect_params_close(train_params(config(layout), world), ref, "against the single-rank run");
}

// Parameters of two layouts run on all ranks agree (relative 1e-5).
void expect_layouts_agree(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  comm::Communicator& world = comm::Runtime::get().world();
  auto first = train_params(config(a), world);
  expect_params_close(first, train_params(config(b), world), "between the layouts");
}

// The parameters and buffers `got` holds (a pipeline stage's) within relative 1e-5 of `want`'s.
void expect_stage_close(const ParamValues& got, const ParamValues& want, const std::string& what) {
  ASSERT_FALSE(got.empty()) << what;
  for (const auto& [name, g] : got) {
    ASSERT_TRUE(want.count(name)) << what << ": " << name << " is not in the reference";
    expect_params_close({{name, g}}, {{name, want.at(name)}}, what);
  }
}

// An image model (built in, or a model file's path) under AdamW with weight decay.
std::vector<std::string> adamw_run(const std::string& model) {
  return {model.ends_with(".json") ? "--model-file" : "--model",
          model,
          "--optimizer",
          "adamw",
          "--lr",
          "0.003",
          "--weight-decay",
          "0.01"};
}

// ZeRO-2, ZeRO-3, and ZeRO-3 without prefetch keeping each unit from forward to backward.
std::vector<std::vector<std::string>> sharded_variants() {
  return {{"--zero", "2"},
          {"--zero", "3"},
          {"--zero", "3", "--zero-prefetch", "false", "--reshard-after-forward", "false"}};
}

// Under pp 2 over an even world, ranks r and r + dp hold the two stages of dp rank r: each set of
// dp consecutive ranks runs the reference without stages by itself.
std::unique_ptr<comm::Communicator> stage_reference_group(comm::Communicator& world) {
  const int dp = world.size() / 2;
  return world.split(world.rank() / dp, world.rank() % dp, "reference");
}

}  // namespace

TEST(DataParallel, MatchesOneRankWithTheWholeBatch) {
  expect_same_training({"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"},
                       {"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"});
}

TEST(DataParallel, SmallBucketsChangeNothing) {
  // Many buckets (one per tensor or so) exercise the overlap path: each goes out from the hook.
  expect_same_training({"--model", "mlp", "--hidden", "64,32", "--bucket-mb", "1", "--lr", "0.05"},
                       {"--model", "mlp", "--hidden", "64,32", "--lr", "0.05"});
}

TEST(DataParallel, Zero1MatchesPlainDataParallel) {
  expect_same_training(
      {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01", "--zero1", "true"},
      {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"});
}

// Compression with ZeRO-1: the compressed exchange leaves the averaged gradient on every rank and
// the sharded optimizer takes its slice, so the run equals the same compression without ZeRO-1
// (top-k with AdamW, top-k with SGD's momentum moved into the compressor, PowerSGD).
TEST(DataParallel, CompressionWithZero1MatchesCompressionWithout) {
  if (comm::Runtime::get().world().size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::vector<std::vector<std::string>> runs = {
      {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--compression", "topk:0.05"},
      {"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--compression",
       "topk:0.05"},
      {"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--compression",
       "powersgd:2"}};
  for (std::vector<std::string> run : runs) {
    run.insert(run.end(), {"--compression-warmup", "5"});
    std::vector<std::string> sharded = run;
    sharded.insert(sharded.end(), {"--zero1", "true"});
    SCOPED_TRACE(run[run.size() - 3]);
    expect_layouts_agree(sharded, run);
  }
}

// A checkpoint written on 2 ranks resumes on 1 rank and on 4 (at np 4) with the same global batch:
// every step sees the samples of the uninterrupted 2-rank run, so the parameters after 20 steps
// equal it within 1e-5.
TEST(DataParallel, ResumesOnAnotherRankCount) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string dir = dataset() + "-resume-" + std::to_string(world.size());
  const std::vector<std::string> run = {"--model",    "simple_cnn", "--optimizer", "sgd",
                                        "--momentum", "0.9",        "--lr",        "0.05"};
  auto pair = world.split(world.rank() < 2 ? 0 : comm::Communicator::kNoColor, world.rank(), "pair");
  ParamValues whole;
  if (pair) {
    std::vector<std::string> write = run;
    write.insert(write.end(), {"--checkpoint-dir", dir, "--checkpoint-every", "10"});
    whole = train_params(config(write), *pair);
  }
  world.barrier();
  auto solo = world.split(world.rank(), 0, "solo");
  std::vector<std::string> resume = run;
  resume.insert(resume.end(), {"--resume", dir + "/ckpt-step000000010.h5"});
  auto expect_equal = [&](const ParamValues& got, const char* what) {
    if (pair) expect_params_close(got, whole, what);  // ranks 2 and 3 hold no uninterrupted run
  };
  expect_equal(train_params(config(resume), *solo), "resumed on 1 rank");
  expect_equal(train_params(config(resume), world), "resumed on every rank");
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

TEST(DataParallel, SyncBatchNormMatchesBatchNormOverTheWholeBatch) {
  // A small learning rate: ResNet-20 on 8x8 images at batch 16 has many pre-activations near 0, and
  // at lr 0.02 rounding-level differences flip ReLUs after a step or two (measured: 1e-7 apart after
  // one step, 7e-5 after two, identically at 2 and 4 ranks); at 0.002 the runs stay within 1e-6.
  expect_same_training({"--model", "resnet20", "--sync-batchnorm", "true", "--lr", "0.002"},
                       {"--model", "resnet20", "--lr", "0.002"});
  // At ZeRO-3 each layer is converted as it is drawn, then sharded (no whole model is built).
  expect_same_training({"--model", "resnet20", "--sync-batchnorm", "true", "--lr", "0.002", "--zero", "3"},
                       {"--model", "resnet20", "--lr", "0.002"});
}

TEST(DataParallel, AccumulationMatchesTheLargeBatch) {
  expect_same_training({"--model", "simple_cnn", "--accumulate", "2", "--lr", "0.05"},
                       {"--model", "simple_cnn", "--lr", "0.05"});
}

TEST(DataParallel, PowerSgdWarmUpSendsUncompressedGradients) {
  // For its first --compression-warmup steps PowerSGD steps aside: all 20 steps here are plain
  // allreduce, so the run equals one rank with the whole batch (rank 2 would not: it is lossy).
  expect_same_training({"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05",
                        "--compression", "powersgd:2", "--compression-warmup", "20"},
                       {"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"});
}

// --compression-scope inter-node: on one node the exchange is exact, so the run equals one rank with
// the whole batch; on 2 nodes of 2 ranks (the DTRAIN_TEST_RANKS_PER_NODE hook, np 4) the nodes'
// averages go through top-k, so the run departs from the exact one while every replica stays the
// same, and --check-replicas agrees.
TEST(DataParallel, CompressionScopeInterNodeIsExactWithinANode) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::vector<std::string> exact = {"--model", "mlp",        "--hidden", "64,32", "--optimizer",
                                          "sgd",     "--momentum", "0.9",      "--lr",  "0.05"};
  std::vector<std::string> scoped = exact;
  for (const char* a : {"--compression", "topk:0.05", "--compression-scope", "inter-node", "--check-replicas", "5"})
    scoped.push_back(a);
  expect_same_training(scoped, exact);
  if (world.size() != 4) return;
  ::setenv("DTRAIN_TEST_RANKS_PER_NODE", "2", 1);
  const ParamValues two_nodes = train_params(config(scoped), world);
  ::unsetenv("DTRAIN_TEST_RANKS_PER_NODE");
  const ParamValues plain = train_params(config(exact), world);
  double departs = 0;
  for (const auto& [name, v] : plain)
    for (size_t i = 0; i < v.size(); ++i) departs = std::max(departs, std::abs(double(two_nodes.at(name)[i]) - v[i]));
  EXPECT_GT(departs, 1e-4) << "top-k between the nodes changed nothing";
  const std::vector<float>& w = two_nodes.begin()->second;
  Tensor mine = Tensor::empty({static_cast<int64_t>(w.size())});
  std::copy(w.begin(), w.end(), mine.f32());
  Tensor first = mine.clone();
  world.broadcast(first, 0)->wait();
  EXPECT_EQ(std::memcmp(first.f32(), mine.f32(), mine.nbytes()), 0) << "replicas differ";
}

TEST(DataParallel, CompressedRunsResumeExactly) {
  // Resumed from its step-10 checkpoint, a compressed run ends with the uninterrupted run's
  // parameters, bit for bit: each rank's compression state (error-feedback residuals, PowerSGD's Q,
  // top-k momentum, QSGD's count of draws) is in that rank's part of the checkpoint.
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::vector<std::vector<std::string>> kinds = {{"topk:0.05"}, {"powersgd:2"}, {"qsgd:16"}, {"sign"}};
  int n = 0;
  for (const auto& kind : kinds) {
    const std::string dir = dataset() + "-ckpt" + std::to_string(n++);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
    world.barrier();
    std::vector<std::string> args = {"--model", "simple_cnn", "--optimizer",          "sgd", "--momentum",   "0.9",
                                     "--lr",    "0.05",       "--compression-warmup", "4",   "--compression"};
    args.insert(args.end(), kind.begin(), kind.end());
    std::vector<std::string> straight = args, resumed = args;
    straight.insert(straight.end(), {"--checkpoint-dir", dir, "--checkpoint-every", "10"});
    resumed.insert(resumed.end(), {"--resume", dir + "/ckpt-step000000010.h5"});
    auto want = train_params(config(straight), world);
    ASSERT_TRUE(std::filesystem::exists(dir + "/ckpt-step000000010.h5.rank" + std::to_string(world.rank()))) << kind[0];
    auto got = train_params(config(resumed), world);
    for (auto& [name, w] : want) EXPECT_EQ(got[name], w) << name << " after resuming " << kind[0];
    // Without a rank's part the checkpoint is refused on every rank, naming the part.
    world.barrier();
    if (world.rank() == 0 && n == 1) std::filesystem::remove(dir + "/ckpt-step000000010.h5.rank1");
    world.barrier();
    if (n == 1) {
      try {
        train_params(config(resumed), world);
        ADD_FAILURE() << "resumed without rank 1's compression state";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("ckpt-step000000010.h5.rank1"), std::string::npos) << e.what();
      }
    }
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
}

namespace {

// Makes `fault` of checkpoint part `part` (from its good copy `saved`): "flipped" (a byte of dataset
// `tensor`'s data: only the part's own checksum sees it), "missing", "torn" (truncated), "grown"
// (bytes appended: HDF5 still reads it, only the manifest's size sees it), "rewritten" (a file that
// passes its own checksums with one value of `tensor` changed: only the manifest's checksum sees it),
// or "other run" (`other`'s copy). Returns the words the refusal must hold.
std::string make_part_fault(const std::string& fault, const std::string& part, const std::string& saved,
                            const std::string& tensor, const std::string& other = "") {
  namespace fs = std::filesystem;
  fs::copy_file(saved, part, fs::copy_options::overwrite_existing);
  if (fault == "flipped") {
    EXPECT_TRUE(test::flip_dataset_byte(part, tensor, 40, 0x01));
    return "fails its checksum";
  }
  if (fault == "missing") {
    fs::remove(part);
    return "is missing";
  }
  if (fault == "torn" || fault == "grown") {
    if (fault == "torn") fs::resize_file(part, fs::file_size(part) * 3 / 4);
    if (fault == "grown") std::ofstream(part, std::ios::app | std::ios::binary) << "more bytes";
    return "(torn or replaced)";
  }
  if (fault == "rewritten") {
    train::CheckpointState s = train::load_checkpoint(part);
    s.tensors.at(tensor).f32()[0] += 1.f;
    train::save_checkpoint(part, s);
    EXPECT_EQ(fs::file_size(part), fs::file_size(saved)) << "the rewritten part has another size";
    return "(rewritten or replaced)";
  }
  fs::copy_file(other, part, fs::copy_options::overwrite_existing);
  return "was written by another run";
}

// What a resume's checks say of the set `main_file` (checked as rank `rank` of `world` checks it).
std::string set_refusal(const std::string& main_file, int rank, int world) {
  try {
    const train::CheckpointState m = train::load_checkpoint_set(main_file);
    train::check_manifest(m, main_file);
    if (m.ints.count("compression_ranks") && m.ints.at("compression_ranks") > 0)
      train::load_rank_part(m, main_file, rank, world);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no refusal)";
}

}  // namespace

// The parts of the newest set are checked against its manifest before a resume from the folder
// takes it: a flipped byte in one rank's compression part, a missing, torn, grown or rewritten part,
// or a part of another run with the same step (a second run into another folder) makes every rank
// skip that set, naming the part and why, and resume from the one before, ending bitwise where the
// uninterrupted run ended (0 steps lost beyond the checkpoint interval).
TEST(DataParallel, ResumeSkipsASetWithABadCompressionPart) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string dir = dataset() + "-bad-part", other = dataset() + "-other-run";
  if (world.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(other);
  }
  world.barrier();
  const std::vector<std::string> args = {
      "--model", "simple_cnn", "--optimizer",   "sgd",       "--momentum",         "0.9",
      "--lr",    "0.05",       "--compression", "topk:0.05", "--checkpoint-every", "10"};
  std::vector<std::string> straight = args, elsewhere = args, resumed = args;
  straight.insert(straight.end(), {"--checkpoint-dir", dir});
  elsewhere.insert(elsewhere.end(), {"--checkpoint-dir", other});
  resumed.insert(resumed.end(), {"--resume", dir});
  const ParamValues want = train_params(config(straight), world);
  train_params(config(elsewhere), world);
  const std::string newest = dir + "/ckpt-step000000020.h5", part1 = newest + ".rank1";
  const std::string saved = dir + "/saved.rank1";
  if (world.rank() == 0) std::filesystem::copy_file(part1, saved);
  for (const std::string fault : {"flipped", "missing", "other run", "torn", "grown", "rewritten"}) {
    SCOPED_TRACE(fault);
    world.barrier();
    if (world.rank() == 0) {
      const std::string reason =
          make_part_fault(fault, part1, saved, "compress/bucket0.residual", other + "/ckpt-step000000020.h5.rank1");
      const std::string refusal = set_refusal(newest, 1, world.size());
      EXPECT_NE(refusal.find(reason), std::string::npos) << refusal;
      EXPECT_NE(refusal.find(part1), std::string::npos) << refusal;
    }
    world.barrier();
    const ParamValues got = train_params(config(resumed), world);
    for (const auto& [name, w] : want) EXPECT_EQ(got.at(name), w) << name;
  }
  world.barrier();
  if (world.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(other);
  }
}

// The same for a pipeline stage's part (2 stages): a flipped byte, a missing, torn, grown or
// rewritten stage part makes the resume skip the newest set, naming the part, and end bitwise where
// the uninterrupted pipelined run ended.
TEST(Pipeline, ResumeSkipsASetWithABadStagePart) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const std::string dir = dataset() + "-bad-stage";
  if (world.rank() == 0) std::filesystem::remove_all(dir);
  world.barrier();
  const std::vector<std::string> args = {
      "--model", "simple_cnn", "--lr", "0.05", "--pp", "2", "--micro-batches", "2", "--checkpoint-every", "10"};
  std::vector<std::string> straight = args, resumed = args;
  straight.insert(straight.end(), {"--checkpoint-dir", dir});
  resumed.insert(resumed.end(), {"--resume", dir});
  const ParamValues want = train_params(config(straight), world);
  const std::string newest = dir + "/ckpt-step000000020.h5", part = train::stage_part_file(newest, 1);
  const std::string saved = dir + "/saved.stage1";
  std::string tensor;  // the stage's first parameter
  if (world.rank() == 0) {
    std::filesystem::copy_file(part, saved);
    for (const auto& [name, t] : train::load_checkpoint(part).tensors)
      if (tensor.empty() && name.rfind("param/", 0) == 0 && t.dtype() == DType::F32 && t.numel() > 16) tensor = name;
    EXPECT_FALSE(tensor.empty());  // not ASSERT: rank 1 waits at the next barrier
  }
  for (const std::string fault : {"flipped", "missing", "torn", "grown", "rewritten"}) {
    SCOPED_TRACE(fault);
    world.barrier();
    if (world.rank() == 0) {
      const std::string reason = make_part_fault(fault, part, saved, tensor);
      const std::string refusal = set_refusal(newest, 0, world.size());
      EXPECT_NE(refusal.find(reason), std::string::npos) << refusal;
      EXPECT_NE(refusal.find(part), std::string::npos) << refusal;
    }
    world.barrier();
    const ParamValues got = train_params(config(resumed), world);
    for (const auto& [name, w] : want) EXPECT_EQ(got.at(name), w) << name;
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

TEST(DataParallel, OneRanksCheckpointPartFailureFailsEveryRank) {
  // A part only rank 1 cannot write (its temporary file's name is taken by a directory), then a
  // part only rank 1 cannot read (not HDF5): every rank throws the same InputError naming rank 1's
  // file, none waits in a collective for rank 1, and no checkpoint without its parts appears.
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string dir = dataset() + "-ckpt-fail", ckpt = dir + "/ckpt-step000000010.h5";
  if (world.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(ckpt + ".rank1.tmp");
  }
  world.barrier();
  std::vector<std::string> args = {"--model",       "simple_cnn", "--optimizer",          "sgd", "--lr", "0.05",
                                   "--compression", "topk:0.05",  "--compression-warmup", "4"};
  std::vector<std::string> straight = args, resumed = args;
  straight.insert(straight.end(), {"--checkpoint-dir", dir, "--checkpoint-every", "10"});
  resumed.insert(resumed.end(), {"--resume", ckpt});
  try {
    train_params(config(straight), world);
    ADD_FAILURE() << "rank " << world.rank() << " finished although rank 1 could not write its part";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-step000000010.h5.rank1.tmp"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(ckpt)) << "a checkpoint without rank 1's part";
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(ckpt + ".rank1.tmp");
  world.barrier();
  train_params(config(straight), world);
  world.barrier();
  if (world.rank() == 0) std::ofstream(ckpt + ".rank1", std::ios::trunc) << "not a checkpoint";
  world.barrier();
  try {
    train_params(config(resumed), world);
    ADD_FAILURE() << "rank " << world.rank() << " resumed although rank 1's part is broken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-step000000010.h5.rank1"), std::string::npos) << e.what();
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

TEST(DataParallel, OnGpusThroughNcclMatchesOneRank) {
  // Gradients in device buckets, reduced by NCCL on its own stream ordered after the compute
  // stream by events. Needs one GPU per rank; the reference is one rank on its own GPU.
  const comm::Topology& topo = comm::Runtime::get().topology();
  if (!comm::nccl_compiled() || enable_cuda() == 0)
    GTEST_SKIP() << "no GPU on this machine (or dtrain built without CUDA/NCCL): data parallel on GPUs not exercised";
  if (topo.cuda_device_count < topo.local_size)
    GTEST_SKIP() << topo.local_size << " ranks share " << topo.cuda_device_count << " GPU(s); NCCL needs one per rank";
  expect_same_training(
      {"--device", "cuda", "--model", "mlp", "--hidden", "64,32", "--bucket-mb", "0.01", "--lr", "0.05"},
      {"--device", "cuda", "--model", "mlp", "--hidden", "64,32", "--lr", "0.05"});
}

TEST(DataParallel, GlobalBatchMustDivideOverRanks) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  auto c = config({});
  c.global_batch_size = world.size() * 8 + 1;
  try {
    train::Trainer t(c, comm::Runtime::get(), &world);
    FAIL() << "an uneven global batch was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--global-batch-size"), std::string::npos) << e.what();
  }
}

// Model files: named layers and torchvision-style blocks (named body layers, a "downsample"
// projection, the ReLU after the sum) and a ViT (below): their stages keep those names.
const char* const kTinyResNet = R"({"name": "tiny_resnet",
  "blocks": {"basic": {"args": {"width": null, "stride": 1}, "layer": {"type": "residual", "names": "flat",
    "shortcut": "projection", "shortcut_name": "downsample", "after": "relu", "body": [
      {"name": "conv1", "type": "conv", "out": "$width", "kernel": 3, "stride": "$stride", "padding": 1, "bias": false},
      {"name": "bn1", "type": "batchnorm"}, {"name": "relu", "type": "relu"},
      {"name": "conv2", "type": "conv", "out": "$width", "kernel": 3, "padding": 1, "bias": false},
      {"name": "bn2", "type": "batchnorm"}]}}},
  "layers": [{"name": "conv1", "type": "conv", "out": 8, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm"}, {"name": "relu", "type": "relu"},
    {"name": "layer1", "type": "sequential", "layers": [{"type": "basic", "width": 8}]},
    {"name": "layer2", "type": "sequential", "layers": [{"type": "basic", "width": 16, "stride": 2}]},
    {"name": "avgpool", "type": "global_avgpool"}, {"name": "fc", "type": "linear", "out": "classes"}]})";

// A vision transformer: patch tokens, position embedding, two bidirectional encoder blocks.
const char* const kTinyVit = R"({"name": "tiny_vit", "layers": [
    {"name": "conv_proj", "type": "conv", "out": 8, "kernel": 4, "stride": 4}, {"name": "", "type": "tokens"},
    {"name": "encoder", "type": "position_embedding"},
    {"name": "encoder.layers.encoder_layer_0", "type": "transformer_block", "heads": 2, "mlp": 16},
    {"name": "encoder.layers.encoder_layer_1", "type": "transformer_block", "heads": 2, "mlp": 16},
    {"name": "encoder.ln", "type": "layernorm"}, {"type": "first_token"},
    {"name": "heads.head", "type": "linear", "out": "classes"}]})";

// Image models cut into 2 pipeline stages (--pp 2; at 4 ranks dp2 x pp2) train as the same ranks
// of one dp group without stages running the same micro-batches (--accumulate 2 with half the
// rows), under GPipe and 1F1B, within 1e-5 over 20 steps. BatchNorm's statistics are per
// micro-batch, so the reference runs the same micro-batches, not the whole batch at once (which
// DataParallel.AccumulationMatchesTheLargeBatch ties to one rank for simple_cnn).
TEST(Pipeline, ImageModelsMatchTheLayoutWithoutStages) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  auto group = stage_reference_group(world);
  const std::string resnet = dataset() + "-tiny-resnet-" + std::to_string(world.rank()) + ".json",
                    vit = dataset() + "-tiny-vit-" + std::to_string(world.rank()) + ".json";
  std::ofstream(resnet) << kTinyResNet;
  std::ofstream(vit) << kTinyVit;
  for (const std::string& model : std::vector<std::string>{"simple_cnn", "resnet20", resnet, vit}) {
    std::vector<std::string> run = {"--model", model, "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"};
    if (model.ends_with(".json")) run[0] = "--model-file";
    std::vector<std::string> reference = run;
    reference.insert(reference.end(), {"--accumulate", "2"});
    const ParamValues want = train_params(config(reference), *group);
    // The model files' layers are the built-in models' (which both schedules check): 1F1B only.
    for (const char* schedule :
         model.ends_with(".json") ? std::vector<const char*>{"1f1b"} : std::vector<const char*>{"gpipe", "1f1b"}) {
      std::vector<std::string> piped = run;
      piped.insert(piped.end(), {"--pp", "2", "--micro-batches", "2", "--schedule", schedule});
      expect_stage_close(train_params(config(piped), world), want, model + " " + schedule);
    }
  }
  std::filesystem::remove(resnet);
  std::filesystem::remove(vit);
}

// Distillation under --pp: the teacher (an mlp trained here, the same on every rank) runs beside
// the last stage's logits; simple_cnn at pp 2 (dp 2 x pp 2 at 4 ranks) ends where the layout without
// stages does with the same teacher, and the teacher changes where it ends.
TEST(Pipeline, ImageDistillationMatchesTheLayoutWithoutStages) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  auto group = stage_reference_group(world);
  const std::string teacher = dataset() + "-teacher-" + std::to_string(world.rank());
  {
    auto solo = world.split(world.rank(), 0, "solo");
    train::TrainConfig t = config({"--model", "mlp", "--hidden", "32", "--lr", "0.05"});
    t.checkpoint_dir = teacher;
    train::Trainer(t, comm::Runtime::get(), solo.get()).run();
  }
  const std::vector<std::string> run = {"--model",    "simple_cnn", "--optimizer", "sgd",
                                        "--momentum", "0.9",        "--lr",        "0.01"};
  const std::vector<std::string> taught =
      with(run, {"--teacher", teacher, "--distill-weight", "0.5", "--distill-temperature", "2"});
  const ParamValues want = train_params(config(with(taught, {"--accumulate", "2"})), *group);
  const ParamValues untaught = train_params(config(with(run, {"--accumulate", "2"})), *group);
  double moved = 0;
  for (size_t i = 0; i < want.at("7.weight").size(); ++i)
    moved = std::max(moved, std::abs(static_cast<double>(untaught.at("7.weight")[i] - want.at("7.weight")[i])));
  EXPECT_GT(moved, 1e-4) << "the teacher changed nothing";
  expect_stage_close(train_params(config(with(taught, {"--pp", "2", "--micro-batches", "2"})), world), want,
                     "simple_cnn pp 2 with a teacher");
  world.barrier();
  std::filesystem::remove_all(teacher);
}

// ZeRO under --pp for image models: each stage shards over its own data-parallel group. The
// reference is the layout without stages at the same ZeRO stage (--accumulate 2): ZeRO-2/3 add each
// micro-batch's reduce-scattered gradient into the shard where ZeRO-0/1 add the micro-batches'
// gradients before one allreduce, a rounding difference that resnet20's BatchNorm grows to 4e-3
// over 20 steps (measured) with or without stages. Every stage, ZeRO-3 also without prefetch and
// keeping each unit from forward to backward, for simple_cnn, resnet20 and a model file, within
// 1e-5 over 20 steps; then a ZeRO-3 set written by the stages resumes without stages at ZeRO-0.
TEST(Pipeline, ImageModelsShardEachStage) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  auto group = stage_reference_group(world);
  const std::string resnet = dataset() + "-pp-zero-resnet-" + std::to_string(world.rank()) + ".json";
  std::ofstream(resnet) << kTinyResNet;
  std::vector<std::vector<std::string>> variants = sharded_variants();
  variants.insert(variants.begin(), {"--zero", "1"});
  for (const std::string& model : std::vector<std::string>{"simple_cnn", "resnet20", resnet}) {
    const std::vector<std::string> run = adamw_run(model);
    for (const std::vector<std::string>& v : variants) {
      const std::string what = model + " " + v[0] + " " + v[1] + (v.size() > 2 ? " (no prefetch, kept)" : "");
      const ParamValues want = train_params(config(with(with(run, {"--accumulate", "2"}), v)), *group);
      expect_stage_close(train_params(config(with(with(run, {"--pp", "2", "--micro-batches", "2"}), v)), world), want,
                         what);
    }
  }
  std::filesystem::remove(resnet);
  const std::string dir = dataset() + "-pp-zero-resume";
  const std::vector<std::string> run = {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003"};
  const ParamValues piped = train_params(config(with(run, {"--pp", "2", "--micro-batches", "2", "--zero", "3",
                                                           "--checkpoint-dir", dir, "--checkpoint-every", "10"})),
                                         world);
  const ParamValues resumed =
      train_params(config(with(run, {"--accumulate", "2", "--resume", dir + "/ckpt-step000000010.h5"})), *group);
  expect_stage_close(piped, resumed, "a pp 2 ZeRO-3 set resumed without stages at ZeRO-0");
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// A checkpoint set written by 2 pipeline stages (one file per stage) resumes without stages: the
// run ends where the uninterrupted pipelined one does.
TEST(Pipeline, ImageCheckpointResumesInAnotherLayout) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const std::string dir = dataset() + "-pp-resume";
  const std::vector<std::string> run = {"--model", "resnet20", "--lr", "0.01"};
  std::vector<std::string> piped = run;
  piped.insert(piped.end(), {"--pp", "2", "--micro-batches", "2", "--checkpoint-dir", dir, "--checkpoint-every", "10"});
  const ParamValues whole = train_params(config(piped), world);
  auto solo = world.split(world.rank(), 0, "solo");
  std::vector<std::string> resume = run;
  resume.insert(resume.end(), {"--accumulate", "2", "--resume", dir + "/ckpt-step000000010.h5"});
  const ParamValues resumed = train_params(config(resume), *solo);
  expect_stage_close(whole, resumed, "resumed on one rank without stages");
  // The set holds the whole model (what `dtrain eval` reads): every parameter the one-rank run has.
  const train::CheckpointState set = train::load_checkpoint_set(dir + "/ckpt-step000000020.h5");
  for (const auto& [name, values] : resumed) {
    if (name.rfind("buffer:", 0) == 0) continue;
    EXPECT_TRUE(set.tensors.count("param/" + name)) << name;
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// ZeRO-2 and ZeRO-3 through the trainer for the image models (simple_cnn, resnet20 with its
// BatchNorm buffers, a model file of residual blocks): the parameters and buffers after 20 steps
// equal plain data parallel's within 1e-5; ZeRO-3 also without prefetch and keeping each unit's
// values from forward to backward; and with --accumulate 2 as plain data parallel accumulating.
TEST(Zero, ImageModelsTrainAsPlainDataParallel) {
  comm::Communicator& world = comm::Runtime::get().world();
  const std::string resnet = dataset() + "-zero-resnet-" + std::to_string(world.rank()) + ".json";
  std::ofstream(resnet) << kTinyResNet;
  const std::vector<std::vector<std::string>> variants = sharded_variants();
  for (const std::string& model : std::vector<std::string>{"simple_cnn", "resnet20", resnet}) {
    const std::vector<std::string> run = adamw_run(model);
    const ParamValues plain = train_params(config(run), world);
    for (const std::vector<std::string>& v : variants) {
      std::vector<std::string> sharded = run;
      sharded.insert(sharded.end(), v.begin(), v.end());
      expect_params_close(train_params(config(sharded), world), plain,
                          model + " " + v[0] + " " + v[1] + (v.size() > 2 ? " (no prefetch, kept)" : ""));
    }
  }
  std::vector<std::string> accumulate = {"--model", "simple_cnn", "--lr", "0.05", "--accumulate", "2"};
  const ParamValues plain = train_params(config(accumulate), world);
  accumulate.insert(accumulate.end(), {"--zero", "3"});
  expect_params_close(train_params(config(accumulate), world), plain, "ZeRO-3 with --accumulate 2");
  std::filesystem::remove(resnet);
}

// Compression under ZeRO-2 and ZeRO-3: the compressor averages each unit's gradient and every rank
// keeps its block. Compressors that work element by element (fp16, bf16) or tensor by tensor
// (PowerSGD) give the unsharded run's parameters; those that work on a bucket (top-k, QSGD, one-bit)
// see units where data parallel sees 25 MiB buckets, so ZeRO-3 is checked against ZeRO-2 (the same
// buckets), the inter-node scope with them. All within 1e-5 after 20 steps.
TEST(Zero, CompressionFeedsTheShards) {
  if (comm::Runtime::get().world().size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::vector<std::string> sgd = {"--model", "simple_cnn", "--optimizer",          "sgd", "--momentum", "0.9",
                                        "--lr",    "0.05",       "--compression-warmup", "4"};
  for (const char* c : {"fp16", "bf16", "powersgd:2"}) {
    SCOPED_TRACE(c);
    const std::vector<std::string> run = with(sgd, {"--compression", c});
    expect_layouts_agree(with(run, {"--zero", "3"}), run);
    expect_layouts_agree(with(run, {"--zero", "2"}), run);
  }
  for (const char* c : {"topk:0.05", "qsgd:16", "onebit"}) {
    SCOPED_TRACE(c);
    const std::vector<std::string> run = with(sgd, {"--compression", c});
    expect_layouts_agree(with(run, {"--zero", "3"}), with(run, {"--zero", "2"}));
  }
  const std::vector<std::string> scoped =
      with(sgd, {"--compression", "topk:0.05", "--compression-scope", "inter-node"});
  expect_layouts_agree(with(scoped, {"--zero", "3"}), with(scoped, {"--zero", "2"}));
}

// --shard-scope node on 2 nodes of 2 ranks (the DTRAIN_TEST_RANKS_PER_NODE hook; run by
// parallel_test_np4_nodes_of_2): units sharded within each node, each block's gradient averaged
// between the nodes. ZeRO-2 and ZeRO-3 equal plain data parallel within 1e-5 after 20 steps, with
// and without a compressor.
TEST(Zero, ShardScopeNodeTrainsAsPlainDataParallel) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (comm::split_by_node(world).cross->size() < 2) GTEST_SKIP() << "runs on several (emulated) nodes";
  const std::vector<std::string> run = {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003"};
  const ParamValues plain = train_params(config(run), world);
  for (const char* stage : {"2", "3"}) {
    std::vector<std::string> scoped = run;
    scoped.insert(scoped.end(), {"--zero", stage, "--shard-scope", "node"});
    expect_params_close(train_params(config(scoped), world), plain,
                        std::string("--shard-scope node at --zero ") + stage);
  }
  std::vector<std::string> fp16 = run;
  fp16.insert(fp16.end(), {"--compression", "fp16"});
  std::vector<std::string> scoped = fp16;
  scoped.insert(scoped.end(), {"--zero", "3", "--shard-scope", "node"});
  expect_params_close(train_params(config(scoped), world), train_params(config(fp16), world),
                      "--shard-scope node with fp16 compression");
}

// --compression-scope inter-node under ZeRO on 2 nodes of 2 ranks (parallel_test_np4_nodes_of_2):
// each unit's gradient averaged exactly within the node, then top-k between the nodes, every rank
// keeping its block. ZeRO-3 equals ZeRO-2 (the same units) within 1e-5 after 20 steps, and the
// compressor did run between the nodes: the parameters leave the exact average's by more than 1e-4.
TEST(Zero, InterNodeCompressionFeedsTheShardsOnTwoNodes) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (comm::split_by_node(world).cross->size() < 2) GTEST_SKIP() << "runs on several (emulated) nodes";
  const std::vector<std::string> sgd = {"--model", "simple_cnn", "--optimizer",          "sgd", "--momentum", "0.9",
                                        "--lr",    "0.05",       "--compression-warmup", "4"};
  const std::vector<std::string> inter = with(sgd, {"--compression", "topk:0.05", "--compression-scope", "inter-node"});
  const ParamValues zero2 = train_params(config(with(inter, {"--zero", "2"})), world);
  expect_params_close(train_params(config(with(inter, {"--zero", "3"})), world), zero2,
                      "inter-node top-k at ZeRO-3 against ZeRO-2");
  const ParamValues exact = train_params(config(with(sgd, {"--zero", "2"})), world);
  double largest = 0;
  for (const auto& [name, values] : zero2)
    for (size_t i = 0; i < values.size(); ++i)
      largest = std::max(largest, static_cast<double>(std::abs(values[i] - exact.at(name).at(i))));
  EXPECT_GT(largest, 1e-4) << "inter-node top-k left the parameters where the exact average puts them";
}

// A checkpoint written under ZeRO-3 is every rank's shard part beside a main file without
// parameters or optimizer state (no rank gathers the model). It resumes on 1 rank without ZeRO, on
// every rank at ZeRO-1, 2 and 3, and at ZeRO-3 on 1 rank and (at 4) on 2 and on 3 ranks, with the
// same global batch (12, which every count divides): the parameters after 20 steps equal the
// uninterrupted run's within 1e-5. A set missing a shard part is refused naming it.
TEST(Zero, Stage3CheckpointResumesInEveryLayout) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string dir = dataset() + "-zero3-resume-" + std::to_string(world.size());
  const std::vector<std::string> run = {"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003"};
  auto config12 = [](const std::vector<std::string>& args) {
    train::TrainConfig c = config(args);
    c.global_batch_size = 12;
    return c;
  };
  std::vector<std::string> write = run;
  write.insert(write.end(), {"--zero", "3", "--checkpoint-dir", dir, "--checkpoint-every", "10"});
  const ParamValues whole = train_params(config12(write), world);
  auto solo = world.split(world.rank(), 0, "solo");
  auto resumed = [&](const std::vector<std::string>& layout, comm::Communicator& on) {
    std::vector<std::string> resume = run;
    resume.insert(resume.end(), layout.begin(), layout.end());
    resume.insert(resume.end(), {"--resume", dir + "/ckpt-step000000010.h5"});
    return train_params(config12(resume), on);
  };
  expect_params_close(resumed({}, *solo), whole, "resumed on 1 rank without ZeRO");
  expect_params_close(resumed({"--zero", "1"}, world), whole, "resumed at ZeRO-1");
  // ZeRO-2/3 take their pieces from the parts without whole tensors, at any rank count.
  expect_params_close(resumed({"--zero", "2"}, world), whole, "resumed at ZeRO-2");
  expect_params_close(resumed({"--zero", "3"}, world), whole, "resumed at ZeRO-3");
  expect_params_close(resumed({"--zero", "3"}, *solo), whole, "resumed at ZeRO-3 on 1 rank");
  if (world.size() == 4) {
    auto half = world.split(world.rank() / 2, world.rank() % 2, "half");
    expect_params_close(resumed({"--zero", "3"}, *half), whole, "resumed at ZeRO-3 on 2 of the 4 ranks");
    auto three = world.split(world.rank() < 3 ? 0 : 1, world.rank(), "three");  // rank 3: alone
    expect_params_close(resumed({"--zero", "3"}, *three), whole,
                        "resumed at ZeRO-3 on " + std::to_string(three->size()) + " of the 4 ranks");
  }
  const std::string main_file = dir + "/ckpt-step000000010.h5";
  const train::CheckpointState main = train::load_checkpoint(main_file);
  for (const auto& [name, t] : main.tensors)
    EXPECT_TRUE(name.rfind("param/", 0) != 0 && name.rfind("optim/", 0) != 0) << name << " is in the main file";
  EXPECT_EQ(main.ints.at("zero_shard_ranks"), world.size());
  for (int r = 0; r < world.size(); ++r) EXPECT_TRUE(std::filesystem::exists(train::shard_part_file(main_file, r)));
  // Only the parts holding a wanted piece are read: none, the one part holding the first element of
  // the first weight, or all of them.
  int taken = 0;
  bool first_taken = false;
  const train::PieceTaker count = [&](const std::string& key, int64_t from, const Shape&, const Tensor&) {
    ++taken;
    first_taken = first_taken || (key == "param/0.weight" && from == 0);
  };
  auto first_only = [](const std::string& key, int64_t from, int64_t, const Shape&) {
    return key == "param/0.weight" && from == 0;
  };
  EXPECT_EQ(train::for_each_shard_piece(main, main_file, count, [](auto&&...) { return false; }), 0);
  EXPECT_EQ(taken, 0);
  EXPECT_EQ(train::for_each_shard_piece(main, main_file, count, first_only), 1);
  EXPECT_TRUE(first_taken);
  EXPECT_EQ(train::for_each_shard_piece(main, main_file, count), world.size());
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove(train::shard_part_file(main_file, world.size() - 1));
  world.barrier();
  try {
    resumed({"--zero", "3"}, world);
    ADD_FAILURE() << "a set without its last shard part resumed";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(train::shard_part_file(main_file, world.size() - 1)), std::string::npos)
        << e.what();
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// Magnitude pruning on every replica alike: plain data parallel and ZeRO-1 (whose slices restart
// from the masked weights) end with the same weights, at least 80 % of them exactly zero.
TEST(Pruning, PrunedWeightsStayZeroUnderDataParallelAndZero1) {
  const std::vector<std::string> run = {"--model",     "simple_cnn", "--optimizer",      "adamw",
                                        "--lr",        "0.003",      "--prune-sparsity", "0.8",
                                        "--prune-end", "10",         "--prune-every",    "5"};
  std::vector<std::string> sharded = run;
  sharded.insert(sharded.end(), {"--zero1", "true"});
  comm::Communicator& world = comm::Runtime::get().world();
  const ParamValues plain = train_params(config(run), world);
  expect_params_close(train_params(config(sharded), world), plain, "ZeRO-1 against plain data parallel");
  int64_t zero = 0, total = 0;
  for (const auto& [name, values] : plain) {
    if (name.rfind("buffer:", 0) == 0 || name.find("weight") == std::string::npos) continue;
    for (float v : values) zero += v == 0.f;
    total += static_cast<int64_t>(values.size());
  }
  EXPECT_GE(static_cast<double>(zero) / static_cast<double>(total), 0.799);
}

// --check-replicas: a bit flipped in one replica's weights (the DTRAIN_TEST_FLIP_BIT hook) is found
// at the next check, on every rank alike, naming the rank and the parameter, before the checkpoint
// of that step is written.
TEST(ReplicaCheck, FindsABitFlippedInOneReplica) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string dir = dataset() + "-replicas-" + std::to_string(world.size());
  const std::vector<std::string> run = {"--model",
                                        "simple_cnn",
                                        "--check-replicas",
                                        "3",
                                        "--checkpoint-dir",
                                        dir,
                                        "--checkpoint-every",
                                        "3",
                                        "--keep-checkpoints",
                                        "10"};
  EXPECT_EQ(train_params(config(run), world).empty(), false) << "replicas that agree pass the check";
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
  world.barrier();
  ::setenv("DTRAIN_TEST_FLIP_BIT", "1:7", 1);  // world rank 1 (dp rank 1) after step 7
  std::string message;
  try {
    train::Trainer(config(run), comm::Runtime::get(), &world).run();
  } catch (const DivergenceError& e) {
    message = e.what();
  }
  ::unsetenv("DTRAIN_TEST_FLIP_BIT");
  world.barrier();  // every rank's checkpoint writer has ended
  EXPECT_NE(message.find("replicas differ after step 9"), std::string::npos) << message;
  EXPECT_NE(message.find("(world rank 1)"), std::string::npos) << message;
  EXPECT_NE(message.find("parameter 0.weight"), std::string::npos) << message;
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt-step000000006.h5"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt-step000000009.h5")) << "the corrupted step was checkpointed";
  world.barrier();  // read by every rank before it goes
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// A rank slowed in one section (the DTRAIN_TEST_SLOW hook: 15 ms of sleep in its backward of every
// step) is named as the straggler with that section, in the log and in the metrics.
TEST(Straggler, SlowRankIsNamedWithTheSlowSection) {
  comm::Communicator& world = comm::Runtime::get().world();
  if (world.size() == 1) GTEST_SKIP() << "needs several ranks";
  const std::string metrics = dataset() + "-straggler-" + std::to_string(world.size()) + ".jsonl";
  ::setenv("DTRAIN_TEST_SLOW", "1:backward:15", 1);
  train_params(config({"--model", "mlp", "--straggler-every", "5", "--metrics", metrics}), world);
  ::unsetenv("DTRAIN_TEST_SLOW");
  if (world.rank() != 0) return;
  std::ifstream in(metrics);
  std::string line;
  int named = 0, others = 0;
  while (std::getline(in, line)) {
    if (line.find("\"event\": \"straggler\"") == std::string::npos) continue;
    if (line.find("\"rank\": 1,") == std::string::npos)
      ++others;
    else
      named += line.find("\"section\": \"backward\"") != std::string::npos;
  }
  // Steps 10, 15 and 20 at least (the first window holds every rank's start-up as well).
  EXPECT_GE(named, 3) << "the comparisons name rank 1's backward";
  EXPECT_EQ(others, 0) << "only the slowed rank is named";
  std::filesystem::remove(metrics);
}

TEST(SyncBatchNorm, OneRankEqualsBatchNorm2d) {
  comm::Communicator& world = comm::Runtime::get().world();
  auto solo = world.split(world.rank(), 0, "solo");
  Rng rng(5);
  nn::BatchNorm2d bn(3);
  parallel::SyncBatchNorm sbn(3, *solo);
  Tensor x = Tensor::empty({4, 3, 5, 5}), dy = Tensor::empty({4, 3, 5, 5});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = 2.f + rng.normal(), dy.f32()[i] = rng.normal();
  Tensor y1 = bn.forward(x).clone(), y2 = sbn.forward(x).clone();
  Tensor d1 = bn.backward(dy).clone(), d2 = sbn.backward(dy).clone();
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_NEAR(y1.f32()[i], y2.f32()[i], 1e-5) << i;
    ASSERT_NEAR(d1.f32()[i], d2.f32()[i], 1e-5) << i;
  }
  auto p1 = bn.parameters(), p2 = sbn.parameters();
  for (size_t k = 0; k < p1.size(); ++k)
    for (int64_t i = 0; i < 3; ++i) EXPECT_NEAR(p1[k]->grad.f32()[i], p2[k]->grad.f32()[i], 1e-4) << p1[k]->name;
  auto b1 = bn.buffers(), b2 = sbn.buffers();
  for (size_t k = 0; k < b1.size(); ++k)
    for (int64_t i = 0; i < 3; ++i) EXPECT_NEAR(b1[k]->value.f32()[i], b2[k]->value.f32()[i], 1e-5) << b1[k]->name;
}

TEST(SyncBatchNorm, ShardsEqualBatchNormOverTheWholeBatch) {
  comm::Communicator& world = comm::Runtime::get().world();
  const int64_t per = 3, n = per * world.size();
  nn::BatchNorm2d bn(2);
  parallel::SyncBatchNorm sbn(2, world);
  for (int k = 0; k < 2; ++k)  // non-trivial scale and shift
    for (int64_t c = 0; c < 2; ++c) {
      float v = k == 0 ? 1.5f + static_cast<float>(c) : -0.25f * static_cast<float>(c + 1);
      bn.parameters()[k]->value.f32()[c] = v;
      sbn.parameters()[k]->value.f32()[c] = v;
    }
  for (int iter = 0; iter < 3; ++iter) {
    for (int k = 0; k < 2; ++k) bn.parameters()[k]->grad.zero_(), sbn.parameters()[k]->grad.zero_();
    Rng rng(100 + iter);  // the same full batch on every rank; each takes its rows
    Tensor x = Tensor::empty({n, 2, 3, 3}), dy = Tensor::empty({n, 2, 3, 3});
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = 1.f + 2.f * rng.normal(), dy.f32()[i] = rng.normal();
    Tensor y_full = bn.forward(x).clone();
    Tensor dx_full = bn.backward(dy).clone();
    int64_t r = world.rank();
    Tensor y = sbn.forward(x.slice0(r * per, (r + 1) * per)).clone();
    Tensor dx = sbn.backward(dy.slice0(r * per, (r + 1) * per)).clone();
    Tensor yr = y_full.slice0(r * per, (r + 1) * per), dxr = dx_full.slice0(r * per, (r + 1) * per);
    for (int64_t i = 0; i < y.numel(); ++i) {
      ASSERT_NEAR(y.f32()[i], yr.f32()[i], 1e-5) << "iter " << iter << " y " << i;
      ASSERT_NEAR(dx.f32()[i], dxr.f32()[i], 1e-4) << "iter " << iter << " dx " << i;
    }
    // dgamma, dbeta: this rank's share; summed over the ranks they are the whole batch's.
    for (int k = 0; k < 2; ++k) {
      Tensor g = sbn.parameters()[k]->grad.clone();
      world.allreduce(g, comm::ReduceOp::Sum)->wait();
      for (int64_t c = 0; c < 2; ++c)
        EXPECT_NEAR(g.f32()[c], bn.parameters()[k]->grad.f32()[c], 1e-4) << "iter " << iter << " grad " << k;
    }
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_NEAR(sbn.buffers()[0]->value.f32()[c], bn.buffers()[0]->value.f32()[c], 1e-5) << "running mean";
      EXPECT_NEAR(sbn.buffers()[1]->value.f32()[c], bn.buffers()[1]->value.f32()[c], 1e-5) << "running var";
    }
  }
}

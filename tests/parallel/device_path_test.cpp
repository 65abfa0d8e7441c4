// The device code path on CPU ranks, under a real mpiexec (2 and 4 ranks): the simulated device
// (--device sim, Device::sim) is host memory that host code may not touch, computed by the CPU
// engine and moved between ranks by the MPI backend's host staging, as a GPU's tensors are. Every
// schedule and exchange must give on it what it gives on the CPU, and the layouts that equal one
// rank on the CPU equal it there too; a host read of a device tensor anywhere in them throws.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>

#include "../train/lm_test_util.h"
#include "../train/train_test_util.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/train/trainer.h"
#include "trainer_params.h"

using namespace dtrain;

namespace {

comm::Communicator& world() { return comm::Runtime::get().world(); }

// One directory for the whole job, written by rank 0 (`make` fills it).
std::string shared_dir(const std::string& tag, const std::function<void(const std::string&)>& make) {
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const std::string d = "/tmp/dtrain-device-path-" + tag + "-" + std::to_string(pid);
  if (world().rank() == 0) make(d);
  MPI_Barrier(MPI_COMM_WORLD);
  return d;
}

const std::string& images() {
  static const std::string dir =
      shared_dir("images", [](const std::string& d) { test::make_band_dataset(d, 384, 8, 4, 128); });
  return dir;
}

train::TrainConfig config(std::vector<std::string> args) { return test::trainer_config(images(), 12, std::move(args)); }

using test::ParamValues;
using test::train_params;
using test::with;

// The parameters of `got` within `tolerance` of `want`'s.
void expect_close(const ParamValues& got, const ParamValues& want, double tolerance, const std::string& what) {
  test::expect_params_close(got, want, what, tolerance);
}

}  // namespace

TEST(DeviceCodePath, HostAccessToADeviceTensorThrowsNamingTheCaller) {
  Tensor t = zeros_on({4}, Device::sim());
  try {
    (void)t.f32();
    ADD_FAILURE() << "a host read of " << t.str() << " went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device_path_test.cpp"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sim:0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.clone(), Error);
  EXPECT_THROW((void)t.item(0), Error);
  const Tensor h = to_host(t);  // the explicit way
  EXPECT_EQ(h.f32()[3], 0.f);
}

// Every collective of the MPI backend on device buffers (host-staged) gives the host's results.
TEST(DeviceCodePath, StagedCollectivesEqualTheHostOnes) {
  comm::Communicator& w = world();
  const int n = w.size(), r = w.rank();
  auto on_sim = [](const Tensor& host) {
    Tensor d = Tensor::empty(host.shape(), host.dtype(), Device::sim());
    copy_any(host, d);
    return d;
  };
  Tensor x = on_sim(Tensor::full({6}, static_cast<float>(r + 1)));
  w.allreduce(x, comm::ReduceOp::Avg)->wait();
  EXPECT_FLOAT_EQ(to_host(x).f32()[5], (n + 1) / 2.f);
  Tensor mine = on_sim(Tensor::full({2}, static_cast<float>(r))),
         all = Tensor::empty({2 * n}, DType::F32, Device::sim());
  w.allgather(mine, all)->wait();
  for (int k = 0; k < n; ++k) EXPECT_EQ(to_host(all).f32()[2 * k + 1], static_cast<float>(k));
  Tensor blocks = on_sim(Tensor::full({2 * n}, 1.f)), part = Tensor::empty({2}, DType::F32, Device::sim());
  w.reduce_scatter(blocks, part, comm::ReduceOp::Sum)->wait();
  EXPECT_EQ(to_host(part).f32()[0], static_cast<float>(n));
  Tensor b = on_sim(Tensor::full({3}, r == 0 ? 7.f : 0.f));
  w.broadcast(b, 0)->wait();
  EXPECT_EQ(to_host(b).f32()[2], 7.f);
  if (n >= 2 && r < 2) {
    Tensor msg = on_sim(Tensor::full({5}, 42.f)), got = zeros_on({5}, Device::sim());
    if (r == 0) w.send(msg, 1, 3)->wait();
    if (r == 1) {
      w.recv(got, 0, 3)->wait();
      EXPECT_EQ(to_host(got).f32()[4], 42.f);
    }
  }
}

// Data parallel, ZeRO-1, 2 and 3 and SyncBatchNorm on the simulated device equal one rank with the
// whole batch (as the CPU runs do, DataParallel.* and Zero.* in parallel_test).
TEST(DeviceCodePath, ImageLayoutsMatchOneRank) {
  auto solo = world().split(world().rank(), 0, "solo");
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"--model", "simple_cnn", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"}, {}},
      {{"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"},
       {"--zero1", "true"}},
      {{"--model", "resnet20", "--lr", "0.002"}, {"--sync-batchnorm", "true"}},
      {{"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"}, {"--zero", "2"}},
      {{"--model", "simple_cnn", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"}, {"--zero", "3"}},
      {{"--model", "resnet20", "--lr", "0.002"}, {"--sync-batchnorm", "true", "--zero", "3"}},
  };
  for (const auto& [run, layout] : cases) {
    SCOPED_TRACE(run[1] + (layout.empty() ? "" : " " + layout[0]));
    const ParamValues want = train_params(config(run), *solo);
    std::vector<std::string> mine = with(run, {"--device", "sim"});
    mine.insert(mine.end(), layout.begin(), layout.end());
    expect_close(train_params(config(mine), world()), want, 1e-5, "on the simulated device against one rank");
  }
}

// Every compressor (and top-k's momentum correction and warm-up, PowerSGD's warm-up, ZeRO-1 with a
// compressor), pipeline stages under both schedules, the inter-node scope and distillation: the
// simulated device gives the CPU run's parameters.
TEST(DeviceCodePath, EveryExchangeAndScheduleEqualsTheCpu) {
  const std::vector<std::string> sgd = {"--model", "simple_cnn", "--optimizer",          "sgd", "--momentum", "0.9",
                                        "--lr",    "0.05",       "--compression-warmup", "4"};
  std::vector<std::vector<std::string>> runs = {
      with(sgd, {"--compression", "fp16"}),
      with(sgd, {"--compression", "bf16"}),
      with(sgd, {"--compression", "topk:0.05"}),
      with(sgd, {"--compression", "topk:0.05", "--momentum-correction", "false"}),
      with(sgd, {"--compression", "powersgd:2"}),
      with(sgd, {"--compression", "powersgd:2", "--zero1", "true"}),
      with(sgd, {"--compression", "onebit"}),
      with(sgd, {"--compression", "qsgd:16"}),
      with(sgd, {"--compression", "topk:0.05", "--compression-scope", "inter-node"}),
      with(sgd, {"--precision", "bf16"}),
  };
  if (world().size() % 2 == 0)
    for (const char* schedule : {"gpipe", "1f1b"})
      runs.push_back({"--model", "resnet20", "--lr", "0.01", "--pp", "2", "--pp-split", "8,6", "--micro-batches", "2",
                      "--schedule", schedule});  // a fixed cut: a measured one may differ between two runs
  // Distillation: a teacher trained here first (the same on every rank), then taught students.
  const std::string teacher = shared_dir("teacher", [](const std::string&) {});
  {
    auto solo = world().split(world().rank(), 0, "solo");
    train::TrainConfig t = config({"--model", "mlp", "--hidden", "32", "--lr", "0.05"});
    t.checkpoint_dir = teacher + "/" + std::to_string(world().rank());
    train::Trainer(t, comm::Runtime::get(), solo.get()).run();
  }
  runs.push_back(with(sgd, {"--teacher", teacher + "/" + std::to_string(world().rank()), "--distill-weight", "0.5",
                            "--distill-temperature", "2"}));
  for (const std::vector<std::string>& run : runs) {
    std::string what;
    for (const std::string& a : run) what += a + " ";
    SCOPED_TRACE(what);
    const ParamValues cpu = train_params(config(run), world());
    expect_close(train_params(config(with(run, {"--device", "sim"})), world()), cpu, 1e-6, "sim against cpu");
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(teacher);
}

// Checkpoints from the device: a run resumed from its step-6 checkpoint ends with the uninterrupted
// run's parameters, bit for bit, with the compressors' per-rank state (residuals, PowerSGD's Q, QSGD's
// draws: device tensors copied into each rank's part and back) and ZeRO-1's sharded optimizer state.
TEST(DeviceCodePath, RunsResumeExactlyFromTheDevice) {
  const std::vector<std::string> sgd = {"--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"};
  const std::vector<std::vector<std::string>> kinds = {with(sgd, {"--compression", "topk:0.05"}),
                                                       with(sgd, {"--compression", "powersgd:2"}),
                                                       with(sgd, {"--compression", "qsgd:16"}),
                                                       {"--optimizer", "adamw", "--lr", "0.003", "--zero1", "true"},
                                                       {"--optimizer", "adamw", "--lr", "0.003", "--zero", "3"},
                                                       with(sgd, {"--compression", "powersgd:2", "--zero", "3"})};
  int n = 0;
  for (const auto& kind : kinds) {
    std::string what;
    for (const std::string& a : kind) what += a + " ";
    SCOPED_TRACE(what);
    const std::string dir = images() + "-resume" + std::to_string(n++);
    if (world().rank() == 0) std::filesystem::remove_all(dir);
    world().barrier();
    std::vector<std::string> args = {"--model", "simple_cnn", "--compression-warmup", "2", "--device", "sim"};
    args.insert(args.end(), kind.begin(), kind.end());
    const ParamValues want =
        train_params(config(with(args, {"--checkpoint-dir", dir, "--checkpoint-every", "6"})), world());
    const ParamValues got = train_params(config(with(args, {"--resume", dir + "/ckpt-step000000006.h5"})), world());
    for (const auto& [name, w] : want) EXPECT_EQ(got.at(name), w) << name;
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
}

// The GPT in tp, pp (both schedules) and tp x pp on the simulated device: every step's loss and the
// validation loss equal one rank's within 1e-5 (vocabulary-parallel cross-entropy on the device).
TEST(DeviceCodePath, LanguageModelLayoutsMatchOneRank) {
  const std::string dir =
      shared_dir("lm", [](const std::string& d) { test::write_lm_corpus(d, "the quick fox", 600); });
  train::TrainConfig c = test::small_lm_config(std::filesystem::path(dir) / "tok", test::small_gpt());
  auto solo = world().split(world().rank(), 0, "solo");
  const train::TrainResult ref = train::train_lm(c, solo.get());
  struct Layout {
    int tp, pp;
    const char* schedule;
  };
  // Layouts of the whole world (dp 1), so each step sees the one-rank run's batch.
  const std::vector<Layout> layouts = world().size() == 4
                                          ? std::vector<Layout>{{2, 2, "1f1b"}, {4, 1, "1f1b"}, {1, 4, "gpipe"}}
                                          : std::vector<Layout>{{2, 1, "1f1b"}, {1, 2, "gpipe"}, {1, 2, "1f1b"}};
  for (const Layout& l : layouts) {
    SCOPED_TRACE("tp " + std::to_string(l.tp) + " pp " + std::to_string(l.pp) + " " + l.schedule);
    train::TrainConfig mine = c;
    mine.device = "sim";
    mine.tp = l.tp;
    mine.pp = l.pp;
    mine.schedule = l.schedule;
    mine.micro_batches = 4;  // each micro-batch one of the 4 sequences of a step, at any pp
    const train::TrainResult got = train::train_lm(mine, &world());
    test::expect_lm_losses_match(got, ref, world().rank() == 0);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

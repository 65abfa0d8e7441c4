#include <gtest/gtest.h>

#include <cstring>
#include <unistd.h>

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "dtrain/comm/runtime.h"
#include "dtrain/parallel/zero/memory_plan.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/trainer.h"
#include "divergence_test_util.h"
#include "train_test_util.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

// MPI once per test process (gtest_discover_tests runs each test in its own process).
comm::Runtime& runtime() {
  static comm::Runtime& rt = comm::Runtime::init(nullptr, nullptr);
  return rt;
}

train::TrainConfig parse(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  train::TrainConfig c;
  EXPECT_TRUE(train::parse_train_config(static_cast<int>(argv.size()), argv.data(), c));
  return c;
}

// A test's base options followed by `extra`.
train::TrainConfig parse(std::vector<std::string> base, const std::vector<std::string>& extra) {
  base.insert(base.end(), extra.begin(), extra.end());
  return parse(std::move(base));
}

std::string input_error(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

std::map<std::string, Tensor> params_of(nn::Module& m) {
  std::map<std::string, Tensor> out;
  for (nn::Parameter* p : m.parameters()) out[p->name] = p->value.clone();
  return out;
}

}  // namespace

TEST(Config, FileThenCommandLineOverrides) {
  std::string dir = test::temp_dir("cfg");
  std::ofstream(dir + "/job.ini") << "# comment\nsynthetic = true\nbatch-size = 32\nlr = 0.2\nmodel = mlp\n";
  train::TrainConfig c = parse({"--config", dir + "/job.ini", "--lr", "0.5"});
  EXPECT_TRUE(c.synthetic);
  EXPECT_EQ(c.batch_size, 32);
  EXPECT_FLOAT_EQ(c.lr, 0.5f);  // the command line wins
  EXPECT_EQ(c.model, "mlp");
}

// --print-config's INI reads back as the same configuration, also where a value is empty and its
// default is not: left out, it read back as the default (found by fuzz_config).
TEST(Config, PrintedConfigReadsBackWithEmptyValues) {
  std::string dir = test::temp_dir("cfg-empty");
  std::ofstream(dir + "/job.ini") << "model = mlp\nsynthetic = true\npreempt-signals =\nhidden =\n";
  train::TrainConfig c = parse({"--config", dir + "/job.ini"});
  EXPECT_EQ(c.preempt_signals, "");
  EXPECT_TRUE(c.hidden.empty());
  const std::string ini = train::config_ini(c);
  std::ofstream(dir + "/again.ini") << ini;
  train::TrainConfig again = parse({"--config", dir + "/again.ini"});
  EXPECT_EQ(again.preempt_signals, "") << ini;
  EXPECT_TRUE(again.hidden.empty()) << ini;
  EXPECT_EQ(train::config_ini(again), ini);
  fs::remove_all(dir);
}

TEST(Config, EveryBadInputNamesTheOptionOrFile) {
  EXPECT_NE(input_error({"--synthetic", "--batch-size", "0"}).find("--batch-size"), std::string::npos);
  EXPECT_NE(input_error({"--synthetic", "--lr", "-1"}).find("--lr"), std::string::npos);
  EXPECT_NE(input_error({"--synthetic", "--threads", "5000"}).find("--threads"), std::string::npos);
  EXPECT_NE(input_error({"--synthetic", "--optimizer", "rmsprop"}).find("--optimizer"), std::string::npos);
  EXPECT_NE(input_error({"--synthetic", "--no-such-option"}).find("no-such-option"), std::string::npos);
  EXPECT_NE(input_error({"--synthetic", "--epochs", "many"}).find("epochs"), std::string::npos);
  EXPECT_NE(input_error({"--config", "/nonexistent/job.ini"}).find("/nonexistent/job.ini"), std::string::npos);
  EXPECT_NE(input_error({}).find("--data"), std::string::npos);
  std::string dir = test::temp_dir("cfgbad");
  std::ofstream(dir + "/bad.ini") << "synthetic = true\nlearning-rate = 3\n";
  std::string e = input_error({"--config", dir + "/bad.ini"});
  EXPECT_NE(e.find("bad.ini"), std::string::npos) << e;
  EXPECT_NE(e.find("learning-rate"), std::string::npos) << e;
}

TEST(Checkpoint, RoundTripIsExactAndCorruptionIsCaught) {
  std::string dir = test::temp_dir("ckpt");
  train::CheckpointState s;
  s.tensors["param/0.weight"] = Tensor::from({2, 3}, {1, 2, 3, 4, 5, 6.5f});
  Tensor big = Tensor::empty({4096});
  for (int i = 0; i < 4096; ++i) big.f32()[i] = static_cast<float>(i) * 0.25f;
  s.tensors["optim/0.weight.momentum"] = big;
  Tensor i64 = Tensor::empty({4}, DType::I64);
  for (int i = 0; i < 4; ++i) i64.data<int64_t>()[i] = (int64_t{1} << 62) + i;
  s.tensors["buffer/3.rng_state"] = i64;
  s.strings["model"] = "simple_cnn";
  s.ints["step"] = 1234;
  s.int_lists["input_shape"] = {1, 28, 28};
  std::string path = dir + "/ckpt-step000001234.h5";
  train::save_checkpoint(path, s);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  train::CheckpointState r = train::load_checkpoint(path);
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.tensors["param/0.weight"].shape(), (Shape{2, 3}));
  EXPECT_EQ(r.tensors["param/0.weight"].f32()[5], 6.5f);
  EXPECT_EQ(r.tensors["optim/0.weight.momentum"].f32()[4095], 4095 * 0.25f);
  EXPECT_EQ(r.tensors["buffer/3.rng_state"].data<int64_t>()[3], (int64_t{1} << 62) + 3);
  EXPECT_EQ(r.strings["model"], "simple_cnn");
  EXPECT_EQ(r.ints["step"], 1234);
  EXPECT_EQ(r.int_lists["input_shape"], (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(train::resolve_checkpoint(dir), path);

  // Flip bytes inside the big tensor's data: the checksum must catch it.
  std::string bad = dir + "/corrupt.h5";
  fs::copy_file(path, bad);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // Find the float 1000.25 (4001 * 0.25) in the file and change it.
    float needle = 4001 * 0.25f;
    auto pos = bytes.find(std::string(reinterpret_cast<char*>(&needle), 4));
    ASSERT_NE(pos, std::string::npos);
    f.seekp(static_cast<std::streamoff>(pos));
    float other = -1.f;
    f.write(reinterpret_cast<char*>(&other), 4);
  }
  try {
    train::load_checkpoint(bad);
    FAIL() << "a corrupt checkpoint loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt.h5"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  // Truncated and missing files.
  std::string trunc = dir + "/trunc.h5";
  fs::copy_file(path, trunc);
  fs::resize_file(trunc, 1000);
  EXPECT_THROW(train::load_checkpoint(trunc), InputError);
  EXPECT_THROW(train::load_checkpoint(dir + "/missing.h5"), InputError);
  fs::remove_all(dir);
}

// The manifest of a set gives each part its size and 64-bit checksum: a part that is missing, torn
// (truncated), grown, rewritten (a file that passes its own checksums but holds other tensors: only
// the manifest sees it), of another run or of another step fails the check, naming the part and the
// reason; a listed stage part is checked before load_checkpoint_set merges it.
TEST(Checkpoint, ManifestCatchesEveryFaultOfAPart) {
  const std::string dir = test::temp_dir("manifest"), main_file = train::checkpoint_file(dir, 8);
  auto part_state = [](int64_t run, int64_t step, float v) {
    train::CheckpointState p;
    p.tensors["compress/bucket0.residual"] = Tensor::from({4}, {v, 2, 3, 4});
    p.ints["step"] = step;
    p.ints["rank"] = 1;
    p.ints["run_id"] = run;
    return p;
  };
  train::CheckpointState stage, main;
  stage.tensors["param/3.weight"] = Tensor::from({2}, {5, 6});
  stage.ints = {{"step", 8}, {"pp_stage", 1}, {"run_id", 77}};
  const std::string part = train::rank_part_file(main_file, 1), stage_file = train::stage_part_file(main_file, 1);
  const train::SavedFile r1 = train::save_checkpoint(part, part_state(77, 8, 1));
  const train::SavedFile s1 = train::save_checkpoint(stage_file, stage);
  EXPECT_EQ(r1.bytes, static_cast<int64_t>(fs::file_size(part)));
  main.tensors["param/0.weight"] = Tensor::from({2}, {1, 2});
  main.ints = {{"step", 8}, {"pp_stages", 2}, {"run_id", 77}};
  train::add_manifest(
      main,
      {{train::SetPart::kStage, 1, 1, s1.bytes, s1.checksum}, {train::SetPart::kRank, 1, 1, r1.bytes, r1.checksum}}, 2);
  train::save_checkpoint(main_file, main);
  const train::CheckpointState m = train::load_checkpoint_set(main_file);
  EXPECT_TRUE(m.tensors.count("param/3.weight")) << "the stage part is merged";
  ASSERT_EQ(train::manifest_parts(m, main_file).size(), 2u);
  EXPECT_EQ(m.ints.at("manifest_world_size"), 2);
  EXPECT_NO_THROW(train::check_manifest(m, main_file));
  const std::string saved = dir + "/saved";
  fs::copy_file(part, saved);
  auto expect_fault = [&](const std::string& fault, const std::string& reason, const std::function<void()>& make) {
    fs::copy_file(saved, part, fs::copy_options::overwrite_existing);
    make();
    try {
      train::check_manifest(m, main_file);
      ADD_FAILURE() << "a part " << fault << " passed the manifest";
    } catch (const InputError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 1's compression part '" + part + "'"), std::string::npos) << fault << ": " << what;
      EXPECT_NE(what.find(reason), std::string::npos) << fault << ": " << what;
    }
  };
  expect_fault("missing", "is missing", [&] { fs::remove(part); });
  expect_fault("torn", "(torn or replaced)", [&] { fs::resize_file(part, fs::file_size(part) / 2); });
  expect_fault("grown", "(torn or replaced)", [&] { std::ofstream(part, std::ios::app | std::ios::binary) << "more"; });
  auto rewrite = [&](int64_t run, int64_t step, float v) {
    train::save_checkpoint(part, part_state(run, step, v));
    ASSERT_EQ(static_cast<int64_t>(fs::file_size(part)), r1.bytes) << "the rewritten part has another size";
  };
  expect_fault("rewritten", "(rewritten or replaced)", [&] { rewrite(77, 8, 9); });
  expect_fault("of another run", "was written by another run", [&] { rewrite(78, 8, 1); });
  expect_fault("of another step", "is from step 9", [&] { rewrite(77, 9, 1); });
  fs::copy_file(saved, part, fs::copy_options::overwrite_existing);
  fs::resize_file(stage_file, fs::file_size(stage_file) - 1);
  try {
    train::load_checkpoint_set(main_file);
    ADD_FAILURE() << "a torn stage part was merged";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline stage 1's part"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

namespace {

// Rewrites checkpoint `path` as format 1 wrote it (dtrain-checkpoint-1: zlib's CRC-32 over the
// tensors and over the attributes, no manifest), as existing users' checkpoints are.
void rewrite_as_format1(const std::string& path) {
  train::CheckpointState s = train::load_checkpoint(path);
  for (const char* k : {"manifest_parts", "manifest_world_size"}) s.ints.erase(k);
  s.tensors.erase("manifest/parts");
  auto crc = [](uLong c, const void* p, size_t n) { return n ? crc32_z(c, static_cast<const Bytef*>(p), n) : c; };
  uLong tensors = crc32(0L, Z_NULL, 0), attributes = crc32(0L, Z_NULL, 0);
  for (const auto& [name, t] : s.tensors) tensors = crc(crc(tensors, name.data(), name.size()), t.raw(), t.nbytes());
  for (const auto& [k, v] : s.strings)
    if (k != "format") attributes = crc(crc(attributes, k.data(), k.size()), v.data(), v.size());
  for (const auto& [k, v] : s.ints) attributes = crc(crc(attributes, k.data(), k.size()), &v, sizeof v);
  for (const auto& [k, v] : s.int_lists)
    if (!v.empty()) attributes = crc(crc(attributes, k.data(), k.size()), v.data(), v.size() * sizeof(int64_t));
  auto lock = data::h5::lock();
  data::h5::Handle file = data::h5::file(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  ASSERT_TRUE(file.valid()) << path;
  for (const char* a : {"tensors_xxh3", "attributes_xxh3", "format", "manifest_parts", "manifest_world_size"})
    if (H5Aexists(file.get(), a) > 0) {
      ASSERT_GE(H5Adelete(file.get(), a), 0) << a;
    }
  if (H5Lexists(file.get(), "manifest", H5P_DEFAULT) > 0) {
    ASSERT_GE(H5Ldelete(file.get(), "manifest", H5P_DEFAULT), 0);
  }
  ASSERT_TRUE(data::h5::write_attr_string(file.get(), "format", "dtrain-checkpoint-1") &&
              data::h5::write_attr_i64(file.get(), "checksum", {static_cast<int64_t>(tensors)}) &&
              data::h5::write_attr_i64(file.get(), "attributes_checksum", {static_cast<int64_t>(attributes)}));
}

}  // namespace

// A checkpoint of the previous format (CRC-32 checksums, no manifest) still resumes, bitwise, and
// its checksums are still checked.
TEST(Trainer, ResumesFromACheckpointOfFormat1) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("format1");
  test::make_band_dataset(dir + "/train", 256);
  std::vector<std::string> base = {
      "--data", dir + "/train", "--model", "mlp",       "--hidden", "32",         "--epochs", "2",           "--steps",
      "24",     "--batch-size", "16",      "--threads", "1",        "--progress", "off",      "--optimizer", "adamw"};
  std::map<std::string, Tensor> straight;
  {
    train::Trainer t(parse(base, {"--checkpoint-dir", dir + "/a", "--checkpoint-every", "8", "--keep-checkpoints", "3"}), rt);
    t.run();
    straight = params_of(t.model());
  }
  const std::string old = dir + "/a/ckpt-step000000016.h5";
  rewrite_as_format1(old);
  train::Trainer resumed(parse(base, {"--resume", old}), rt);
  EXPECT_EQ(resumed.run().steps, 24);
  for (auto& [name, t] : params_of(resumed.model()))
    EXPECT_EQ(std::memcmp(t.raw(), straight.at(name).raw(), t.nbytes()), 0) << name;
  ASSERT_TRUE(test::flip_dataset_byte(old, "param/1.weight", 10, 0x10));
  try {
    train::load_checkpoint(old);
    ADD_FAILURE() << "a corrupt checkpoint of format 1 loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fails its checksum"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Trainer, LearnsTheBandDataset) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("learn");
  test::make_band_dataset(dir + "/train", 512);
  test::make_band_dataset(dir + "/test", 200, 8, 4, 100, 99);
  auto c = parse({"--data", dir + "/train", "--test-data", dir + "/test", "--model", "simple_cnn", "--epochs", "3",
                  "--batch-size", "16", "--lr", "0.05", "--threads", "1", "--progress", "off"});
  train::Trainer t(c, rt);
  train::TrainResult r = t.run();
  EXPECT_EQ(r.steps, 3 * 32);
  EXPECT_GT(r.last_eval.accuracy, 0.95);
  EXPECT_EQ(r.last_eval.samples, 200);
  fs::remove_all(dir);
}

TEST(Trainer, ResumeContinuesExactly) {
  // Train 2 epochs straight; train again with checkpoints and resume from the mid-epoch one at
  // step 20: the final parameters must be bitwise equal (loader position, optimizer state, step).
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("resume");
  test::make_band_dataset(dir + "/train", 256);
  std::vector<std::string> base = {"--data", dir + "/train", "--model", "mlp", "--hidden", "32", "--dropout", "0.2",
                                   "--epochs", "2", "--batch-size", "16", "--threads", "1", "--progress", "off",
                                   "--optimizer", "adamw", "--weight-decay", "0.01", "--lr", "0.01",
                                   "--loader-threads", "2"};
  std::map<std::string, Tensor> straight;
  {
    train::Trainer t(parse(base, {"--checkpoint-dir", dir + "/a", "--checkpoint-every", "10", "--keep-checkpoints", "10"}), rt);
    EXPECT_EQ(t.run().steps, 32);
    straight = params_of(t.model());
  }
  ASSERT_TRUE(fs::exists(dir + "/a/ckpt-step000000020.h5"));
  train::Trainer resumed(parse(base, {"--resume", dir + "/a/ckpt-step000000020.h5"}), rt);
  EXPECT_EQ(resumed.run().steps, 32);
  auto after = params_of(resumed.model());
  ASSERT_EQ(after.size(), straight.size());
  for (auto& [name, t] : straight) {
    const Tensor& u = after[name];
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.f32()[i], u.f32()[i]) << name << "[" << i << "]";
  }
  fs::remove_all(dir);
}

// Resume from a folder takes the newest set that is complete and verifies: with the newest main file
// torn (truncated) or with a flipped byte, the run falls back to the set before it, names what it
// skipped and why, and ends bitwise where the uninterrupted run ended (0 steps lost beyond the
// interval). A write killed before its rename leaves a .tmp, removed at the next start with a
// message; a folder with no usable set fails naming every set.
TEST(Trainer, ResumeFallsBackToTheNewestGoodSet) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("fallback");
  test::make_band_dataset(dir + "/train", 256);
  std::vector<std::string> base = {"--data",       dir + "/train", "--model",   "mlp",     "--hidden",
                                   "32",           "--epochs",     "2",         "--steps", "24",
                                   "--batch-size", "16",           "--threads", "1",       "--progress",
                                   "off",          "--optimizer",  "adamw",     "--lr",    "0.01"};
  std::map<std::string, Tensor> straight;
  {
    train::Trainer t(parse(base, {"--checkpoint-dir", dir + "/a", "--checkpoint-every", "8", "--keep-checkpoints", "3"}), rt);
    EXPECT_EQ(t.run().steps, 24);
    straight = params_of(t.model());
  }
  const std::string newest = dir + "/a/ckpt-step000000024.h5", before = dir + "/a/ckpt-step000000016.h5";
  ASSERT_TRUE(fs::exists(newest) && fs::exists(before));
  const std::string kept = dir + "/kept.h5";
  fs::copy_file(newest, kept);
  auto expect_resumes_at_16 = [&](const std::string& fault) {
    train::Trainer resumed(parse(base, {"--resume", dir + "/a"}), rt);
    EXPECT_EQ(resumed.run().steps, 24) << fault;
    for (auto& [name, t] : params_of(resumed.model()))
      EXPECT_EQ(std::memcmp(t.raw(), straight.at(name).raw(), t.nbytes()), 0) << fault << ": " << name;
  };
  fs::resize_file(newest, fs::file_size(newest) / 2);  // torn
  expect_resumes_at_16("a truncated newest main file");
  fs::copy_file(kept, newest, fs::copy_options::overwrite_existing);
  ASSERT_TRUE(test::flip_dataset_byte(newest, "param/1.weight", 10, 0x10));  // only the checksum sees it
  expect_resumes_at_16("a flipped byte in the newest main file");
  // A killed write's temporary file: removed, with a message, at the start of the next run there.
  fs::copy_file(kept, dir + "/a/ckpt-step000000032.h5.tmp");
  {
    train::Trainer again(parse(base, {"--checkpoint-dir", dir + "/a", "--resume", before, "--checkpoint-every", "100"}), rt);
    again.run();
  }
  EXPECT_FALSE(fs::exists(dir + "/a/ckpt-step000000032.h5.tmp"));
  // Nothing usable: every set is named with its reason.
  for (const auto& e : fs::directory_iterator(dir + "/a"))
    if (e.path().extension() == ".h5") fs::resize_file(e.path(), 100);
  try {
    train::Trainer(parse(base, {"--resume", dir + "/a"}), rt).run();
    ADD_FAILURE() << "resumed from a folder of torn checkpoints";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no checkpoint set there is complete and verifies"), std::string::npos) << what;
    EXPECT_NE(what.find("ckpt-step000000024.h5"), std::string::npos) << what;
    EXPECT_NE(what.find("ckpt-step000000016.h5"), std::string::npos) << what;
  }
  fs::remove_all(dir);
}

// A rollback: sets of steps 20, 40 and 60, then a run resumed from 20 into the same folder that
// stops at 35. Its line of sets is 20, 35: the sets of 40 and 60 are moved aside (named in the log)
// so that `--resume DIR` (what a requeue or relaunch runs) continues from 35, not from the abandoned
// 60; each set of the new line names its parent; the abandoned line resumes when named.
TEST(Trainer, ResumingBehindNewerSetsStartsALineOfItsOwn) {
  comm::Runtime& rt = runtime();
  const std::string dir = test::temp_dir("line-of-sets"), ckpt = dir + "/ckpt";
  test::make_band_dataset(dir + "/train", 1024);  // 64 steps an epoch: no epoch-end sets
  const std::vector<std::string> base = {"--data", dir + "/train", "--model", "mlp", "--hidden", "16", "--epochs", "1",
                                         "--batch-size", "16", "--threads", "1", "--progress", "off",
                                         "--checkpoint-dir", ckpt, "--checkpoint-every", "20", "--keep-checkpoints", "3"};
  auto steps_of = [&](const std::string& folder) {
    std::vector<std::string> mains;
    for (const auto& e : fs::directory_iterator(folder))
      if (e.is_regular_file() && e.path().extension() == ".h5") mains.push_back(e.path().filename().string());
    std::sort(mains.begin(), mains.end());
    return mains;
  };
  train::Trainer(parse(base, {"--steps", "60"}), rt).run();
  ASSERT_EQ(steps_of(ckpt), (std::vector<std::string>{"ckpt-step000000020.h5", "ckpt-step000000040.h5",
                                                      "ckpt-step000000060.h5"}));
  testing::internal::CaptureStdout();
  train::Trainer(parse(base, {"--steps", "35", "--resume", ckpt + "/ckpt-step000000020.h5"}), rt).run();
  const std::string log = testing::internal::GetCapturedStdout();
  EXPECT_EQ(steps_of(ckpt), (std::vector<std::string>{"ckpt-step000000020.h5", "ckpt-step000000035.h5"}));
  std::string aside;
  for (const auto& e : fs::directory_iterator(ckpt))
    if (e.is_directory()) aside = e.path().string();
  ASSERT_FALSE(aside.empty()) << "no folder of abandoned sets in " << ckpt;
  EXPECT_EQ(steps_of(aside), (std::vector<std::string>{"ckpt-step000000040.h5", "ckpt-step000000060.h5"}));
  EXPECT_NE(log.find("moved to " + aside + " (ckpt-step000000040.h5, ckpt-step000000060.h5)"), std::string::npos)
      << log;
  const train::CheckpointState set35 = train::load_checkpoint(ckpt + "/ckpt-step000000035.h5");
  EXPECT_EQ(set35.strings.at("parent").rfind("ckpt-step000000020.h5 run ", 0), 0u) << set35.strings.at("parent");
  // What a requeue runs: the folder's newest set is the new line's.
  const train::TrainResult requeued = train::Trainer(parse(base, {"--steps", "45", "--resume", ckpt}), rt).run();
  EXPECT_EQ(requeued.step_losses.size(), 10u) << "--resume " << ckpt << " did not continue from step 35";
  const train::TrainResult back = train::Trainer(parse(base, {"--steps", "64", "--resume", aside}), rt).run();
  EXPECT_EQ(back.step_losses.size(), 4u) << "--resume " << aside << " did not continue from step 60";
  fs::remove_all(dir);
}

// A run on a checkpoint folder another live run owns stops before it touches the folder, naming
// the owner (checkpoint_owner.h); the owner's sets are left as they were.
TEST(Trainer, ARunOnAFolderAnotherRunOwnsStopsNamingIt) {
  comm::Runtime& rt = runtime();
  const std::string dir = test::temp_dir("owned"), ckpt = dir + "/ckpt";
  test::make_band_dataset(dir + "/train", 256);
  fs::create_directories(ckpt);
  std::ofstream(ckpt + "/ckpt-step000000008.h5.tmp") << "the owner's write in flight";
  train::FolderOwner owner(ckpt, 77);
  try {
    train::Trainer(parse({"--data", dir + "/train", "--model", "mlp", "--steps", "2", "--threads", "1", "--progress",
                          "off", "--checkpoint-dir", ckpt}),
                   rt)
        .run();
    ADD_FAILURE() << "a second run took a folder run 77 owns";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to run 77"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(ckpt + "/ckpt-step000000008.h5.tmp")) << "the refused run removed the owner's write";
  fs::remove_all(dir);
}

// The memory check before the first step: frozen parameters (LoRA, --freeze) hold their values
// only, no gradients, optimizer state or shard of either; with every parameter trained the stages
// hold what memory_plan.h's table says (4 + 4 + 4k, 4 + 4 + (8 + 4k)/N, 4 + (4 + 4k)/N,
// (8 + 4k)/N bytes a parameter; AdamW k = 2, N = 2).
TEST(MemoryPlan, FrozenParametersHoldTheirValuesOnly) {
  const std::vector<int64_t> units = {600, 400};
  const int64_t full[4] = {16000, 16000, 10000, 8000};  // 1000 parameters, before the gathered units
  for (int zero = 0; zero <= 3; ++zero) {
    const parallel::ModelStateBytes all = parallel::plan_model_state(1000, 1000, units, zero, 2, 2, false);
    EXPECT_EQ(all.total() - all.gathered, full[zero]) << "ZeRO-" << zero;
    const parallel::ModelStateBytes lora = parallel::plan_model_state(1000, 10, units, zero, 2, 2, false);
    EXPECT_EQ(lora.parameters, zero >= 3 ? 0 : 4000) << "ZeRO-" << zero;
    EXPECT_EQ(lora.gradients, zero >= 2 ? 0 : 40) << "ZeRO-" << zero;
    EXPECT_EQ(lora.optimizer, zero >= 1 ? 40 : 80) << "ZeRO-" << zero;
    const int64_t shards[4] = {0, 40, 20, 2000 + 20};  // ZeRO-3: every master's slice, the trained gradients'
    EXPECT_EQ(lora.shards, shards[zero]) << "ZeRO-" << zero;
    EXPECT_EQ(lora.gathered, all.gathered) << "ZeRO-" << zero;
  }
}

// Magnitude pruning through checkpoints: the masks are saved beside the weights, and a run resumed
// mid-ramp ends bitwise equal to the uninterrupted one with its pruned weights exactly zero.
TEST(Trainer, PruningMasksResumeExactly) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("prune-resume");
  test::make_band_dataset(dir + "/train", 256);
  std::vector<std::string> base = {"--data", dir + "/train", "--model", "simple_cnn", "--epochs", "2",
                                   "--batch-size", "16", "--threads", "1", "--progress", "off",
                                   "--prune-sparsity", "0.7", "--prune-start", "5", "--prune-end", "25",
                                   "--prune-every", "5"};
  std::map<std::string, Tensor> straight;
  {
    train::Trainer t(parse(base, {"--checkpoint-dir", dir + "/a", "--checkpoint-every", "12", "--keep-checkpoints", "10"}), rt);
    EXPECT_NEAR(t.run().sparsity, 0.7, 1e-3);
    straight = params_of(t.model());
  }
  const train::CheckpointState ck = train::load_checkpoint(dir + "/a/ckpt-step000000012.h5");
  EXPECT_TRUE(ck.tensors.count("mask/0.weight")) << "the masks are in the checkpoint";
  train::Trainer resumed(parse(base, {"--resume", dir + "/a/ckpt-step000000012.h5"}), rt);
  resumed.run();
  auto after = params_of(resumed.model());
  int64_t zero = 0, total = 0;
  for (auto& [name, t] : straight) {
    const Tensor& u = after[name];
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.f32()[i], u.f32()[i]) << name << "[" << i << "]";
    if (t.dim() < 2) continue;
    for (int64_t i = 0; i < t.numel(); ++i) zero += t.f32()[i] == 0.f;
    total += t.numel();
  }
  EXPECT_NEAR(static_cast<double>(zero) / static_cast<double>(total), 0.7, 1e-3) << "pruned weights are exactly 0";
  fs::remove_all(dir);
}

// Distillation: a teacher (any image model of the same inputs and classes) changes the student's
// training exactly through its weighted term (weight 0 gives the plain run's parameters bitwise),
// and a teacher of other classes is refused naming its file.
TEST(Trainer, DistillationWeightZeroIsPlainTrainingAndBadTeachersAreNamed) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("distill");
  test::make_band_dataset(dir + "/train", 128);
  std::vector<std::string> base = {"--data", dir + "/train", "--epochs", "1", "--batch-size", "16",
                                   "--threads", "1", "--progress", "off", "--seed", "5"};
  train::Trainer(parse(base, {"--model", "mlp", "--checkpoint-dir", dir + "/teacher"}), rt).run();
  std::map<std::string, Tensor> plain, weight0, taught;
  for (auto [out, extra] : {std::pair{&plain, std::vector<std::string>{}},
                            {&weight0, {"--teacher", dir + "/teacher", "--distill-weight", "0"}},
                            {&taught, {"--teacher", dir + "/teacher", "--distill-weight", "0.5"}}}) {
    extra.insert(extra.end(), {"--model", "simple_cnn"});
    train::Trainer t(parse(base, extra), rt);
    t.run();
    *out = params_of(t.model());
  }
  bool changed = false;
  for (auto& [name, p] : plain) {
    for (int64_t i = 0; i < p.numel(); ++i) {
      ASSERT_EQ(p.f32()[i], weight0[name].f32()[i]) << name << "[" << i << "]";
      changed |= p.f32()[i] != taught[name].f32()[i];
    }
  }
  EXPECT_TRUE(changed) << "a teacher with weight 0.5 must change the student's training";
  try {
    train::Trainer(parse(base, {"--model", "simple_cnn", "--teacher", dir + "/teacher", "--synthetic",
                         "--synthetic-shape", "1,28,28", "--synthetic-classes", "3", "--steps", "2"}),
                   rt);
    FAIL() << "a teacher of 10 classes cannot teach a student of 3";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("option --teacher: checkpoint '" + dir + "/teacher/ckpt-step"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("3 classes"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// A checkpoint written in the background holds the same state as one written in the loop, and the
// run goes on past it exactly as without checkpoints.
TEST(Trainer, BackgroundCheckpointsHoldTheSameStateAsSynchronousOnes) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("ckpt-async");
  test::make_band_dataset(dir + "/train", 128);
  std::map<std::string, Tensor> final_params[2];
  for (int async = 0; async < 2; ++async) {
    const std::string out = dir + (async ? "/async" : "/sync");
    train::Trainer t(parse({"--data", dir + "/train", "--model", "simple_cnn", "--epochs", "2", "--batch-size", "16",
                            "--threads", "1", "--progress", "off", "--checkpoint-every", "5", "--keep-checkpoints",
                            "10", "--checkpoint-async", async ? "true" : "false", "--checkpoint-dir", out}),
                     rt);
    train::TrainResult r = t.run();
    EXPECT_EQ(r.checkpoint, out + "/ckpt-step000000016.h5");
    final_params[async] = params_of(t.model());
  }
  // Every checkpoint after the first is copied into the previous one's snapshot tensors (the arena).
  for (const char* name : {"ckpt-step000000005.h5", "ckpt-step000000010.h5", "ckpt-step000000015.h5",
                           "ckpt-step000000016.h5"}) {
    const train::CheckpointState a = train::load_checkpoint(dir + "/sync/" + name);
    const train::CheckpointState b = train::load_checkpoint(dir + "/async/" + name);
    ASSERT_EQ(a.tensors.size(), b.tensors.size()) << name;
    for (const auto& [key, t] : a.tensors) {
      const Tensor& u = b.tensors.at(key);
      ASSERT_EQ(t.nbytes(), u.nbytes()) << name << " " << key;
      EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name << " " << key;
    }
    EXPECT_EQ(a.ints.at("step"), b.ints.at("step"));
  }
  for (auto& [name, p] : final_params[0])
    for (int64_t i = 0; i < p.numel(); ++i) ASSERT_EQ(p.f32()[i], final_params[1][name].f32()[i]) << name;
  fs::remove_all(dir);
}

// Resuming from an older checkpoint into a folder that holds later ones: pruning keeps the newest
// of this run's own line and never removes the checkpoint it has just written; the later set is
// another line's, moved aside, not pruned.
TEST(Trainer, PruningKeepsTheCheckpointJustWritten) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("prune");
  test::make_band_dataset(dir + "/train", 512);
  auto c = parse({"--data", dir + "/train", "--model", "mlp", "--hidden", "16", "--steps", "30", "--batch-size", "16",
                  "--threads", "1", "--progress", "off", "--checkpoint-dir", dir + "/ck", "--checkpoint-every", "10",
                  "--keep-checkpoints", "10"});
  train::Trainer(c, rt).run();
  for (int s : {10, 20, 30}) ASSERT_TRUE(fs::exists(dir + "/ck/ckpt-step0000000" + std::to_string(s) + ".h5")) << s;
  auto r = parse({"--data", dir + "/train", "--model", "mlp", "--hidden", "16", "--steps", "15", "--batch-size", "16",
                  "--threads", "1", "--progress", "off", "--checkpoint-dir", dir + "/ck", "--checkpoint-every", "10",
                  "--keep-checkpoints", "2", "--resume", dir + "/ck/ckpt-step000000010.h5"});
  EXPECT_EQ(train::Trainer(r, rt).run().steps, 15);
  EXPECT_TRUE(fs::exists(dir + "/ck/ckpt-step000000015.h5")) << "the checkpoint just written was pruned";
  EXPECT_TRUE(fs::exists(dir + "/ck/ckpt-step000000010.h5"));  // the newest before it (keep 2)
  bool aside = false;  // a later step is not this run's to prune: its line is kept aside
  for (const auto& e : fs::directory_iterator(dir + "/ck"))
    aside |= e.is_directory() && fs::exists(e.path() / "ckpt-step000000030.h5");
  EXPECT_TRUE(aside) << "the later set is gone";
  fs::remove_all(dir);
}

TEST(Trainer, NonFiniteLossStopsBeforeItsCheckpoint) {
  // Losses are read at log lines and before checkpoints (not every step, so a GPU never waits for
  // them), and the weights are checked before each checkpoint: a diverging run stops naming the
  // step, no checkpoint of a step at or after a non-finite loss is written, and every checkpoint
  // that was written holds finite weights.
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("diverge");
  test::make_band_dataset(dir + "/train", 512);
  auto c = parse({"--data", dir + "/train", "--model", "mlp", "--hidden", "16", "--steps", "30", "--batch-size", "16",
                  "--threads", "1", "--progress", "off", "--lr", "3e3", "--log-every", "25", "--checkpoint-dir",
                  dir + "/ck", "--checkpoint-every", "3", "--keep-checkpoints", "100"});
  std::string what;
  try {
    train::Trainer(c, rt).run();
  } catch (const DivergenceError& e) {  // exit status 3, not 2 (a bad option)
    what = e.what();
  }
  test::expect_stopped_before_checkpoint(what, dir + "/ck");
  fs::remove_all(dir);
}

TEST(Trainer, ResumeRejectsACheckpointOfAnotherModel) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("mismatch");
  test::make_band_dataset(dir + "/train", 64);
  auto c = parse({"--data", dir + "/train", "--model", "mlp", "--steps", "2", "--batch-size", "16", "--threads", "1",
                  "--progress", "off", "--checkpoint-dir", dir + "/ck"});
  train::Trainer(c, rt).run();
  auto d = parse({"--data", dir + "/train", "--model", "simple_cnn", "--steps", "4", "--threads", "1", "--progress",
                  "off", "--resume", dir + "/ck"});
  try {
    train::Trainer(d, rt).run();
    FAIL() << "resumed a mlp checkpoint into simple_cnn";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// What a resume takes from a checkpoint beyond the parameters (the loss scale, the pruning masks,
// the step) is checked against what it goes into: a file that holds another size or dtype there
// (with a valid checksum) is an InputError naming the file, not a read past a buffer or an
// internal error.
TEST(Trainer, ResumeRefusesStateOfAnotherSizeOrType) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("resume-fit");
  test::make_band_dataset(dir + "/train", 64);
  std::vector<std::string> base = {"--data", dir + "/train", "--model", "mlp", "--hidden", "16", "--steps", "3",
                                   "--batch-size", "16", "--threads", "1", "--progress", "off", "--precision", "fp16",
                                   "--prune-sparsity", "0.5", "--prune-start", "1", "--prune-end", "1"};
  train::Trainer(parse(base, {"--checkpoint-dir", dir + "/ck", "--checkpoint-every", "2"}), rt).run();
  const train::CheckpointState good = train::load_checkpoint(dir + "/ck/ckpt-step000000002.h5");
  ASSERT_TRUE(good.tensors.count("meta/loss_scale"));
  ASSERT_TRUE(good.tensors.count("mask/1.weight"));
  const std::map<std::string, std::function<void(train::CheckpointState&)>> edits = {
      {"loss scale", [](train::CheckpointState& s) { s.tensors["meta/loss_scale"] = Tensor::empty({0}); }},
      {"pruning mask of 1.weight",
       [](train::CheckpointState& s) {
         s.tensors["mask/1.weight"] = Tensor::zeros(s.tensors["mask/1.weight"].shape(), DType::BF16);
       }},
      {"no step", [](train::CheckpointState& s) { s.ints.erase("step"); }}};
  for (const auto& [what, edit] : edits) {
    train::CheckpointState s = good;
    edit(s);
    const std::string file = dir + "/bad/ckpt-step000000002.h5";
    fs::create_directories(dir + "/bad");
    train::save_checkpoint(file, s);
    try {
      train::Trainer(parse(base, {"--resume", file}), rt).run();
      ADD_FAILURE() << "resumed from a checkpoint with a bad " << what;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  cpu_engine().set_math_precision(MathPrecision::F32);
  fs::remove_all(dir);
}

TEST(Trainer, MixedPrecisionTrains) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("amp");
  test::make_band_dataset(dir + "/train", 256);
  for (const char* precision : {"bf16", "fp16"}) {
    auto c = parse({"--data", dir + "/train", "--test-data", dir + "/train", "--model", "simple_cnn", "--epochs", "2",
                    "--batch-size", "16", "--threads", "1", "--progress", "off", "--precision", precision});
    train::Trainer t(c, rt);
    EXPECT_GT(t.run().last_eval.accuracy, 0.95) << precision;
  }
  cpu_engine().set_math_precision(MathPrecision::F32);
  fs::remove_all(dir);
}

// Mixed precision's weight copies (bf16/fp16, made once per step) change no number: the MLP trained
// with them ends with the parameters and the test loss of the run whose GEMMs round the fp32
// masters on every call (DTRAIN_WORKING_COPIES=0). The hidden layers' GEMMs read the copies; the
// 4-class classifier's stay fp32 under bf16 and read the master.
TEST(Trainer, WeightCopiesChangeNoNumber) {
  comm::Runtime& rt = runtime();
  std::string dir = test::temp_dir("copies");
  test::make_band_dataset(dir + "/train", 256);
  test::make_band_dataset(dir + "/test", 100, 8, 4, 100, 99);
  for (const char* precision : {"bf16", "fp16"}) {
    std::map<std::string, Tensor> params[2];
    train::EvalResult eval[2];
    for (int copies = 0; copies < 2; ++copies) {
      ::setenv("DTRAIN_WORKING_COPIES", copies ? "1" : "0", 1);
      auto c = parse({"--data", dir + "/train", "--test-data", dir + "/test", "--model", "mlp", "--hidden", "32,32",
                      "--epochs", "2", "--batch-size", "16", "--threads", "1", "--progress", "off", "--optimizer",
                      "adamw", "--lr", "0.01", "--precision", precision});
      train::Trainer t(c, rt);
      eval[copies] = t.run().last_eval;
      params[copies] = params_of(t.model());
      int with_copy = 0;
      for (nn::Parameter* p : t.model().parameters()) with_copy += p->working.defined();
      EXPECT_EQ(with_copy, copies ? 3 : 0) << precision << ": the three Linear weights have copies";
    }
    for (auto& [name, a] : params[0]) {
      const Tensor& b = params[1][name];
      for (int64_t i = 0; i < a.numel(); ++i)
        ASSERT_EQ(a.f32()[i], b.f32()[i]) << precision << " " << name << "[" << i << "]";
    }
    EXPECT_EQ(eval[0].loss, eval[1].loss) << precision;
    EXPECT_EQ(eval[0].accuracy, eval[1].accuracy) << precision;
    EXPECT_GT(eval[1].accuracy, 0.9) << precision;
  }
  ::unsetenv("DTRAIN_WORKING_COPIES");
  cpu_engine().set_math_precision(MathPrecision::F32);
  fs::remove_all(dir);
}

TEST(Trainer, CheckFiniteWeightsNamesTheParameterStepAndRank) {
  nn::Parameter a{"fc1.weight", Tensor::from({3}, {1.f, 2.f, 3.f}), Tensor::zeros({3})};
  nn::Parameter b{"fc2.bias", Tensor::from({2}, {0.5f, std::numeric_limits<float>::infinity()}), Tensor::zeros({2})};
  EXPECT_NO_THROW(train::check_finite_weights({&a}, 7, 1));
  try {
    train::check_finite_weights({&a, &b}, 7, 1);
    FAIL() << "an infinite bias passed";
  } catch (const DivergenceError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("fc2.bias"), std::string::npos) << w;
    EXPECT_NE(w.find("after step 7 on rank 1"), std::string::npos) << w;
  }
  b.value.f32()[1] = std::nanf("");
  EXPECT_THROW(train::check_finite_weights({&b}, 8, 0), DivergenceError);
}

// A resume's change note names every option that differs from the checkpoint's configuration (data,
// seed, steps, LoRA alpha, weight decay, clipping among them; an image model's dropout), and
// nothing else: not --resume itself, nothing when the configuration is the same.
TEST(Provenance, ResumeNamesEveryOptionThatChanged) {
  train::TrainConfig then = train::model_defaults("gpt");
  then.data = "/data/a";
  const std::string provenance = train::to_json(train::run_provenance("1 rank", train::config_ini(then)));
  train::TrainConfig now = then;
  now.resume = "/ckpt";
  EXPECT_EQ(train::resume_changes(provenance, train::config_ini(now)), "");
  now.data = "/data/b";
  now.seed = 7;
  now.steps = 900;
  now.lora_alpha = 8.f;
  now.weight_decay = 0.05f;
  now.clip_grad_norm = 0.5f;
  const std::string note = train::resume_changes(provenance, train::config_ini(now));
  for (const char* option : {"--data /data/a -> /data/b", "--seed 42 -> 7", "--steps", "--lora-alpha", "--weight-decay",
                             "--clip-grad-norm 1 -> 0.5"})
    EXPECT_NE(note.find(option), std::string::npos) << option << " in: " << note;
  EXPECT_EQ(note.find("--resume"), std::string::npos) << note;
  EXPECT_EQ(note.find("--model"), std::string::npos) << note;
  train::TrainConfig mlp = train::model_defaults("mlp"), dropped = mlp;
  dropped.dropout = 0.25f;
  EXPECT_NE(train::resume_changes(train::to_json(train::run_provenance("1 rank", train::config_ini(mlp))),
                                  train::config_ini(dropped))
                .find("--dropout 0 -> 0.25"),
            std::string::npos);
}

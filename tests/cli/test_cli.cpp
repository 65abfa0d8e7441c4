// The dtrain executable on bad input: one clear message naming the file or option, non-zero exit.
// Runs the real binary (single process, and under a real mpiexec -n 2 for the multi-rank cases).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "../train/train_test_util.h"
#include "dtrain/kernels/engine.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string out;  // stdout and stderr together
};

Result shell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

Result run(const std::string& args) { return shell(std::string(DTRAIN_BINARY_DIR) + "/dtrain " + args + " 2>&1"); }

// DIR/text/a.txt, a short sentence `lines` times over, converted into DIR/tok (bytes).
Result small_text_tokens(const std::string& dir, int lines) {
  fs::create_directories(dir + "/text");
  {
    std::ofstream out(dir + "/text/a.txt");
    for (int i = 0; i < lines; ++i) out << "a small text, " << i % 10 << " times over. ";
  }
  return run("convert text --inputs " + dir + "/text --out " + dir + "/tok");
}

Result mpirun(int np, const std::string& args) {
  return shell("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n " +
               std::to_string(np) + " --oversubscribe --bind-to none " + std::string(DTRAIN_BINARY_DIR) + "/dtrain " +
               args + " 2>&1");
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t c = 0;
  for (size_t pos = hay.find(needle); pos != std::string::npos; pos = hay.find(needle, pos + 1)) ++c;
  return c;
}

// The last validation loss of a metrics file, or -1.
double last_val_loss(const std::string& file) {
  std::ifstream in(file);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find("\"val_loss\"") != std::string::npos) last = line;
  auto p = last.find("\"val_loss\": ");
  return p == std::string::npos ? -1.0 : std::stod(last.substr(p + 12));
}

#define EXPECT_FAILS_NAMING(r, what)                             \
  do {                                                           \
    EXPECT_NE((r).code, 0) << (r).out;                           \
    EXPECT_NE((r).out.find(what), std::string::npos) << (r).out; \
  } while (0)

}  // namespace

TEST(Cli, UnknownCommandAndOptions) {
  EXPECT_FAILS_NAMING(run("frobnicate"), "frobnicate");
  EXPECT_FAILS_NAMING(run("train --synthetic --no-such-flag"), "no-such-flag");
  EXPECT_FAILS_NAMING(run("train --synthetic --batch-size -3"), "--batch-size");
  EXPECT_FAILS_NAMING(run("train --synthetic --model nosuch"), "nosuch");
  EXPECT_FAILS_NAMING(run("bench nosuch"), "nosuch");
  Result help = run("train --help");
  EXPECT_EQ(help.code, 0);
  for (const char* opt : {"--data", "--test-data", "--model", "--epochs", "--steps", "--batch-size", "--lr",
                          "--threads", "--synthetic", "--metrics", "--checkpoint-dir", "--resume"})
    EXPECT_NE(help.out.find(opt), std::string::npos) << opt;
  EXPECT_NE(help.out.find("(=64)"), std::string::npos) << "defaults are shown";
}

// One configuration for every model: the model's own defaults and sections in --help, other
// models' options refused naming both, and --print-config an INI that reproduces the run bitwise.
TEST(Cli, OneConfigurationForEveryModel) {
  Result gpt_help = run("train --model gpt --help");
  EXPECT_EQ(gpt_help.code, 0) << gpt_help.out;
  EXPECT_NE(gpt_help.out.find("Language models (--model gpt, llama)"), std::string::npos) << gpt_help.out;
  EXPECT_NE(gpt_help.out.find("--lr arg (=0.001)"), std::string::npos) << "the gpt's own default";
  EXPECT_NE(run("train --help").out.find("--lr arg (=0.05)"), std::string::npos);
  Result sync_bn = run("train --model gpt --data x --sync-batchnorm true");
  EXPECT_EQ(sync_bn.code, 2) << sync_bn.out;
  EXPECT_NE(sync_bn.out.find("option --sync-batchnorm does not combine with --model gpt"), std::string::npos)
      << sync_bn.out;
  EXPECT_FAILS_NAMING(run("train --synthetic --zero1 true --zero 3"), "option --zero1 true is --zero 1");
  EXPECT_FAILS_NAMING(run("train --synthetic --zero 4"), "option --zero must be 0, 1, 2 or 3");
  EXPECT_FAILS_NAMING(run("train --synthetic --zero 3 --prune-sparsity 0.5"),
                      "option --zero 3 does not combine with --prune-sparsity");
  EXPECT_FAILS_NAMING(run("train --synthetic --zero 3 --zero-gather-dtype f16"), "option --zero-gather-dtype");
  EXPECT_FAILS_NAMING(run("train --synthetic --prune-sparsity 1"), "--prune-sparsity");
  EXPECT_FAILS_NAMING(run("train --model gpt --data x --prune-sparsity 0.5 --tp 2"), "--prune-sparsity");
  Result tp = run("train --synthetic --tp 2");
  EXPECT_EQ(tp.code, 2) << tp.out;
  // --log-every 0 (one line at the end) stays the GPT's, as benchmarks/pipeline/pipeline_memory.py uses it.
  EXPECT_EQ(run("train --model gpt --data x --log-every 0 --print-config").code, 0);
  EXPECT_FAILS_NAMING(run("train --synthetic --log-every 0"), "--log-every");
  EXPECT_NE(tp.out.find("option --tp does not combine with --model simple_cnn"), std::string::npos) << tp.out;

  std::string dir = dtrain::test::temp_dir("cli-print-config");
  const std::string job =
      "train --synthetic --model mlp --hidden 16 --steps 12 --lr 0.07 --momentum 0.8 "
      "--threads 1 --progress off --seed ";
  Result printed = run(job + "5 --print-config");
  ASSERT_EQ(printed.code, 0) << printed.out;
  EXPECT_NE(printed.out.find("\nlr = 0.07\n"), std::string::npos) << printed.out;
  EXPECT_EQ(printed.out.find("layers ="), std::string::npos) << "no gpt option in an mlp's configuration";
  std::ofstream(dir + "/run.ini") << printed.out;
  ASSERT_EQ(run(job + "5 --checkpoint-dir " + dir + "/given").code, 0);
  Result fed_back = run("train --config " + dir + "/run.ini --checkpoint-dir " + dir + "/fed-back");
  ASSERT_EQ(fed_back.code, 0) << fed_back.out;
  const std::string last = "/ckpt-step000000012.h5";
  Result same = shell("h5diff " + dir + "/given" + last + " " + dir + "/fed-back" + last + " /param /param 2>&1");
  EXPECT_EQ(same.code, 0) << same.out;
  // The control: another seed is told apart.
  ASSERT_EQ(run(job + "6 --checkpoint-dir " + dir + "/other").code, 0);
  EXPECT_NE(shell("h5diff -q " + dir + "/given" + last + " " + dir + "/other" + last + " /param /param").code, 0);
  fs::remove_all(dir);
}

TEST(Cli, MissingEmptyAndCorruptData) {
  std::string dir = dtrain::test::temp_dir("cli-data");
  EXPECT_FAILS_NAMING(run("train --data /nonexistent/shards"), "/nonexistent/shards");
  fs::create_directories(dir + "/empty");
  EXPECT_FAILS_NAMING(run("train --data " + dir + "/empty"), dir + "/empty");
  fs::create_directories(dir + "/garbage");
  std::ofstream(dir + "/garbage/shard-00000.h5") << "this is not an HDF5 file at all";
  EXPECT_FAILS_NAMING(run("train --data " + dir + "/garbage"), "shard-00000.h5");
  EXPECT_FAILS_NAMING(run("eval --checkpoint " + dir + "/none.h5 --data " + dir + "/garbage"), "none.h5");
  fs::remove_all(dir);
}

TEST(Cli, ShapeThatDoesNotFitTheModel) {
  // A model trained on 8x8 images, evaluated on (and resumed with) 12x12 images.
  std::string dir = dtrain::test::temp_dir("cli-shape");
  dtrain::test::make_band_dataset(dir + "/small", 64, 8);
  dtrain::test::make_band_dataset(dir + "/large", 64, 12);
  Result ok = run("train --data " + dir + "/small --steps 2 --batch-size 16 --threads 1 --checkpoint-dir " + dir +
                  "/ck --progress off");
  ASSERT_EQ(ok.code, 0) << ok.out;
  Result ev = run("eval --checkpoint " + dir + "/ck --data " + dir + "/large");
  EXPECT_FAILS_NAMING(ev, dir + "/large");
  EXPECT_NE(ev.out.find("[1, 8, 8]"), std::string::npos) << ev.out;
  Result rs = run("train --data " + dir + "/large --steps 4 --threads 1 --resume " + dir + "/ck --progress off");
  EXPECT_FAILS_NAMING(rs, "ckpt-step");
  Result good = run("eval --checkpoint " + dir + "/ck --data " + dir + "/small");
  EXPECT_EQ(good.code, 0) << good.out;
  EXPECT_NE(good.out.find("64 samples"), std::string::npos) << good.out;
  fs::remove_all(dir);
}

// The losses of a metrics file's step lines, as written.
// The whole of a file ("" when it cannot be read).
std::string file_text(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::vector<std::string> step_losses(const std::string& file) {
  std::ifstream in(file);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (auto p = line.find("\"loss\": "); p != std::string::npos && line.find("\"step\"") != std::string::npos)
      out.push_back(line.substr(p + 8, line.find_first_of(",}", p) - p - 8));
  return out;
}

// --model-file: the built-in ResNet-20 written as examples/models/resnet20.json trains to the same
// losses over 10 steps; its checkpoint carries the definition (eval needs no file, a resume with
// another file is refused); a file whose shapes do not fit fails naming the file and the layer.
TEST(Cli, ModelFileTrainsAsTheBuiltInModel) {
  const std::string dir = dtrain::test::temp_dir("cli-model-file");
  dtrain::test::make_band_dataset(dir + "/data", 64, 12);
  const std::string file = std::string(DTRAIN_SOURCE_DIR) + "/examples/models/resnet20.json";
  const std::string common = "train --data " + dir +
                             "/data --epochs 2 --steps 10 --log-every 1 --batch-size 8 --threads 1 " +
                             "--progress off --lr 0.05 ";
  Result builtin = run(common + "--model resnet20 --metrics " + dir + "/builtin.jsonl");
  Result from_file =
      run(common + "--model-file " + file + " --metrics " + dir + "/file.jsonl --checkpoint-dir " + dir + "/ck");
  ASSERT_EQ(builtin.code, 0) << builtin.out;
  ASSERT_EQ(from_file.code, 0) << from_file.out;
  const auto want = step_losses(dir + "/builtin.jsonl");
  EXPECT_EQ(want.size(), 10u);
  EXPECT_EQ(step_losses(dir + "/file.jsonl"), want);

  Result ev = run("eval --checkpoint " + dir + "/ck --data " + dir + "/data");
  EXPECT_EQ(ev.code, 0) << ev.out;
  EXPECT_NE(ev.out.find("64 samples"), std::string::npos) << ev.out;
  std::ofstream(dir + "/other.json") << R"({"name": "resnet20", "layers": [{"type": "flatten"},
      {"type": "linear", "out": "classes"}]})";
  EXPECT_FAILS_NAMING(run(common + "--model-file " + dir + "/other.json --resume " + dir + "/ck"), "other.json");
  EXPECT_FAILS_NAMING(run(common + "--model mlp --model-file " + file), "--model-file");

  std::ofstream(dir + "/bad.json") << R"({"layers": [{"type": "maxpool", "kernel": 4},
      {"name": "wide", "type": "conv", "out": 8, "kernel": 5}, {"type": "flatten"},
      {"type": "linear", "out": "classes"}]})";
  Result bad = run(common + "--model-file " + dir + "/bad.json");
  EXPECT_FAILS_NAMING(bad, "bad.json): layer wide (conv): input [1, 3, 3] is smaller than kernel 5");
  EXPECT_FAILS_NAMING(run(common + "--model-file " + dir + "/missing.json"), "missing.json");
  fs::remove_all(dir);
}

// "accuracy 56.25%, loss 1.2345" of an eval report line starting with `what` ("fp32", "int8").
std::string scores(const std::string& out, const std::string& what) {
  const size_t at = out.find(what + "  accuracy");
  if (at == std::string::npos) return "no " + what + " line in: " + out;
  const size_t end = out.find(", ", out.find("loss", at));
  return out.substr(at + what.size() + 2, end - at - what.size() - 2);
}

// Structured pruning made physical: prune-export's smaller model evaluates exactly as the masked one
// (the same accuracy and loss to 4 decimals), and eval, eval --int8 and quantize read it; a
// checkpoint without pruned channels is refused naming the option that makes them.
TEST(Cli, PruneExportGivesASmallerModelThatEvaluatesTheSame) {
  std::string dir = dtrain::test::temp_dir("cli-prune-export");
  dtrain::test::make_band_dataset(dir + "/data", 64, 8);
  const std::string train = "train --model simple_cnn --data " + dir +
                            "/data --steps 3 --batch-size 16 --threads 1 "
                            "--progress off --checkpoint-dir ";
  Result t = run(train + dir + "/ck --prune-sparsity 0.5 --prune-structured true --prune-start 0 --prune-end 0");
  ASSERT_EQ(t.code, 0) << t.out;
  Result ex = run("prune-export --checkpoint " + dir + "/ck --out " + dir + "/small.h5");
  ASSERT_EQ(ex.code, 0) << ex.out;
  EXPECT_NE(ex.out.find("16 -> 8 output channels"), std::string::npos) << ex.out;
  EXPECT_NE(ex.out.find("32 -> 16 output channels"), std::string::npos) << ex.out;
  Result dense = run("eval --checkpoint " + dir + "/ck --data " + dir + "/data --batch-size 16");
  Result small = run("eval --checkpoint " + dir + "/small.h5 --data " + dir + "/data --batch-size 16 --int8");
  ASSERT_EQ(small.code, 0) << small.out;
  EXPECT_EQ(scores(small.out, "fp32"), scores(dense.out, "fp32"));
  Result q = run("quantize --checkpoint " + dir + "/small.h5 --data " + dir + "/data --batch-size 16 --out " + dir +
                 "/small8.h5");
  ASSERT_EQ(q.code, 0) << q.out;
  Result q_eval = run("eval --checkpoint " + dir + "/small8.h5 --data " + dir + "/data");
  EXPECT_EQ(q_eval.code, 0) << q_eval.out;
  EXPECT_EQ(scores(q_eval.out, "int8"), scores(small.out, "int8")) << "the int8 checkpoint runs as eval --int8";
  Result u = run(train + dir + "/ck-dense");
  ASSERT_EQ(u.code, 0) << u.out;
  EXPECT_FAILS_NAMING(run("prune-export --checkpoint " + dir + "/ck-dense --out " + dir + "/x.h5"),
                      "--prune-structured");
  EXPECT_FAILS_NAMING(run("prune-export --checkpoint " + dir + "/small8.h5 --out " + dir + "/x.h5"), "int8");
  fs::remove_all(dir);
}

// ResNet-20 in int8: eval --int8 beside fp32, and its int8 checkpoint (buffers and residual steps
// stored) evaluates as the int8 model it was written from.
TEST(Cli, ResNet20RunsInInt8) {
  std::string dir = dtrain::test::temp_dir("cli-resnet-int8");
  dtrain::test::make_band_dataset(dir + "/data", 64, 8);
  Result t = run("train --model resnet20 --data " + dir +
                 "/data --steps 2 --batch-size 16 --threads 1 "
                 "--progress off --checkpoint-dir " +
                 dir + "/ck");
  ASSERT_EQ(t.code, 0) << t.out;
  Result side = run("eval --checkpoint " + dir + "/ck --data " + dir +
                    "/data --batch-size 16 --int8 "
                    "--calibration-batches 2");
  ASSERT_EQ(side.code, 0) << side.out;
  Result q = run("quantize --checkpoint " + dir + "/ck --data " + dir + "/data --out " + dir +
                 "/r8.h5 "
                 "--batch-size 16 --calibration-batches 2");
  ASSERT_EQ(q.code, 0) << q.out;
  EXPECT_NE(q.out.find("22 int8 steps"), std::string::npos) << q.out;
  Result q_eval = run("eval --checkpoint " + dir + "/r8.h5 --data " + dir + "/data");
  ASSERT_EQ(q_eval.code, 0) << q_eval.out;
  EXPECT_EQ(scores(q_eval.out, "int8"), scores(side.out, "int8"));
  fs::remove_all(dir);
}

TEST(CliMpi, BadOptionFailsEveryRankWithOneMessage) {
  Result r = mpirun(2, "train --synthetic --lr -1 --progress off");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "--lr must be > 0"), 1u) << r.out;  // said once, by rank 0
}

// A model state larger than a rank may hold (--memory-per-rank-mb, here below simple_cnn's 0.31 MiB
// with AdamW) is refused before the first step on every rank, once, with what it needs and the
// stages and rank counts that fit.
TEST(CliMpi, AModelThatCannotFitIsRefusedBeforeItsFirstStep) {
  Result r =
      mpirun(2, "train --synthetic --steps 5 --threads 1 --progress off --optimizer adamw --memory-per-rank-mb 0.25");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(count(r.out, "the model state of this run needs 0.31 MiB"), 1u) << r.out;
  EXPECT_NE(r.out.find("it fits with --zero 2 (0.20 MiB)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  Result small =
      mpirun(2, "train --synthetic --steps 5 --threads 1 --progress off --optimizer adamw --memory-per-rank-mb 0.15");
  EXPECT_EQ(small.code, 2) << small.out;
  EXPECT_NE(small.out.find("data-parallel ranks at --zero 3"), std::string::npos) << small.out;
  Result fits = mpirun(
      2, "train --synthetic --steps 2 --threads 1 --progress off --optimizer adamw --memory-per-rank-mb 0.25 --zero 2");
  EXPECT_EQ(fits.code, 0) << fits.out;
  EXPECT_NE(fits.out.find("memory of rank 0 (MiB): model state 0.20"), std::string::npos) << fits.out;
}

// A resume whose read on rank 0 takes 4 s (DTRAIN_TEST_CHECKPOINT_READ_DELAY), beyond a
// communication timeout of 2 s: the other rank waits under --checkpoint-timeout, and the run goes
// on; with --checkpoint-timeout 1 the same wait ends the job naming rank 0.
TEST(CliMpi, SlowResumeReadWaitsUnderTheCheckpointTimeout) {
  std::string dir = dtrain::test::temp_dir("cli-slow-read");
  ASSERT_EQ(small_text_tokens(dir, 400).code, 0);
  const std::string train = "train --model gpt --layers 1 --width 32 --heads 2 --context 16 --batch-size 4 "
                            "--eval-every 0 --eval-batches 1 --threads 1 --progress off --data " + dir +
                            "/tok --checkpoint-dir " + dir + "/ckpt ";
  ASSERT_EQ(mpirun(2, train + "--steps 4").code, 0);
  const std::string slow = "DTRAIN_COMM_TIMEOUT=2 DTRAIN_TEST_CHECKPOINT_READ_DELAY=0:4000 ";
  Result resumed = shell(slow + "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n 2 "
                         "--oversubscribe --bind-to none " + std::string(DTRAIN_BINARY_DIR) + "/dtrain " + train +
                         "--steps 6 --resume " + dir + "/ckpt 2>&1");
  EXPECT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  Result cut = shell(slow + "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n 2 "
                     "--oversubscribe --bind-to none " + std::string(DTRAIN_BINARY_DIR) + "/dtrain " + train +
                     "--steps 8 --resume " + dir + "/ckpt --checkpoint-timeout 1 2>&1");
  EXPECT_NE(cut.code, 0) << cut.out;
  EXPECT_NE(cut.out.find("ranks that did not arrive: 0"), std::string::npos) << cut.out;
  fs::remove_all(dir);
}

TEST(CliMpi, MissingDataOnTwoRanks) {
  Result r = mpirun(2, "train --data /nonexistent/dir --progress off");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "/nonexistent/dir"), 1u) << r.out;
}

TEST(CliMpi, AnErrorOnRankZeroOnlyEndsEveryRankAtOnce) {
  // Only rank 0 opens the metrics file: the other rank must not wait for it in a collective.
  auto t0 = std::chrono::steady_clock::now();
  Result r = mpirun(2, "train --synthetic --steps 5 --threads 1 --progress off --metrics /proc/no/such/m.jsonl");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "/proc/no/such/m.jsonl"), 1u) << r.out;
  EXPECT_LT(s, 30.0) << "a rank waited for the failed one";
}

// A validation shard that only rank 1 finds corrupt (each rank runs in a folder of its own with its
// own copy of the test set, as nodes with node-local copies would): the shard is opened on its first
// read at the epoch's end, outside every agreed check. Rank 1's own message is printed, naming it
// and the file, and the job ends within seconds with the bad-input status on every rank.
TEST(CliMpi, AnInputErrorOnOneRankAloneIsHeardAndEndsTheJob) {
  const std::string dir = dtrain::test::temp_dir("cli-lone-error");
  dtrain::test::make_band_dataset(dir + "/train", 400, 28, 4, 200);
  for (const char* r : {"rank0", "rank1"}) dtrain::test::make_band_dataset(dir + "/" + r + "/test", 200, 28, 4, 100);
  std::vector<fs::path> shards;
  for (const auto& e : fs::directory_iterator(dir + "/rank1/test"))
    if (e.path().extension() == ".h5" && e.path().filename() != "shards.index") shards.push_back(e.path());
  ASSERT_EQ(shards.size(), 2u);
  std::sort(shards.begin(), shards.end());
  const fs::path bad = shards.back();
  const auto stamp = fs::last_write_time(bad);  // the same size and time: shards.index still trusts it
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.write("\0\0\0\0\0\0\0\0", 8);  // the HDF5 signature gone
  }
  fs::last_write_time(bad, stamp);
  auto t0 = std::chrono::steady_clock::now();
  Result r = shell(
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n 2 "
      "--oversubscribe --bind-to none sh -c 'cd " +
      dir + "/rank$OMPI_COMM_WORLD_RANK && exec " + DTRAIN_BINARY_DIR + "/dtrain train --data " + dir +
      "/train --test-data test --model mlp "
      "--hidden 16 --epochs 1 --threads 1 --progress off' 2>&1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("rank 1 on [^)]*\\): dtrain train: error: .*" +
                                                  bad.filename().string() + ".*found by this rank alone")))
      << r.out;
  EXPECT_LT(s, 30.0) << r.out;
  fs::remove_all(dir);
}

// A rank that never reaches MPI_Init (the DTRAIN_TEST_START_DELAY hook): the others do not wait for
// it past the start-up deadline (DTRAIN_COMM_TIMEOUT), and say which phase it was.
TEST(CliMpi, ARankThatNeverStartsEndsTheJobAtTheStartUpDeadline) {
  auto t0 = std::chrono::steady_clock::now();
  Result r = shell(
      "DTRAIN_COMM_TIMEOUT=3 DTRAIN_TEST_START_DELAY=1:60 OMPI_ALLOW_RUN_AS_ROOT=1 "
      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n 2 --oversubscribe --bind-to none " +
      std::string(DTRAIN_BINARY_DIR) + "/dtrain info 2>&1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("MPI start-up (MPI_Init) did not finish within 3 s"), std::string::npos) << r.out;
  EXPECT_LT(s, 40.0) << r.out;
}

// README "Exit statuses": the same status on every rank, one per kind of ending.
TEST(CliMpi, ExitStatusesSayHowTheRunEnded) {
  EXPECT_EQ(mpirun(2, "train --synthetic --steps 2 --threads 1 --progress off").code, 0);
  Result bad = mpirun(2, "train --synthetic --lr -1 --progress off");
  EXPECT_EQ(bad.code, 2) << bad.out;
  Result diverged =
      mpirun(2, "train --synthetic --model mlp --steps 20 --lr 1e30 --log-every 1 --threads 1 --progress off");
  EXPECT_EQ(diverged.code, 3) << diverged.out;
  EXPECT_EQ(count(diverged.out, "loss became"), 1u) << diverged.out;  // said once, by rank 0
  // A missing checkpoint names the option the user gave.
  Result gen = run("generate --checkpoint /nonexistent/ckpt");
  EXPECT_EQ(gen.code, 2) << gen.out;
  EXPECT_NE(gen.out.find("option --checkpoint: '/nonexistent/ckpt'"), std::string::npos) << gen.out;
  EXPECT_EQ(gen.out.find("--resume"), std::string::npos) << gen.out;
}

// A checkpoint write slower than the communication timeout (2 s here; the writer pauses 3 s before
// its rename): the other rank waits under --checkpoint-timeout instead, the run finishes, and the
// log says the write was slow. With --checkpoint-timeout 1 the same wait ends the job, naming it.
TEST(CliMpi, ASlowCheckpointWriteDoesNotEndTheJob) {
  const std::string dir = dtrain::test::temp_dir("cli-slow-ckpt");
  const std::string cmd =
      "DTRAIN_COMM_TIMEOUT=2 DTRAIN_TEST_CHECKPOINT_RENAME_DELAY_MS=3000 OMPI_ALLOW_RUN_AS_ROOT=1 "
      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpiexec -n 2 --oversubscribe --bind-to none " +
      std::string(DTRAIN_BINARY_DIR) + "/dtrain train --model mlp --synthetic --steps 6 " +
      "--checkpoint-every 3 --checkpoint-async false --progress off --threads 1 --checkpoint-dir " + dir;
  Result slow = shell(cmd + "/a 2>&1");
  EXPECT_EQ(slow.code, 0) << slow.out;
  EXPECT_NE(slow.out.find("over half the communication timeout"), std::string::npos) << slow.out;
  EXPECT_TRUE(fs::exists(dir + "/a/ckpt-step000000006.h5"));
  Result strict = shell(cmd + "/b --checkpoint-timeout 1 2>&1");
  EXPECT_NE(strict.code, 0) << strict.out;
  EXPECT_NE(strict.out.find("did not complete within 1 s"), std::string::npos) << strict.out;
  fs::remove_all(dir);
}

// --progress auto draws a bar only where a person watches: on a terminal (a pty from `script`), the
// bar's carriage returns come; with mpirun's output sent to a file, the ranks' output is still a pty
// of mpirun's, yet the log gets plain lines.
TEST(CliMpi, ProgressBarOnlyWhereATerminalWatches) {
  const std::string dir = dtrain::test::temp_dir("cli-progress");
  const std::string train = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpiexec -n 1 --bind-to none " +
                            std::string(DTRAIN_BINARY_DIR) + "/dtrain train --model mlp --synthetic --steps 40 " +
                            "--log-every 10 --threads 1";
  Result watched = shell("timeout 120 script -qec '" + train + "' /dev/null 2>&1");
  ASSERT_EQ(watched.code, 0) << watched.out;
  EXPECT_NE(watched.out.find('\r'), std::string::npos) << "no bar on a terminal: " << watched.out;
  Result logged = shell("timeout 120 script -qec '" + train + " > " + dir + "/log 2>&1' /dev/null 2>&1");
  ASSERT_EQ(logged.code, 0) << logged.out;
  const std::string log = file_text(dir + "/log");
  EXPECT_EQ(log.find('\r'), std::string::npos) << log;
  EXPECT_NE(log.find("step 40/40"), std::string::npos) << log;
  fs::remove_all(dir);
}

TEST(CliMpi, TrainsOnTwoRanksAndMatchesOneRank) {
  std::string dir = dtrain::test::temp_dir("cli-dp");
  dtrain::test::make_band_dataset(dir + "/train", 256);
  std::string common = "train --data " + dir + "/train --model mlp --hidden 16 --epochs 1 --global-batch-size 32 " +
                       "--threads 1 --progress off --lr 0.05 --metrics ";
  Result one = mpirun(1, common + dir + "/one.jsonl");
  Result two = mpirun(2, common + dir + "/two.jsonl");
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  // The final loss line of both runs: same global batch, same data order, same model.
  auto last_loss = [](const std::string& file) {
    std::ifstream in(file);
    std::string line, last;
    while (std::getline(in, line))
      if (line.find("\"loss\"") != std::string::npos) last = line;
    auto p = last.find("\"loss\": ");
    return p == std::string::npos ? -1.0 : std::stod(last.substr(p + 8));
  };
  double l1 = last_loss(dir + "/one.jsonl"), l2 = last_loss(dir + "/two.jsonl");
  EXPECT_GT(l1, 0);
  EXPECT_NEAR(l1, l2, 1e-4 * std::max(1.0, l1)) << one.out << two.out;
  fs::remove_all(dir);
}

// --data-mode stream: the first line says what was chosen and why; a run stopped at step 10 and
// resumed gives the losses of the run that did not stop (the streaming order resumes exactly); a
// budget too small to stream and an unknown mode are named.
TEST(Cli, DataModeStreamSaysWhyAndResumesExactly) {
  const std::string dir = dtrain::test::temp_dir("cli-stream");
  dtrain::test::make_band_dataset(dir + "/band", 1000, 8, 4, 100);
  const std::string common =
      "train --data " + dir + "/band --model mlp --hidden 16 --batch-size 16 --threads 1 " +
      "--data-mode stream --data-cache-mb 1 --log-every 1 --progress off --lr-schedule constant ";
  Result whole = run(common + "--steps 20 --metrics " + dir + "/whole.jsonl");
  ASSERT_EQ(whole.code, 0) << whole.out;
  EXPECT_EQ(count(whole.out, "mode stream (0.1 MB in 10 shard(s) <= cache budget 1.0 MB per rank"), 1u) << whole.out;
  ASSERT_EQ(run(common + "--steps 10 --checkpoint-dir " + dir + "/ck").code, 0);
  Result resumed = run(common + "--steps 20 --resume " + dir + "/ck --metrics " + dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const std::vector<std::string> all = step_losses(dir + "/whole.jsonl"), tail = step_losses(dir + "/resumed.jsonl");
  ASSERT_EQ(all.size(), 20u);
  EXPECT_EQ(tail, std::vector<std::string>(all.begin() + 10, all.end()));
  EXPECT_FAILS_NAMING(run("train --data " + dir + "/band --model mlp --steps 1 --data-mode memory"), "--data-mode");
  EXPECT_FAILS_NAMING(run("train --data " + dir + "/band --model mlp --steps 1 --data-mode stream --data-cache-mb 0"),
                      "--data-cache-mb 0");
  fs::remove_all(dir);
}

// Streaming reads shards during the run: shards truncated after step 10 (a read from a truncated
// HDF5 file can return zeros without an error) are named when the next one is read, and every rank
// exits non-zero (the first with status 2) instead of training on garbage.
// Trains `options` on 2 ranks (rank 0 slowed down) and truncates every shard once step `at` is
// logged; returns the log and sets `rc` to the job's exit status.
std::string train_while_truncating(const std::string& dir, const std::string& options, int at, int& rc) {
  const std::string train =
      "DTRAIN_TEST_SLOW=0:data:150 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
      "timeout 120 mpiexec -n 2 --oversubscribe --bind-to none " +
      std::string(DTRAIN_BINARY_DIR) + "/dtrain train --data " + dir + "/band --model mlp " +
      "--hidden 16 --threads 1 --progress off " + options + " > " + dir + "/log 2>&1; echo $? > " + dir + "/rc";
  shell("(" + train + ") & until grep -q 'step " + std::to_string(at) + "/' " + dir + "/log 2>/dev/null || [ -s " +
        dir + "/rc ]; do sleep 0.05; done; for f in " + dir + "/band/*.h5; do truncate -s 4096 $f; done; wait");
  std::ifstream rc_file(dir + "/rc");
  rc = -1;
  rc_file >> rc;
  return file_text(dir + "/log");
}

TEST(CliMpi, StreamingStopsOnAShardChangedDuringTheRun) {
  const std::string dir = dtrain::test::temp_dir("cli-stream-truncated");
  dtrain::test::make_band_dataset(dir + "/band", 8000, 28, 4, 1000);  // 8 shards of 0.78 MB: windows of 1
  int rc = 0;
  const std::string log =
      train_while_truncating(dir, "--steps 60 --log-every 10 --data-mode stream --data-cache-mb 4", 10, rc);
  EXPECT_EQ(rc, 2) << log;
  EXPECT_GE(count(log, "changed during the run: 81"), 1u) << log;  // the bytes when opened, then now
  EXPECT_EQ(count(log, "step 60/"), 0u) << log;
  fs::remove_all(dir);
}

// The store: a shard its holder has not read yet when it changes stops both ranks, the holder's
// message naming it (the other rank was waiting for its rows).
TEST(CliMpi, StoreStopsOnAShardChangedDuringTheRun) {
  const std::string dir = dtrain::test::temp_dir("cli-store-truncated");
  dtrain::test::make_band_dataset(dir + "/band", 8000, 28, 4, 200);  // 40 shards; 2 samples a step touch few
  int rc = 0;
  const std::string log =
      train_while_truncating(dir, "--steps 400 --batch-size 1 --log-every 2 --data-mode store", 2, rc);
  EXPECT_EQ(rc, 2) << log;
  EXPECT_TRUE(std::regex_search(log, std::regex("rank [01]: shard '[^']*' changed during the run"))) << log;
  EXPECT_EQ(count(log, "step 400/"), 0u) << log;
  fs::remove_all(dir);
}

// The node-shared cache: 2 ranks on one node keep one copy of a set that fits the node's budget,
// each reading half the shards into it, and train on exactly the batches of per-request reads.
TEST(CliMpi, NodeSharedCacheReadsEachShardOnceAndTrainsTheSame) {
  const std::string dir = dtrain::test::temp_dir("cli-node-cache");
  dtrain::test::make_band_dataset(dir + "/band", 2000, 8, 4, 100);  // 20 shards
  const std::string common = "train --data " + dir + "/band --model mlp --hidden 16 --batch-size 16 --steps 12 " +
                             "--threads 1 --log-every 1 --progress off ";
  Result shared = mpirun(2, common + "--metrics " + dir + "/shared.jsonl");
  ASSERT_EQ(shared.code, 0) << shared.out;
  EXPECT_EQ(count(shared.out,
                  "mode cache (auto: 0.1 MB in 20 shard(s) <= cache budget 2048 MB per node: one copy "
                  "shared by the node's 2 rank(s))"),
            1u)
      << shared.out;
  Result rows = mpirun(2, common + "--data-mode cache --data-cache-mb 0 --metrics " + dir + "/rows.jsonl");
  ASSERT_EQ(rows.code, 0) << rows.out;
  EXPECT_EQ(step_losses(dir + "/shared.jsonl"), step_losses(dir + "/rows.jsonl"));
  EXPECT_EQ(step_losses(dir + "/shared.jsonl").size(), 12u);
  const std::string all = file_text(dir + "/shared.jsonl");
  EXPECT_EQ(count(all, "\"data_whole_shard_reads\": 10"), 1u) << all;  // rank 0's half of the 20
  fs::remove_all(dir);
}

// --data-mode store: each of 2 ranks holds half the shards, batches gather their rows by all-to-all,
// and training takes the same steps as reading every row itself; rank 0 reads only its 10 shards,
// each once, whole.
TEST(CliMpi, StoreTrainsOnTheSameBatchesAndReadsEachShardOnce) {
  const std::string dir = dtrain::test::temp_dir("cli-store");
  dtrain::test::make_band_dataset(dir + "/band", 2000, 8, 4, 100);  // 20 shards
  const std::string common = "train --data " + dir + "/band --model mlp --hidden 16 --batch-size 16 --steps 40 " +
                             "--threads 1 --log-every 1 --progress off --loader-threads 2 ";
  Result store = mpirun(2, common + "--data-mode store --data-cache-mb 1 --metrics " + dir + "/store.jsonl");
  ASSERT_EQ(store.code, 0) << store.out;
  EXPECT_EQ(count(store.out, "mode store (0.1 MB in 20 shard(s) over 2 rank(s), at most 0.1 MB each"), 1u) << store.out;
  Result rows = mpirun(2, common + "--data-mode cache --data-cache-mb 0 --metrics " + dir + "/rows.jsonl");
  ASSERT_EQ(rows.code, 0) << rows.out;
  EXPECT_EQ(step_losses(dir + "/store.jsonl"), step_losses(dir + "/rows.jsonl"));
  EXPECT_EQ(step_losses(dir + "/store.jsonl").size(), 40u);
  const std::string all = file_text(dir + "/store.jsonl");
  EXPECT_TRUE(std::regex_search(all, std::regex("\"data_whole_shard_reads\": 10[,}]"))) << all;
  EXPECT_TRUE(std::regex_search(all, std::regex("\"data_bytes_read\": 64000[,}]"))) << all;  // 10 x 100 x 8x8 bytes
  fs::remove_all(dir);
}

// --sweep-random draws its configurations from the seed: the same run twice trains the same ones
// (the trainers' lines name them), another seed others; a range without it is refused.
TEST(Cli, SweepRandomDrawsItsConfigurationsFromTheSeed) {
  const std::string dir = dtrain::test::temp_dir("cli-sweep-random");
  auto configurations = [&](int seed, const std::string& name) {
    Result r = run("train --synthetic --model mlp --synthetic-shape 1,8,8 --hidden 8 --steps 2 --threads 1 --seed " +
                   std::to_string(seed) + " --sweep-random 3 --sweep lr=1e-3:1e-1:log --sweep batch-size=8:32 " +
                   "--sweep-dir " + dir + "/" + name);
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<std::string> lines;
    std::istringstream out(r.out);
    for (std::string line; std::getline(out, line);)
      if (line.starts_with("trainer ") && line.find(" (lr=") != std::string::npos) lines.push_back(line);
    return lines;
  };
  const std::vector<std::string> first = configurations(4, "a");
  EXPECT_EQ(first.size(), 3u);
  EXPECT_EQ(configurations(4, "b"), first);
  EXPECT_NE(configurations(5, "c"), first);
  Result grid = run("train --synthetic --model mlp --steps 2 --sweep lr=0.01:0.1 --sweep-dir " + dir + "/d");
  EXPECT_EQ(grid.code, 2) << grid.out;
  EXPECT_EQ(count(grid.out, "a range (0.01:0.1) needs --sweep-random N"), 1u) << grid.out;
  fs::remove_all(dir);
}

// Trainer groups (--trainers, --sweep): each trainer trains as the same configuration alone. On 4
// ranks, a GPT at tp 2 beside an mlp at dp 2 (a sweep over two config files), each with the losses
// of its configuration run alone on 2 ranks with the trainer's seed (the metrics' 9 digits: float's
// round trip); then 4 one-rank trainers, one of which diverges: it stops alone, the others finish,
// the summary ranks them and the job's status says one diverged; the same with population-based
// training.
TEST(CliMpi, TrainerGroupsTrainAsAloneAndADivergingOneStopsAlone) {
  const std::string dir = dtrain::test::temp_dir("cli-sweep");
  dtrain::test::make_band_dataset(dir + "/band", 256);
  ASSERT_EQ(small_text_tokens(dir, 800).code, 0);
  std::ofstream(dir + "/gpt.ini") << "model = gpt\ndata = " << dir << "/tok\nlayers = 1\nheads = 2\nwidth = 16\n"
                                  << "context = 16\nbatch-size = 4\nsteps = 12\nlog-every = 1\nthreads = 1\ntp = 2\n";
  std::ofstream(dir + "/mlp.ini") << "model = mlp\ndata = " << dir << "/band\nhidden = 16\nsteps = 12\n"
                                  << "log-every = 1\nbatch-size = 16\nthreads = 1\nlr = 0.05\n";
  Result groups = mpirun(4, "train --trainers 2 --sweep config=" + dir + "/gpt.ini," + dir + "/mlp.ini --seed 5 " +
                                "--sweep-dir " + dir + "/sweep");
  ASSERT_EQ(groups.code, 0) << groups.out;
  Result gpt = mpirun(2, "train --config " + dir + "/gpt.ini --seed 5 --progress off --metrics " + dir + "/gpt.jsonl");
  Result mlp = mpirun(2, "train --config " + dir + "/mlp.ini --seed 6 --progress off --metrics " + dir + "/mlp.jsonl");
  ASSERT_EQ(gpt.code, 0) << gpt.out;
  ASSERT_EQ(mlp.code, 0) << mlp.out;
  EXPECT_EQ(step_losses(dir + "/sweep/trainer-0/metrics.jsonl"), step_losses(dir + "/gpt.jsonl"));
  EXPECT_EQ(step_losses(dir + "/sweep/trainer-1/metrics.jsonl"), step_losses(dir + "/mlp.jsonl"));
  EXPECT_EQ(step_losses(dir + "/gpt.jsonl").size(), 12u);

  Result four = mpirun(4, "train --config " + dir + "/mlp.ini --trainers 4 --sweep lr=0.01,0.05,1e30,0.1 --seed 1 " +
                              "--sweep-dir " + dir + "/four");
  EXPECT_EQ(four.code, 3) << four.out;
  EXPECT_EQ(count(four.out, "trainer 2 stopped (diverged)"), 1u) << four.out;
  for (int t : {0, 1, 3})
    EXPECT_EQ(step_losses(dir + "/four/trainer-" + std::to_string(t) + "/metrics.jsonl").size(), 12u);
  const std::string json = file_text(dir + "/four/summary.json");
  EXPECT_EQ(count(json, "\"status\": \"ok\""), 3u) << json;
  EXPECT_EQ(count(json, "\"status\": \"diverged\""), 1u) << json;
  // Trainer 1 (lr 0.05, seed 1 + 1) against the same configuration alone on one rank.
  Result alone = run("train --config " + dir + "/mlp.ini --seed 2 --progress off --metrics " + dir + "/alone.jsonl");
  ASSERT_EQ(alone.code, 0) << alone.out;
  EXPECT_EQ(step_losses(dir + "/four/trainer-1/metrics.jsonl"), step_losses(dir + "/alone.jsonl"));

  // Population-based training: rounds at steps 4 and 8; the diverging trainer stops before the
  // first and sits out (no exchange with it, no hang), the others pair up and the losers go on.
  const std::string population = "train --config " + dir + "/mlp.ini --test-data " + dir + "/band --momentum 0.9 " +
                                 "--trainers 4 --sweep lr=0.01,0.05,1e30,0.1 --pbt-every 4 --target-accuracy 1 ";
  Result pbt = mpirun(4, population + "--sweep-dir " + dir + "/pbt");
  EXPECT_EQ(pbt.code, 3) << pbt.out;
  const std::string ranked = file_text(dir + "/pbt/summary.json");
  EXPECT_EQ(count(ranked, "\"time_to_target_s\": \"-1\""), 1u) << ranked;  // all but the diverged one got there
  std::ifstream history(dir + "/pbt/pbt.jsonl");
  int rounds[2] = {0, 0};
  for (std::string line; std::getline(history, line);) {
    EXPECT_EQ(line.find("\"winner\": 2,"), std::string::npos) << line;
    EXPECT_EQ(line.find("\"loser\": 2,"), std::string::npos) << line;
    rounds[line.find("\"step\": 8,") != std::string::npos]++;
  }
  EXPECT_GE(rounds[0], 1) << pbt.out;  // one pair of live trainers at least in each round
  EXPECT_GE(rounds[1], 1) << pbt.out;
  for (int t : {0, 1, 3})
    EXPECT_EQ(step_losses(dir + "/pbt/trainer-" + std::to_string(t) + "/metrics.jsonl").size(), 12u);
  // Two trainers of 2 ranks under ZeRO-1, 2 and 3: the winner's state travels as each rank's pieces
  // (and ZeRO-1's master slice is taken from the received parameters), so every trainer's losses
  // equal those without ZeRO.
  const std::string pairs = "train --config " + dir + "/mlp.ini --test-data " + dir + "/band --optimizer adamw " +
                            "--lr 0.01 --trainers 2 --sweep lr=0.003,0.03 --pbt-every 4 ";
  Result plain = mpirun(4, pairs + "--sweep-dir " + dir + "/pairs-0");
  ASSERT_EQ(plain.code, 0) << plain.out;
  for (const char* zero : {"1", "2", "3"}) {
    const std::string out = dir + "/pairs-" + zero;
    Result sharded = mpirun(4, pairs + "--zero " + zero + " --sweep-dir " + out);
    EXPECT_EQ(sharded.code, 0) << sharded.out;
    for (int t : {0, 1})
      EXPECT_EQ(step_losses(out + "/trainer-" + std::to_string(t) + "/metrics.jsonl"),
                step_losses(dir + "/pairs-0/trainer-" + std::to_string(t) + "/metrics.jsonl"))
          << "--zero " << zero << ", trainer " << t;
  }
  EXPECT_FAILS_NAMING(mpirun(4, "train --synthetic --trainers 2 --sweep lr=0.01,0.1 --pbt-every 2 --steps 4"),
                      "option --pbt-every ranks the trainers by their validation: it needs --test-data");

  // The same population on the simulated device (the device code path on CPU ranks): the winners'
  // state travels as device tensors through the MPI backend's host staging, and every trainer's
  // losses equal the CPU run's.
  Result sim = mpirun(4, population + "--device sim --sweep-dir " + dir + "/pbt-sim");
  EXPECT_EQ(sim.code, 3) << sim.out;
  for (int t : {0, 1, 3})
    EXPECT_EQ(step_losses(dir + "/pbt-sim/trainer-" + std::to_string(t) + "/metrics.jsonl"),
              step_losses(dir + "/pbt/trainer-" + std::to_string(t) + "/metrics.jsonl"))
        << "trainer " << t;
  EXPECT_EQ(file_text(dir + "/pbt-sim/pbt.jsonl"), file_text(dir + "/pbt/pbt.jsonl"));
  fs::remove_all(dir);
}

// The GPT path end to end through the executable: text -> tokens, `dtrain train` with model = gpt
// in an INI file, the same run with --tp 2 on two ranks (same losses), then `dtrain generate`.
TEST(CliMpi, GptConvertTrainTensorParallelAndGenerate) {
  std::string dir = dtrain::test::temp_dir("cli-gpt");
  Result conv = small_text_tokens(dir, 800);
  ASSERT_EQ(conv.code, 0) << conv.out;
  EXPECT_NE(conv.out.find("train tokens"), std::string::npos) << conv.out;
  {
    std::ofstream ini(dir + "/gpt.ini");
    ini << "model = gpt\ndata = " << dir << "/tok\nlayers = 1\nheads = 2\nwidth = 16\ncontext = 16\n"
        << "batch-size = 4\nsteps = 12\nlog-every = 6\neval-batches = 2\nthreads = 1\nwarmup-steps = 2\n";
  }
  Result one =
      mpirun(1, "train --config " + dir + "/gpt.ini --metrics " + dir + "/one.jsonl --checkpoint-dir " + dir + "/ckpt");
  Result two = mpirun(2, "train --config " + dir + "/gpt.ini --tp 2 --metrics " + dir + "/two.jsonl");
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_NE(one.out.find("val_bpb"), std::string::npos) << one.out;
  double l1 = last_val_loss(dir + "/one.jsonl"), l2 = last_val_loss(dir + "/two.jsonl");
  EXPECT_GT(l1, 0);
  EXPECT_NEAR(l1, l2, 1e-4 * l1) << one.out << two.out;
  Result gen = run("generate --checkpoint " + dir + "/ckpt --prompt 'a small' --tokens 20");
  ASSERT_EQ(gen.code, 0) << gen.out;
  EXPECT_EQ(gen.out.rfind("a small", 0), 0u) << gen.out;
  EXPECT_GE(gen.out.size(), 27u) << gen.out;
  // Weight-only int8: the four Linear layers of the block, a quarter of their bytes (plus scales),
  // and bits per byte within 2 % of fp32's on the validation stream.
  Result gen8 = run("generate --checkpoint " + dir + "/ckpt --prompt 'a small' --tokens 20 --int8");
  ASSERT_EQ(gen8.code, 0) << gen8.out;
  EXPECT_NE(gen8.out.find("int8 weights in 4 Linear layers"), std::string::npos) << gen8.out;
  Result ev = run("eval --checkpoint " + dir + "/ckpt --data " + dir + "/tok --batch-size 8 --int8");
  ASSERT_EQ(ev.code, 0) << ev.out;
  auto loss_of = [&](const std::string& what) {
    const std::string lead = what + " loss ";
    const size_t at = ev.out.find(lead);
    return at == std::string::npos ? -1.0 : std::stod(ev.out.substr(at + lead.size()));
  };
  const double l32 = loss_of("fp32 "), l8 = loss_of("int8 ");
  EXPECT_GT(l32, 1.0) << ev.out;
  EXPECT_NEAR(l8, l32, 0.02 * l32) << ev.out;
  EXPECT_NE(ev.out.find("in 4 Linear layers"), std::string::npos) << ev.out;
  EXPECT_FAILS_NAMING(run("eval --checkpoint " + dir + "/ckpt --data " + dir + "/text"), "val.h5");
  EXPECT_FAILS_NAMING(run("train --model gpt --data " + dir + "/none"), "none");
  // The progress bar with ETA (a terminal's default) for the GPT as for image models.
  Result bar = run("train --config " + dir + "/gpt.ini --progress on --log-every 3");
  ASSERT_EQ(bar.code, 0) << bar.out;
  EXPECT_NE(bar.out.find("] 12/12 loss "), std::string::npos) << bar.out;
  EXPECT_NE(bar.out.find(" ETA "), std::string::npos) << bar.out;
  fs::remove_all(dir);
}

// A Llama end to end: trained, exported under Hugging Face's names, a second run started from that
// export (--init-from) where the first ended; generation with cached keys and values gives the text
// of the recomputed window at temperature 0, past the context too, and top-p sampling of a tiny
// nucleus is greedy.
TEST(Cli, LlamaTrainExportInitFromAndCachedGeneration) {
  std::string dir = dtrain::test::temp_dir("cli-llama");
  ASSERT_EQ(small_text_tokens(dir, 800).code, 0);
  const std::string train = "train --model llama --data " + dir +
                            "/tok --layers 2 --heads 4 --kv-heads 2 --width 32 "
                            "--context 16 --batch-size 4 --eval-every 0 --threads 1 --progress off ";
  Result first = run(train + "--steps 30 --checkpoint-dir " + dir + "/ckpt --metrics " + dir + "/one.jsonl");
  ASSERT_EQ(first.code, 0) << first.out;
  Result exported = run("export --checkpoint " + dir + "/ckpt --out " + dir + "/llama.safetensors");
  ASSERT_EQ(exported.code, 0) << exported.out;
  Result again = run(train + "--init-from " + dir +
                     "/llama.safetensors --lr 1e-9 --warmup-steps 0 --steps 1 "
                     "--eval-batches 0 --metrics " +
                     dir + "/two.jsonl");
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("initialised 15 parameters from"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("(Hugging Face Llama names)"), std::string::npos) << again.out;
  Result ev = run("eval --checkpoint " + dir + "/ckpt --data " + dir + "/tok --batch-size 4");
  ASSERT_EQ(ev.code, 0) << ev.out;
  const double trained = std::stod(ev.out.substr(ev.out.find("fp32  loss ") + 11));
  EXPECT_NEAR(last_val_loss(dir + "/two.jsonl"), trained, 1e-4 * trained) << "the import starts where it ended";
  EXPECT_FAILS_NAMING(run(train + "--steps 1 --init-from " + dir + "/text/a.txt"), "a.txt");

  auto text = [](const Result& r) {  // the sample's line (stderr's line may come first)
    const size_t at = r.out.find("a small");
    return at == std::string::npos ? std::string() : r.out.substr(at, r.out.find('\n', at) - at);
  };
  const std::string gen = "generate --checkpoint " + dir + "/ckpt --prompt 'a small' --tokens 40 ";
  Result cached = run(gen + "--temperature 0");
  Result window = run(gen + "--temperature 0 --no-cache");
  ASSERT_EQ(cached.code, 0) << cached.out;
  ASSERT_EQ(window.code, 0) << window.out;
  EXPECT_EQ(text(cached), text(window));
  EXPECT_NE(cached.out.find("keys and values cached"), std::string::npos) << cached.out;
  EXPECT_GE(text(cached).size(), 47u) << cached.out;
  Result nucleus = run(gen + "--temperature 1 --top-p 0.000001");
  ASSERT_EQ(nucleus.code, 0) << nucleus.out;
  EXPECT_EQ(text(nucleus), text(cached));
  EXPECT_FAILS_NAMING(run(gen + "--top-p 0"), "--top-p");
  fs::remove_all(dir);
}

// The fused attention (the default) trains the Llama and the GPT for 20 steps to the losses of the
// materialised path (DTRAIN_ATTENTION=materialized) within 1e-5, and says which path ran.
TEST(Cli, FusedAttentionTrainsAsTheMaterialisedPath) {
  std::string dir = dtrain::test::temp_dir("cli-fused-attention");
  ASSERT_EQ(small_text_tokens(dir, 400).code, 0);
  const std::string args = " --data " + dir +
                           "/tok --steps 20 --log-every 1 --batch-size 4 --seq-len 80 --layers 2 --width 64 --heads 4 "
                           "--eval-every 0 --eval-batches 2 --threads 2 --progress off --metrics " + dir + "/";
  for (const std::string model : {"--model llama --kv-heads 2", "--model gpt"}) {
    Result fused = run("train " + model + args + "fused.jsonl");
    Result mat = shell("DTRAIN_ATTENTION=materialized " + std::string(DTRAIN_BINARY_DIR) + "/dtrain train " + model +
                       args + "mat.jsonl 2>&1");
    ASSERT_EQ(fused.code, 0) << fused.out;
    ASSERT_EQ(mat.code, 0) << mat.out;
    const auto a = step_losses(dir + "/fused.jsonl"), b = step_losses(dir + "/mat.jsonl");
    ASSERT_EQ(a.size(), 20u) << model;
    ASSERT_EQ(b.size(), 20u) << model;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(std::stod(a[i]), std::stod(b[i]), 1e-5) << model << " step " << i;
    EXPECT_NEAR(last_val_loss(dir + "/fused.jsonl"), last_val_loss(dir + "/mat.jsonl"), 1e-5) << model;
    EXPECT_NE(fused.out.find("attention fused"), std::string::npos) << fused.out;
    EXPECT_NE(mat.out.find("attention materialised"), std::string::npos) << mat.out;
    fs::remove(dir + "/fused.jsonl");
    fs::remove(dir + "/mat.jsonl");
  }
  fs::remove_all(dir);
}

// A checkpoint resumes only on data cut by its own tokenizer: bytes against a SentencePiece model of
// the same model vocabulary (--vocab 320) is refused with both named (exit 2); the same data resumes.
TEST(Cli, ResumeOnAnotherTokenizerIsRefused) {
  std::string dir = dtrain::test::temp_dir("cli-resume-tokenizer");
  fs::create_directories(dir + "/text");
  {
    std::ofstream out(dir + "/text/a.txt");
    const char* words[] = {"hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"};
    uint32_t x = 1;
    for (int i = 0; i < 6000; ++i) out << words[(x = x * 1103515245u + 12345u) >> 16 & 7] << (i % 9 ? " " : ", ");
  }
  ASSERT_EQ(run("convert text --inputs " + dir + "/text --out " + dir + "/bytes").code, 0);
  Result bpe = run("convert text --inputs " + dir + "/text --out " + dir + "/bpe --tokenizer bpe --vocab-size 320");
  ASSERT_EQ(bpe.code, 0) << bpe.out;
  const std::string train = "train --model gpt --layers 1 --width 32 --heads 2 --context 16 --batch-size 4 "
                            "--eval-every 0 --eval-batches 1 --threads 1 --progress off --vocab 320 ";
  ASSERT_EQ(run(train + "--steps 4 --data " + dir + "/bytes --checkpoint-dir " + dir + "/ckpt").code, 0);
  Result other = run(train + "--steps 6 --data " + dir + "/bpe --resume " + dir + "/ckpt");
  EXPECT_EQ(other.code, 2) << other.out;
  EXPECT_NE(other.out.find("its tokenizer (bytes) is not the one of --data " + dir + "/bpe (sentencepiece-bpe"),
            std::string::npos)
      << other.out;
  Result same = run(train + "--steps 6 --data " + dir + "/bytes --resume " + dir + "/ckpt");
  EXPECT_EQ(same.code, 0) << same.out;
  fs::remove_all(dir);
}

// A JSON text 100,000 arrays deep (here a fine-tuning record) ends the command with exit 2 and one
// error naming the file and line, before Boost's recursive parser could overflow the stack.
TEST(Cli, DeepJsonIsAnInputError) {
  std::string dir = dtrain::test::temp_dir("cli-deep-json");
  std::ofstream(dir + "/deep.jsonl") << R"({"prompt": "x", "completion": )" << std::string(100000, '[')
                                     << std::string(100000, ']') << "}\n";
  Result r = run("convert sft --inputs " + dir + "/deep.jsonl --out " + dir + "/tok");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("deep.jsonl' line 1 nests objects and arrays deeper than 64 levels"), std::string::npos)
      << r.out;
  fs::remove_all(dir);
}

// The LM head fused with its cross-entropy (the default) trains the Llama and the GPT for 20 steps,
// on one rank and cut into two pipeline stages, to the losses of the whole logits'
// (DTRAIN_LM_HEAD=materialized) within 1e-5, and `dtrain eval` gives the same loss.
TEST(Cli, FusedHeadTrainsAsTheMaterialisedHead) {
  std::string dir = dtrain::test::temp_dir("cli-fused-head");
  ASSERT_EQ(small_text_tokens(dir, 400).code, 0);
  const std::string args = " --data " + dir +
                           "/tok --steps 20 --log-every 1 --batch-size 4 --seq-len 80 --layers 2 --width 64 --heads 4 "
                           "--eval-every 10 --eval-batches 2 --threads 1 --progress off --checkpoint-dir " + dir +
                           "/ckpt --metrics " + dir + "/";
  const std::string mpi = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 mpiexec -n 2 "
                          "--oversubscribe --bind-to none ";
  const std::string materialized = "DTRAIN_LM_HEAD=materialized ";
  for (const std::string model : {"--model llama --kv-heads 2", "--model gpt", "--model llama --pp 2"}) {
    const std::string launch = model.find("--pp") != std::string::npos ? mpi : "";
    const std::string train = launch + std::string(DTRAIN_BINARY_DIR) + "/dtrain train " + model + args;
    Result fused = shell(train + "fused.jsonl 2>&1");
    ASSERT_EQ(fused.code, 0) << fused.out;
    Result eval_fused = run("eval --checkpoint " + dir + "/ckpt --data " + dir + "/tok --batch-size 3");
    fs::remove_all(dir + "/ckpt");
    Result mat = shell(materialized + train + "mat.jsonl 2>&1");
    ASSERT_EQ(mat.code, 0) << mat.out;
    Result eval_mat = shell(materialized + std::string(DTRAIN_BINARY_DIR) + "/dtrain eval --checkpoint " + dir +
                            "/ckpt --data " + dir + "/tok --batch-size 3 2>&1");
    fs::remove_all(dir + "/ckpt");
    const auto a = step_losses(dir + "/fused.jsonl"), b = step_losses(dir + "/mat.jsonl");
    ASSERT_EQ(a.size(), 20u) << model;
    ASSERT_EQ(b.size(), 20u) << model;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(std::stod(a[i]), std::stod(b[i]), 1e-5) << model << " step " << i;
    EXPECT_NEAR(last_val_loss(dir + "/fused.jsonl"), last_val_loss(dir + "/mat.jsonl"), 1e-5) << model;
    ASSERT_EQ(eval_fused.code, 0) << eval_fused.out;
    ASSERT_EQ(eval_mat.code, 0) << eval_mat.out;
    const auto figures = [](const std::string& out) {  // "loss ... over all N windows", not the time
      const size_t at = out.find("loss ");
      return at == std::string::npos ? out : out.substr(at, out.find(", forward", at) - at);
    };
    EXPECT_EQ(figures(eval_fused.out), figures(eval_mat.out)) << model;
    fs::remove(dir + "/fused.jsonl");
    fs::remove(dir + "/mat.jsonl");
  }
  fs::remove_all(dir);
}

// GPT-2's vocabulary (50257) at context 1024, batch 2: the whole logits, their probabilities and
// their gradient are 3 x 412 MB in f32, which a 1.5 GiB address-space cap (prlimit) refuses; the
// fused head holds one 64 MiB chunk of them and trains under it.
TEST(Cli, Vocab50257TrainsUnderACapTheMaterialisedHeadExceeds) {
  std::string dir = dtrain::test::temp_dir("cli-big-vocab");
  ASSERT_EQ(small_text_tokens(dir, 1500).code, 0);
  const std::string train = "prlimit --as=" + std::to_string(1536LL << 20) + " " + std::string(DTRAIN_BINARY_DIR) +
                            "/dtrain train --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --vocab 50257 "
                            "--context 1024 --batch-size 2 --steps 1 --eval-every 0 --eval-batches 1 --threads 2 "
                            "--progress off --data " + dir + "/tok 2>&1";
  Result fused = shell(train);
  ASSERT_EQ(fused.code, 0) << fused.out;
  EXPECT_NE(fused.out.find("val_loss"), std::string::npos) << fused.out;
  Result mat = shell("DTRAIN_LM_HEAD=materialized " + train);
  EXPECT_NE(mat.code, 0) << mat.out;
  EXPECT_NE(mat.out.find("out of host memory"), std::string::npos) << mat.out;
  fs::remove_all(dir);
}

// A context of 16384 tokens trains on one rank under a 2 GiB address-space cap (prlimit): the fused
// attention holds O(T) per head. The materialised path needs 4 GiB for one layer's probabilities
// ([4 heads, 16384, 16384] f32) and fails under the same cap.
TEST(Cli, Context16kTrainsUnderATwoGiBCapTheMaterialisedPathExceeds) {
  std::string dir = dtrain::test::temp_dir("cli-long-context");
  ASSERT_EQ(small_text_tokens(dir, 7000).code, 0);  // ~175K train and ~19K validation tokens
  const std::string train = std::string(DTRAIN_BINARY_DIR) +
                            "/dtrain train --model llama --layers 2 --width 128 --heads 4 --kv-heads 2 --context 16384 "
                            "--batch-size 1 --steps 1 --eval-every 0 --eval-batches 1 --threads 2 --progress off "
                            "--data " + dir + "/tok 2>&1";
  const std::string cap = "prlimit --as=" + std::to_string(2LL << 30) + " ";
  Result fused = shell(cap + train);
  ASSERT_EQ(fused.code, 0) << fused.out;
  EXPECT_NE(fused.out.find("done: 1 steps"), std::string::npos) << fused.out;
  EXPECT_NE(fused.out.find("val_loss"), std::string::npos) << fused.out;
  Result mat = shell("DTRAIN_ATTENTION=materialized " + cap + train);
  EXPECT_NE(mat.code, 0) << mat.out;
  fs::remove_all(dir);
}

// dtrain eval cuts a batch that would not fit in --memory-per-rank-mb into parts (the same loss,
// said once); where not even one window fits it stops with exit 2 naming the bytes.
TEST(Cli, EvalSplitsABatchThatWouldNotFit) {
  std::string dir = dtrain::test::temp_dir("cli-eval-fit");
  fs::create_directories(dir + "/text");
  {
    std::ofstream out(dir + "/text/a.txt");
    for (int i = 0; i < 3000; ++i) out << "a small text, " << i % 10 << " times over. ";
  }
  ASSERT_EQ(run("convert text --inputs " + dir + "/text --out " + dir + "/tok --val-fraction 0.5").code, 0);
  Result trained = run("train --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --context 4096 --batch-size 1 "
                       "--steps 1 --eval-every 0 --eval-batches 1 --threads 2 --progress off --data " +
                       dir + "/tok --checkpoint-dir " + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const std::string eval = "eval --checkpoint " + dir + "/ck --data " + dir + "/tok --threads 2 --batch-size 8 ";
  Result refused = run(eval + "--memory-per-rank-mb 1");
  EXPECT_EQ(refused.code, 2) << refused.out;
  const std::regex needs("evaluating one window of 4096 tokens needs ([0-9]+) MiB");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(refused.out, m, needs)) << refused.out;
  const int64_t per_window = std::stoll(m[1]);
  ASSERT_GE(per_window, 8) << refused.out;  // large against the ~100 MiB the process holds besides
  Result whole = run(eval);
  Result parts = run(eval + "--memory-per-rank-mb " + std::to_string(150 + 3 * per_window));
  ASSERT_EQ(whole.code, 0) << whole.out;
  ASSERT_EQ(parts.code, 0) << parts.out;
  EXPECT_NE(parts.out.find("windows at a time (the same loss)"), std::string::npos) << parts.out;
  EXPECT_EQ(whole.out.find("windows at a time"), std::string::npos) << whole.out;
  const auto loss = [](const Result& r) { return std::stod(r.out.substr(r.out.find("fp32  loss ") + 11)); };
  EXPECT_NEAR(loss(parts), loss(whole), 1e-4) << parts.out << whole.out;
  fs::remove_all(dir);
}

// Language models written as model files (examples/models/gpt2.json, llama.json) train exactly as
// --model gpt and --model llama of the same shape; a bad field or a shape option beside the file is
// named.
TEST(Cli, LanguageModelFilesEqualTheBuiltInModels) {
  std::string dir = dtrain::test::temp_dir("cli-lm-files");
  ASSERT_EQ(small_text_tokens(dir, 400).code, 0);
  const std::string models = std::string(DTRAIN_SOURCE_DIR) + "/examples/models/";
  const std::string run_args = " --data " + dir +
                               "/tok --steps 6 --batch-size 4 --seq-len 32 --eval-every 0 "
                               "--eval-batches 2 --threads 1 --progress off --metrics " +
                               dir + "/";
  for (auto [built_in, file] : {std::pair<std::string, std::string>{"--model gpt", "gpt2.json"},
                                {"--model llama --kv-heads 2 --mlp-width 352", "llama.json"}}) {
    Result a = run("train " + built_in + run_args + "a.jsonl");
    Result b = run("train --model-file " + models + file + run_args + "b.jsonl");
    ASSERT_EQ(a.code, 0) << a.out;
    ASSERT_EQ(b.code, 0) << b.out;
    EXPECT_GT(last_val_loss(dir + "/a.jsonl"), 0);
    EXPECT_EQ(last_val_loss(dir + "/a.jsonl"), last_val_loss(dir + "/b.jsonl")) << file;
    fs::remove(dir + "/a.jsonl");
    fs::remove(dir + "/b.jsonl");
  }
  EXPECT_FAILS_NAMING(run("train --model-file " + models + "llama.json --layers 2" + run_args + "c.jsonl"),
                      "option --layers does not combine with --model-file");
  {
    std::ofstream bad(dir + "/bad.json");
    bad << R"({"language_model": {"layers": 2, "width": 64, "heads": 4, "norm": "batch"}})";
  }
  EXPECT_FAILS_NAMING(run("train --model-file " + dir + "/bad.json" + run_args + "c.jsonl"), "language_model.norm");
  {
    std::ofstream bad(dir + "/extra.json");
    bad << R"({"language_model": {"layers": 2, "width": 64, "heads": 4, "experts": 8}})";
  }
  EXPECT_FAILS_NAMING(run("train --model-file " + dir + "/extra.json" + run_args + "c.jsonl"),
                      "language_model.experts is not a field");
  fs::remove_all(dir);
}

// bench lm-gemm records the GEMMs the model itself runs: for a Llama they are 3 x 2 x (the forward's
// multiply-adds per token), counted here by hand from the shape: per block q, k, v, o, gate, up,
// down and attention's two products over the window, then the head.
TEST(Cli, BenchLmGemmCountsTheModelsOwnGemms) {
  std::string dir = dtrain::test::temp_dir("cli-bench-lm-gemm");
  ASSERT_EQ(small_text_tokens(dir, 100).code, 0);
  const std::string shape =
      "--model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --context 16 --batch-size 2 --data " + dir + "/tok";
  const int64_t w = 64, hd = 16, qkv = (4 + 2 * 2) * hd, f = 192, t = 16, layers = 2, vocab = 256;
  // Fused attention's products are not GEMM calls; the materialised path adds them: 2 forward, 5
  // backward (the scores recomputed, then dP, dV, dQ, dK), each t * w multiply-adds a token.
  for (const bool fused : {true, false}) {
    Result r = shell(std::string(fused ? "" : "DTRAIN_ATTENTION=materialized ") + DTRAIN_BINARY_DIR +
                     "/dtrain bench lm-gemm " + shape + " --threads 1 2>&1");  // the vocabulary of the token files: bytes
    ASSERT_EQ(r.code, 0) << r.out;
    const int64_t macs = layers * (w * qkv + w * w + 3 * w * f) + vocab * w, attention = fused ? 0 : layers * 7 * t * w;
    char expect[64];
    std::snprintf(expect, sizeof expect, "(%.6g MFLOP per token), %d calls",
                  (6.0 * static_cast<double>(macs) + 2.0 * static_cast<double>(attention)) * 1e-6,
                  2 * (4 * 3 + (fused ? 0 : 7)) + 3);
    EXPECT_NE(r.out.find(expect), std::string::npos) << expect << "\n" << r.out;
    EXPECT_NE(r.out.find("the GEMM limit is "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(fused ? "attention fused" : "attention materialised"), std::string::npos) << r.out;
  }
  EXPECT_FAILS_NAMING(run("bench lm-gemm --model mlp --synthetic"), "--model must be gpt or llama");
  EXPECT_FAILS_NAMING(run("bench lm-gemm " + shape + " --precision bf16"), "--precision bf16");
  fs::remove_all(dir);
}

// A BPE vocabulary end to end: convert trains it and stores it in the token files, the GPT takes its
// size from them (vocabulary-parallel on 2 tp ranks, the same loss as one rank), the checkpoint
// carries it, so generate encodes a prompt with characters the text never had and eval reports
// bits per byte over the bytes the pieces stand for.
TEST(CliMpi, GptOnABpeVocabulary) {
  std::string dir = dtrain::test::temp_dir("cli-gpt-bpe");
  fs::create_directories(dir + "/text");
  {
    std::ofstream out(dir + "/text/a.txt");
    const char* words[] = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"};
    for (int i = 0; i < 3000; ++i) out << words[(i * 5) % 8] << (i % 9 == 8 ? "\n" : " ");
  }
  Result conv = run("convert text --inputs " + dir + "/text --out " + dir + "/tok --tokenizer bpe --vocab-size 300");
  ASSERT_EQ(conv.code, 0) << conv.out;
  EXPECT_NE(conv.out.find("tokenizer sentencepiece-bpe, vocabulary 300"), std::string::npos) << conv.out;
  {
    std::ofstream ini(dir + "/gpt.ini");
    ini << "model = gpt\ndata = " << dir << "/tok\nlayers = 1\nheads = 2\nwidth = 16\ncontext = 16\n"
        << "batch-size = 4\nsteps = 10\nlog-every = 5\neval-batches = 2\nthreads = 1\nwarmup-steps = 2\n";
  }
  Result one =
      mpirun(1, "train --config " + dir + "/gpt.ini --metrics " + dir + "/one.jsonl --checkpoint-dir " + dir + "/ckpt");
  Result two = mpirun(2, "train --config " + dir + "/gpt.ini --tp 2 --metrics " + dir + "/two.jsonl");
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_NE(one.out.find("vocab=300"), std::string::npos) << one.out;
  const double l1 = last_val_loss(dir + "/one.jsonl");
  EXPECT_GT(l1, 0);
  EXPECT_NEAR(l1, last_val_loss(dir + "/two.jsonl"), 1e-4 * l1) << one.out << two.out;
  Result gen = run("generate --checkpoint " + dir + "/ckpt --prompt 'gamma \xE2\x82\xAC' --tokens 12");
  ASSERT_EQ(gen.code, 0) << gen.out;
  EXPECT_EQ(gen.out.rfind("gamma \xE2\x82\xAC", 0), 0u) << gen.out;
  Result ev = run("eval --checkpoint " + dir + "/ckpt --data " + dir + "/tok --batch-size 8");
  ASSERT_EQ(ev.code, 0) << ev.out;
  EXPECT_NE(ev.out.find(" bits/byte"), std::string::npos) << ev.out;
  EXPECT_FAILS_NAMING(mpirun(1, "train --config " + dir + "/gpt.ini --vocab 256"), "need a vocabulary of 300");
  fs::remove_all(dir);
}

// --pp 2 from the command line: the same validation loss as one rank, a checkpoint in two parts
// (one per stage) that generate reads as one model, and clear errors for a bad pipeline layout.
TEST(CliMpi, GptPipelineTrainAndGenerateFromStageCheckpoints) {
  std::string dir = dtrain::test::temp_dir("cli-gpt-pp");
  ASSERT_EQ(small_text_tokens(dir, 800).code, 0);
  {
    std::ofstream ini(dir + "/gpt.ini");
    ini << "model = gpt\ndata = " << dir << "/tok\nlayers = 3\nheads = 2\nwidth = 16\ncontext = 16\n"
        << "batch-size = 4\nsteps = 8\nlog-every = 4\neval-batches = 2\nthreads = 1\nwarmup-steps = 2\n";
  }
  Result one = mpirun(1, "train --config " + dir + "/gpt.ini");
  Result two = mpirun(2, "train --config " + dir +
                             "/gpt.ini --pp 2 --schedule gpipe --micro-batches 2 "
                             "--checkpoint-dir " +
                             dir + "/ckpt");
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_NE(two.out.find("stage 1: blocks [2, 3)"), std::string::npos) << two.out;  // the head weighs in
  EXPECT_NE(two.out.find("measured bubble"), std::string::npos) << two.out;
  auto val_loss = [](const std::string& out) {
    auto p = out.rfind("val_loss ");
    return p == std::string::npos ? -1.0 : std::stod(out.substr(p + 9));
  };
  EXPECT_GT(val_loss(one.out), 0);
  EXPECT_NEAR(val_loss(one.out), val_loss(two.out), 1e-4) << one.out << two.out;
  EXPECT_TRUE(fs::exists(dir + "/ckpt/ckpt-step000000008.h5"));
  EXPECT_TRUE(fs::exists(dir + "/ckpt/ckpt-step000000008.stage1.h5"));
  Result gen = run("generate --checkpoint " + dir + "/ckpt --prompt 'a small' --tokens 20");
  ASSERT_EQ(gen.code, 0) << gen.out;
  EXPECT_EQ(gen.out.rfind("a small", 0), 0u) << gen.out;
  // A missing stage part is named.
  fs::remove(dir + "/ckpt/ckpt-step000000008.stage1.h5");
  EXPECT_FAILS_NAMING(run("generate --checkpoint " + dir + "/ckpt"), "ckpt-step000000008.stage1.h5");
  EXPECT_FAILS_NAMING(mpirun(2, "train --config " + dir + "/gpt.ini --pp 2 --micro-batches 3"), "--micro-batches");
  EXPECT_FAILS_NAMING(mpirun(2, "train --config " + dir + "/gpt.ini --pp 2 --pp-split 1,1"), "--pp-split");
  EXPECT_FAILS_NAMING(mpirun(2, "train --config " + dir + "/gpt.ini --pp 2 --schedule zigzag"), "--schedule");
  EXPECT_FAILS_NAMING(run("train --config " + dir + "/gpt.ini --device tpu"), "--device");
  if (dtrain::enable_cuda() == 0)  // without a GPU the option says so
    EXPECT_FAILS_NAMING(run("train --config " + dir + "/gpt.ini --device cuda"), "--device cuda");
  EXPECT_FAILS_NAMING(run("train --config " + dir + "/gpt.ini --comm nccl"), "--comm nccl");  // GPU memory only
  EXPECT_FAILS_NAMING(run("train --config " + dir + "/gpt.ini --comm gloo"), "--comm");
  fs::remove_all(dir);
}

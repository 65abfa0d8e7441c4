// dtrain eval --checkpoint FILE --data DIR: rebuilds the model the checkpoint describes and
// reports loss and accuracy on the dataset (samples split over the ranks, counts summed). With
// --int8 the fp32 model is quantized (calibrated on --calibration-data) and both are reported side
// by side with their forward throughput; an int8 checkpoint (dtrain quantize) runs in int8 only.
// A GPT checkpoint is evaluated on its text's validation stream (bits per byte), on rank 0; with
// --int8 beside its weight-only int8 form.
#include <boost/program_options.hpp>
#include <cmath>
#include <filesystem>
#include <iostream>

#include "commands.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/text.h"
#include "dtrain/nn/models.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/export.h"
#include "dtrain/train/lm_trainer.h"
#include "dtrain/train/options.h"
#include "dtrain/train/quantize.h"
#include "dtrain/train/trainer.h"

namespace po = boost::program_options;

namespace dtrain::cli {

namespace {

void check_dataset(const data::ShardedHdf5Dataset& ds, const std::string& dir, const Shape& input, int64_t classes,
                   const std::string& model, const std::string& path) {
  DT_INPUT_CHECK(ds.info().sample_shape == input, "dataset '" << dir << "' has samples of shape "
                                                              << shape_str(ds.info().sample_shape)
                                                              << " but checkpoint '" << path << "' holds a " << model
                                                              << " for inputs " << shape_str(input));
  DT_INPUT_CHECK(ds.info().num_classes <= classes,
                 "dataset '" << dir << "' has " << ds.info().num_classes << " classes, the model only " << classes);
}

void report(const char* what, const train::EvalResult& r, double forward_s) {
  std::printf("%-5s accuracy %.2f%%, loss %.4f, %lld samples, forward %.3f s, %.0f samples/s\n", what,
              100.0 * r.accuracy, r.loss, static_cast<long long>(r.samples), forward_s,
              forward_s > 0 ? r.samples / forward_s : 0.0);
}

// --save-batch: the first batch rank 0 evaluated, its inputs (as the model took them: normalised
// images, or token ids) and the model's logits, as safetensors, so another framework can check its
// predictions on the same batch (benchmarks/peers/check_export.py).
void save_batch(const std::string& path, const Tensor& inputs, const Tensor& logits) {
  train::write_safetensors(path, {{"inputs", inputs}, {"logits", logits}}, {{"format", "dtrain-batch-1"}});
}

// A GPT checkpoint on the validation stream of `data_dir` (dtrain convert text's val.h5), on rank 0:
// loss and bits per byte, and with `int8` the same with weight-only int8 Linear layers beside it.
void eval_gpt(const train::CheckpointState& s, const std::string& path, const std::string& data_dir, int64_t batch,
              bool int8, const std::string& batch_file, const train::MemoryBudget& budget) {
  const std::string val = (std::filesystem::path(data_dir) / "val.h5").string();
  DT_INPUT_CHECK(std::filesystem::is_regular_file(val), "checkpoint '" << path
                                                                       << "' holds a gpt: --data must be a "
                                                                          "folder of dtrain convert text with val.h5; '"
                                                                       << val << "' is missing");
  auto model = train::gpt_from_checkpoint(s);
  const int64_t ctx = model->config().context;
  const data::TokenStream stream = data::load_tokens(val);  // read once: the timings are forward passes only
  auto run = [&](const char* what) {
    // warm-up: oneDNN's primitives and buffers, outside the timing
    train::evaluate_lm(*model, stream, batch, ctx, 1, budget);
    const double t0 = now_s();
    const double nats = train::evaluate_lm(*model, stream, batch, ctx, 0, budget);
    const double t = now_s() - t0;
    const int64_t windows = train::scored_windows(stream, batch, ctx, 0);
    if (stream.has_samples()) {  // prompt/completion samples: per completion token (no bits per byte)
      std::printf("%-5s loss %.4f nats per completion token over all %lld samples, forward %.3f s\n", what, nats,
                  static_cast<long long>(windows), t);
      return std::pair{nats, t};
    }
    const double bpb = train::bits_per_byte(stream, nats, windows, ctx);
    std::printf("%-5s loss %.4f nats/token, %.4f bits/byte over all %lld windows, forward %.3f s\n", what, nats, bpb,
                static_cast<long long>(windows), t);
    return std::pair{bpb, t};
  };
  std::printf("eval %s (%s) on %s, windows of %lld, batch %lld (%d threads)\n", path.c_str(),
              model->config().llama() ? "llama" : "gpt", val.c_str(), static_cast<long long>(ctx),
              static_cast<long long>(batch), cpu_engine().threads());
  if (!batch_file.empty()) {  // the first `batch` windows of the stream, as evaluate_lm cuts them
    const int64_t rows = std::min(batch, data::window_count(stream, ctx));
    DT_INPUT_CHECK(rows > 0, "'" << val << "' holds no window of " << ctx + 1 << " tokens");
    const Tensor ids = data::sequential_windows(stream, rows, ctx, 0).ids;
    save_batch(batch_file, ids, model->forward(ids).clone());
  }
  const auto [bpb32, t32] = run("fp32");
  if (!int8) return;
  const nn::WeightOnlyReport w = nn::quantize_linear_weights_int8(*model);
  const auto [bpb8, t8] = run("int8");
  std::printf(
      "int8 weights (weight-only, per output row) in %lld Linear layers: %.2f MiB -> %.2f MiB; "
      "int8 - fp32: %+.4f bits/byte, forward speed-up %.2fx\n",
      static_cast<long long>(w.layers), w.f32_bytes / 1048576.0, w.int8_bytes / 1048576.0, bpb8 - bpb32,
      t8 > 0 ? t32 / t8 : 0.0);
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  std::string ckpt, data_dir, calib_dir;
  int64_t batch = 256, calib_batches = 10;
  double memory_mb = 0;
  int threads = 0;
  bool int8 = false;
  std::string batch_file;
  po::options_description opts("Options");
  opts.add_options()("checkpoint", po::value<std::string>(&ckpt), "checkpoint file, or a directory (its newest)")(
      "data", po::value<std::string>(&data_dir), "directory of HDF5 shards to evaluate on")(
      "batch-size", po::value<int64_t>(&batch)->default_value(256), "samples per batch per rank")(
      "memory-per-rank-mb", po::value<double>(&memory_mb)->default_value(0),
      "memory a rank may fill: a language model's batch that would not fit is evaluated in parts (0: the node's "
      "memory over its ranks)")(
      "threads", po::value<int>(&threads)->default_value(0), "compute threads per rank (0: cores / ranks on node)")(
      "int8", po::bool_switch(&int8),
      "also run the model quantized to int8 (CPU, oneDNN), side by side with fp32 (a gpt: weight-only int8)")(
      "calibration-batches", po::value<int64_t>(&calib_batches)->default_value(10),
      "with --int8: batches of --calibration-data that calibrate the activation ranges")(
      "calibration-data", po::value<std::string>(&calib_dir),
      "with --int8: directory of HDF5 shards to calibrate on (the training set; default --data)")(
      "save-batch", po::value<std::string>(&batch_file),
      "write the first batch's inputs (as the model takes them) and fp32 logits to this safetensors file");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain eval --checkpoint FILE --data DIR [options]", vm))
    return 0;
  DT_INPUT_CHECK(!ckpt.empty(), "option --checkpoint is required");
  DT_INPUT_CHECK(!data_dir.empty(), "option --data is required");
  DT_INPUT_CHECK(batch > 0, "option --batch-size must be > 0");
  DT_INPUT_CHECK(memory_mb >= 0, "option --memory-per-rank-mb must be >= 0, got " << memory_mb);
  comm::Runtime& rt = comm::Runtime::get();
  const comm::Topology& topo = rt.topology();
  cpu_engine().set_threads(topo.compute_threads(threads));
  comm::Communicator* world = topo.size > 1 ? &rt.world() : nullptr;

  std::string path = train::resolve_checkpoint(ckpt, "checkpoint");
  train::CheckpointState s = train::load_checkpoint_set(path);  // every pipeline stage's part
  if (train::is_language_model(s.strings["model"])) {
    if (topo.rank == 0)
      eval_gpt(s, path, data_dir, batch, int8, batch_file,
               train::memory_per_rank(memory_mb, Device::cpu(), topo.local_size));
    return 0;
  }
  auto ds = std::make_shared<data::ShardedHdf5Dataset>(data_dir);
  if (train::is_int8_checkpoint(s)) {  // quantized already: no fp32 model to compare with
    nn::Int8Spec spec = train::read_int8_fields(s, path);
    nn::Int8Model q(spec);
    check_dataset(*ds, data_dir, spec.input, q.classes(), s.strings["model"] + " (int8)", path);
    std::vector<float> mean, std;
    train::checkpoint_normalisation(s, mean, std);
    double t = 0;
    train::EvalResult r =
        train::evaluate_forward([&](const Tensor& x) { return q.forward(x); }, ds, batch, world, mean, std, &t);
    if (topo.rank == 0) {
      std::printf("eval %s (int8) on %s\n", path.c_str(), data_dir.c_str());
      report("int8", r, t);
    }
    return 0;
  }
  train::ImageCheckpoint c = train::image_model_from_checkpoint(path, s);
  check_dataset(*ds, data_dir, c.spec.input, c.spec.classes, c.spec.name, path);
  Tensor first_inputs, first_logits;
  auto fp32_forward = [&](const Tensor& x) {
    Tensor y = c.model->forward(x);
    if (!batch_file.empty() && !first_inputs.defined()) {
      first_inputs = x.clone();
      first_logits = y.clone();
    }
    return y;
  };
  if (!int8) {
    double t = 0;
    train::EvalResult r = train::evaluate_forward(fp32_forward, ds, batch, world, c.mean, c.std, &t);
    if (topo.rank == 0 && first_inputs.defined()) save_batch(batch_file, first_inputs, first_logits);
    if (topo.rank == 0) {
      std::printf("eval %s on %s (%d threads)\n", path.c_str(), data_dir.c_str(), cpu_engine().threads());
      report("fp32", r, t);
    }
    return 0;
  }
  auto calib = calib_dir.empty() ? ds : std::make_shared<data::ShardedHdf5Dataset>(calib_dir);
  if (!calib_dir.empty()) check_dataset(*calib, calib_dir, c.spec.input, c.spec.classes, c.spec.name, path);
  nn::Int8Model q(train::quantize_image_model(c, calib, batch, calib_batches));
  double t32 = 0, t8 = 0;
  train::EvalResult r32 = train::evaluate_forward(fp32_forward, ds, batch, world, c.mean, c.std, &t32);
  if (topo.rank == 0 && first_inputs.defined()) save_batch(batch_file, first_inputs, first_logits);
  train::EvalResult r8 =
      train::evaluate_forward([&](const Tensor& x) { return q.forward(x); }, ds, batch, world, c.mean, c.std, &t8);
  if (topo.rank == 0) {
    std::printf("eval %s on %s, int8 calibrated on %lld batches of %s (%d threads)\n", path.c_str(), data_dir.c_str(),
                static_cast<long long>(calib_batches), (calib_dir.empty() ? data_dir : calib_dir).c_str(),
                cpu_engine().threads());
    report("fp32", r32, t32);
    report("int8", r8, t8);
    std::printf("int8 - fp32: %+.2f points, forward speed-up %.2fx\n", 100.0 * (r8.accuracy - r32.accuracy),
                t8 > 0 ? t32 / t8 : 0.0);
  }
  return 0;
}

}  // namespace dtrain::cli

// dtrain quantize --checkpoint X --data D --out Y: post-training int8 quantization of an image
// classifier. Calibrates the activation ranges on the first --calibration-batches batches of D (the
// training set) and writes the int8 checkpoint Y (include/dtrain/train/quantize.h), which
// `dtrain eval --checkpoint Y` runs without calibrating again.
#include <boost/program_options.hpp>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/options.h"
#include "dtrain/train/quantize.h"
#include "dtrain/train/trainer.h"

namespace po = boost::program_options;

namespace dtrain::cli {

int cmd_quantize(int argc, char** argv) {
  std::string ckpt, data_dir, out;
  int64_t batch = 256, calib_batches = 10;
  int threads = 0;
  po::options_description opts("Options");
  opts.add_options()("checkpoint", po::value<std::string>(&ckpt), "fp32 checkpoint file, or a directory (its newest)")(
      "data", po::value<std::string>(&data_dir), "directory of HDF5 shards to calibrate on (the training set)")(
      "out", po::value<std::string>(&out), "the int8 checkpoint to write")(
      "calibration-batches", po::value<int64_t>(&calib_batches)->default_value(10), "batches that calibrate")(
      "batch-size", po::value<int64_t>(&batch)->default_value(256), "samples per calibration batch")(
      "threads", po::value<int>(&threads)->default_value(0), "compute threads (0: all cores)");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain quantize --checkpoint X --data DIR --out Y [options]",
                            vm))
    return 0;
  DT_INPUT_CHECK(!ckpt.empty(), "option --checkpoint is required");
  DT_INPUT_CHECK(!data_dir.empty(), "option --data is required");
  DT_INPUT_CHECK(!out.empty(), "option --out is required");
  DT_INPUT_CHECK(batch > 0, "option --batch-size must be > 0");
  const comm::Topology& topo = comm::Runtime::get().topology();
  cpu_engine().set_threads(topo.compute_threads(threads));
  const std::string path = train::resolve_checkpoint(ckpt, "checkpoint");
  train::CheckpointState s = train::load_checkpoint_set(path);
  DT_INPUT_CHECK(!train::is_int8_checkpoint(s), "checkpoint '" << path << "' is quantized already");
  train::ImageCheckpoint c = train::image_model_from_checkpoint(path, s);
  auto ds = std::make_shared<data::ShardedHdf5Dataset>(data_dir);
  DT_INPUT_CHECK(ds->info().sample_shape == c.spec.input, "dataset '" << data_dir << "' has samples of shape "
                                                                      << shape_str(ds->info().sample_shape)
                                                                      << ", the model takes " << shape_str(c.spec.input));
  nn::Int8Spec spec = train::quantize_image_model(c, ds, batch, calib_batches);
  train::save_checkpoint(out, train::int8_checkpoint(s, spec));
  std::printf("quantized %s (%s, %zu int8 steps) on %lld batches of %s -> %s\n", path.c_str(), c.spec.name.c_str(),
              spec.layers.size(), static_cast<long long>(calib_batches), data_dir.c_str(), out.c_str());
  return 0;
}

}  // namespace dtrain::cli

// dtrain eval --checkpoint FILE --data DIR: rebuilds the model the checkpoint describes and
// reports loss and accuracy on the dataset (samples split over the ranks, counts summed).
#include <boost/program_options.hpp>
#include <iostream>

#include "commands.h"
#include "dtrain/train/options.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/loader.h"
#include "dtrain/nn/models.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/trainer.h"

namespace po = boost::program_options;

namespace dtrain::cli {

int cmd_eval(int argc, char** argv) {
  std::string ckpt, data_dir;
  int64_t batch = 256;
  int threads = 0;
  po::options_description opts("Options");
  opts.add_options()("checkpoint", po::value<std::string>(&ckpt),
                                                  "checkpoint file, or a directory (its newest)")(
      "data", po::value<std::string>(&data_dir), "directory of HDF5 shards to evaluate on")(
      "batch-size", po::value<int64_t>(&batch)->default_value(256), "samples per batch per rank")(
      "threads", po::value<int>(&threads)->default_value(0), "compute threads per rank (0: cores / ranks on node)");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain eval --checkpoint FILE --data DIR [options]", vm)) return 0;
  DT_INPUT_CHECK(!ckpt.empty(), "option --checkpoint is required");
  DT_INPUT_CHECK(!data_dir.empty(), "option --data is required");
  DT_INPUT_CHECK(batch > 0, "option --batch-size must be > 0");
  comm::Runtime& rt = comm::Runtime::get();
  const comm::Topology& topo = rt.topology();
  cpu_engine().set_threads(threads > 0 ? threads : std::max(1, topo.threads_per_rank));

  std::string path = train::resolve_checkpoint(ckpt, "checkpoint");
  train::CheckpointState s = train::load_checkpoint_set(path);  // every pipeline stage's part
  auto ds = std::make_shared<data::ShardedHdf5Dataset>(data_dir);
  nn::ModelSpec spec;
  nn::ModulePtr model = train::image_model_from_checkpoint(s, path, &spec);
  DT_INPUT_CHECK(ds->info().sample_shape == spec.input,
                 "dataset '" << data_dir << "' has samples of shape " << shape_str(ds->info().sample_shape)
                             << " but checkpoint '" << path << "' holds a " << spec.name << " for inputs "
                             << shape_str(spec.input));
  DT_INPUT_CHECK(ds->info().num_classes <= spec.classes, "dataset '" << data_dir << "' has " << ds->info().num_classes
                                                                   << " classes, the model only " << spec.classes);

  std::vector<float> mean, std;  // the training set's normalisation, when the checkpoint has it
  if (s.tensors.count("meta/norm_mean") && s.tensors.count("meta/norm_std")) {
    const Tensor& m = s.tensors["meta/norm_mean"];
    const Tensor& d = s.tensors["meta/norm_std"];
    mean.assign(m.f32(), m.f32() + m.numel());
    std.assign(d.f32(), d.f32() + d.numel());
  }
  train::EvalResult r =
      train::evaluate_model(*model, ds, batch, true, topo.size > 1 ? &rt.world() : nullptr, mean, std);
  if (topo.rank == 0)
    std::printf("eval %s on %s: %lld samples, loss %.4f, accuracy %.2f%%\n", path.c_str(), data_dir.c_str(),
                static_cast<long long>(r.samples), r.loss, 100.0 * r.accuracy);
  return 0;
}

}  // namespace dtrain::cli

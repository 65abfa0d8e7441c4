// dtrain prune-export --checkpoint X --out Y: the model of a structurally pruned checkpoint with its
// pruned channels cut out (include/dtrain/nn/shrink.h). Y is a model-only checkpoint that `dtrain
// eval` and `dtrain quantize` read like any other. Before writing, both models run one batch of
// random inputs and the largest logit difference is printed; a difference beyond rounding stops it.
#include <boost/program_options.hpp>
#include <cmath>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/nn/shrink.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/options.h"
#include "dtrain/train/quantize.h"
#include "dtrain/train/trainer.h"

namespace po = boost::program_options;

namespace dtrain::cli {

namespace {

// max |a - b| and max |a| over the logits of both models on a batch of standard normal inputs.
std::pair<double, double> logit_gap(nn::Sequential& a, nn::Sequential& b, const Shape& input) {
  Shape shape{64};
  shape.insert(shape.end(), input.begin(), input.end());
  Tensor x = Tensor::empty(shape);
  Rng rng(2024);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
  const Tensor ya = a.forward(x).clone(), yb = b.forward(x);
  double gap = 0, most = 0;
  for (int64_t i = 0; i < ya.numel(); ++i) {
    gap = std::max(gap, static_cast<double>(std::fabs(ya.f32()[i] - yb.f32()[i])));
    most = std::max(most, static_cast<double>(std::fabs(ya.f32()[i])));
  }
  return {gap, most};
}

}  // namespace

int cmd_prune_export(int argc, char** argv) {
  std::string ckpt, out;
  po::options_description opts("Options");
  opts.add_options()("checkpoint", po::value<std::string>(&ckpt),
                     "checkpoint of a model pruned with --prune-structured (file, or a directory: its newest)")(
      "out", po::value<std::string>(&out), "the shrunk model's checkpoint to write");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain prune-export --checkpoint X --out Y", vm)) return 0;
  DT_INPUT_CHECK(!ckpt.empty(), "option --checkpoint is required");
  DT_INPUT_CHECK(!out.empty(), "option --out is required");
  const std::string path = train::resolve_checkpoint(ckpt, "checkpoint");
  train::CheckpointState s = train::load_checkpoint_set(path);
  DT_INPUT_CHECK(!train::is_int8_checkpoint(s), "checkpoint '" << path << "' is an int8 checkpoint: shrink its fp32 "
                                                               << "checkpoint, then quantize");
  train::ImageCheckpoint c = train::image_model_from_checkpoint(path, s);
  nn::ShrunkModel shrunk = nn::shrink_pruned_channels(*c.model, c.spec);
  const auto [gap, most] = logit_gap(*c.model, *shrunk.model, c.spec.input);
  DT_CHECK(gap <= 1e-4 * std::max(1.0, most), "prune-export: the shrunk model's logits differ by " << gap);
  const int64_t before = c.model->parameter_count(), after = shrunk.model->parameter_count();
  train::ImageCheckpoint small{shrunk.spec, std::move(shrunk.model), c.mean, c.std};
  train::save_checkpoint(out, train::image_model_checkpoint(small));
  std::printf("prune-export %s (%s) -> %s\n", path.c_str(), c.spec.name.c_str(), out.c_str());
  for (const std::string& l : shrunk.layers) std::printf("  layer %s\n", l.c_str());
  std::printf(
      "parameters %lld -> %lld (%.1f %%); largest logit difference on 64 random inputs %.3g (logits up to "
      "%.3g)\n",
      static_cast<long long>(before), static_cast<long long>(after),
      100.0 * static_cast<double>(after) / static_cast<double>(before), gap, most);
  return 0;
}

}  // namespace dtrain::cli

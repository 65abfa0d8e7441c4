#pragma once
// Trainer runs for the multi-rank tests: a configuration from `dtrain train`'s words over an image
// folder, the parameters and f32 buffers after training (read back through the engine, so a
// device's run is read without host access to its memory), and their comparison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "dtrain/comm/runtime.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/train/trainer.h"

namespace dtrain::test {

// `run` followed by `more`: a run's words with a variant's.
inline std::vector<std::string> with(std::vector<std::string> run, const std::vector<std::string>& more) {
  run.insert(run.end(), more.begin(), more.end());
  return run;
}

// `dtrain train --data DATA --threads 1 --progress off --steps STEPS --global-batch-size 16
// --lr-schedule constant ARGS...`
inline train::TrainConfig trainer_config(const std::string& data, int steps, std::vector<std::string> args) {
  std::vector<std::string> all = {
      "train",      "--data",        data,      "--threads",           "1",
      "--progress", "off",           "--steps", std::to_string(steps), "--global-batch-size",
      "16",         "--lr-schedule", "constant"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  train::TrainConfig c;
  train::parse_train_config(static_cast<int>(argv.size()), argv.data(), c);
  return c;
}

using ParamValues = std::map<std::string, std::vector<float>>;

// Trains c on `comm` (all c.steps steps; the parameters where --device put them) and returns every
// parameter and f32 buffer by name (buffers as "buffer:<name>").
inline ParamValues train_params(const train::TrainConfig& c, comm::Communicator& comm) {
  train::Trainer t(c, comm::Runtime::get(), &comm);
  EXPECT_EQ(t.run().steps, c.steps);
  parallel::WholeModel whole(t.data_parallel());  // ZeRO-3's units gathered
  ParamValues out;
  for (nn::Parameter* p : t.model().parameters()) {
    EXPECT_EQ(p->value.device().is_cpu(), c.device == "cpu") << p->name << " is on " << p->value.device().str();
    const Tensor v = to_host(p->value);
    out[p->name].assign(v.f32(), v.f32() + v.numel());
  }
  for (nn::Buffer* b : t.model().buffers())
    if (b->value.dtype() == DType::F32) {
      const Tensor v = to_host(b->value);
      out["buffer:" + b->name].assign(v.f32(), v.f32() + v.numel());
    }
  return out;
}

// Every parameter and buffer of `got` within `tolerance` of `want`'s, relative to max(1, |want|).
inline void expect_params_close(const ParamValues& got, const ParamValues& want, const std::string& what,
                                double tolerance = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name << " is missing";
    const std::vector<float>& g = got.at(name);
    ASSERT_EQ(g.size(), w.size()) << what << ": " << name;
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i)
      worst = std::max(worst, std::abs(double(g[i]) - w[i]) / std::max(1.0, std::abs(double(w[i]))));
    EXPECT_LE(worst, tolerance) << what << ": " << name << " differs by " << worst;
  }
}

}  // namespace dtrain::test

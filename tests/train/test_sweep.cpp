// The sweep's configurations: the grid of --sweep specs and --sweep-random's draws.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/train/sweep.h"

namespace dtrain::train {
namespace {

TEST(Sweep, GridVariesTheFirstSpecSlowest) {
  const std::vector<SweepPoint> g = sweep_grid({"lr=0.1,0.2", "--batch-size=8,16,32"});
  ASSERT_EQ(g.size(), 6u);
  EXPECT_EQ(g[0], (SweepPoint{{"lr", "0.1"}, {"batch-size", "8"}}));
  EXPECT_EQ(g[2], (SweepPoint{{"lr", "0.1"}, {"batch-size", "32"}}));
  EXPECT_EQ(g[3], (SweepPoint{{"lr", "0.2"}, {"batch-size", "8"}}));
  EXPECT_EQ(sweep_grid({}), std::vector<SweepPoint>{SweepPoint{}});
}

TEST(Sweep, BadSpecsAreNamed) {
  auto message = [](const std::vector<std::string>& specs, int random) {
    try {
      random ? sweep_random(specs, random, 1) : sweep_grid(specs);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"lr"}, 0).find("'lr' is not OPTION=V1,V2"), std::string::npos);
  EXPECT_NE(message({"lr=0.1", "lr=0.2"}, 0).find("gives lr twice"), std::string::npos);
  EXPECT_NE(message({"lr=0.1,"}, 0).find("empty value"), std::string::npos);
  EXPECT_NE(message({"lr=0.01:0.1"}, 0).find("a range (0.01:0.1) needs --sweep-random N"), std::string::npos);
  EXPECT_NE(message({"lr=0.1:0.01"}, 2).find("low end must be below its high end"), std::string::npos);
  EXPECT_NE(message({"lr=0:0.1:log"}, 2).find("a log range needs a positive low end"), std::string::npos);
  EXPECT_NE(message({"lr=0.1"}, 0).find("no error"), std::string::npos);
  EXPECT_NE(message({}, 3).find("needs --sweep specs"), std::string::npos);
}

TEST(Sweep, RandomDrawsAreSeededAndStayInTheirRanges) {
  const std::vector<std::string> specs = {"lr=1e-4:1e-1:log", "momentum=0.8:0.99", "batch-size=16:128",
                                          "optimizer=sgd,adamw", "model=mlp"};
  const std::vector<SweepPoint> a = sweep_random(specs, 300, 7);
  EXPECT_EQ(a, sweep_random(specs, 300, 7));
  EXPECT_NE(a, sweep_random(specs, 300, 8));
  EXPECT_EQ(sweep_random(specs, 3, 7), std::vector<SweepPoint>(a.begin(), a.begin() + 3));  // draw i is (seed, i)
  int below_1e3 = 0;
  std::set<std::string> optimizers, batches;
  for (const SweepPoint& p : a) {
    ASSERT_EQ(p.size(), 5u);
    const double lr = std::stod(p[0].second), momentum = std::stod(p[1].second);
    EXPECT_TRUE(lr >= 1e-4 * 0.9999 && lr <= 1e-1 * 1.0001) << lr;
    EXPECT_TRUE(momentum >= 0.8 && momentum <= 0.99) << momentum;
    below_1e3 += lr < 1e-3;
    const int batch = std::stoi(p[2].second);
    EXPECT_EQ(p[2].second, std::to_string(batch));  // integer ends: integer draws
    EXPECT_TRUE(batch >= 16 && batch <= 128) << batch;
    batches.insert(p[2].second);
    optimizers.insert(p[3].second);
    EXPECT_EQ(p[4].second, "mlp");
  }
  // Log-uniform: a third of the draws below 1e-3 (uniform would give 1 %).
  EXPECT_GT(below_1e3, 70);
  EXPECT_LT(below_1e3, 130);
  EXPECT_EQ(optimizers, (std::set<std::string>{"sgd", "adamw"}));
  EXPECT_GT(batches.size(), 50u);
}

TEST(Sweep, WithoutOptionsDropsBothSpellings) {
  const std::vector<std::string> args = {"train", "--lr", "0.1", "--seed=3", "--synthetic", "--model", "mlp"};
  EXPECT_EQ(without_options(args, {"lr", "seed", "synthetic"}), (std::vector<std::string>{"train", "--model", "mlp"}));
}

}  // namespace
}  // namespace dtrain::train

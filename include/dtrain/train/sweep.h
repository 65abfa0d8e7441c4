#pragma once
// Trainer groups: many trainings in one MPI job. `dtrain train --trainers K --sweep lr=0.01,0.1`
// splits the world into K groups of consecutive ranks (each a full dp x tp x pp grid of world/K
// ranks; with the launchers' block placement a group shares a node when it fits in one), and
// group g trains configurations g, g + K, ... of the sweep grid one after another with the one
// training loop, each with its own seed (--seed + its index), metrics file and checkpoints in
// <sweep-dir>/trainer-<i>/. A trainer that diverges or fails on bad input stops alone; the others
// go on. Rank 0 ranks them all in a summary (printed, and <sweep-dir>/summary.json). With
// --sweep-random N the configurations are N draws from the specs' lists and ranges instead.
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/runtime.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

// One configuration of a sweep: the options it sets, in the order of the --sweep specs.
using SweepPoint = std::vector<std::pair<std::string, std::string>>;

// Every combination of the --sweep specs ("lr=0.01,0.1"), the first spec varying slowest; no spec
// gives one empty point. Throws InputError naming a spec without "=", a value or its option twice.
std::vector<SweepPoint> sweep_grid(const std::vector<std::string>& specs);

// `count` configurations drawn from the specs (--sweep-random): each option's value is one of its
// list ("lr=0.01,0.1"), or drawn from its range: "LO:HI" uniform, "LO:HI:log" log-uniform, an
// integer when both ends are written as integers. Configuration i draws from (seed, i), so every
// rank draws the same. Throws InputError naming a bad spec or range.
std::vector<SweepPoint> sweep_random(const std::vector<std::string>& specs, int count, uint64_t seed);

// `args` without the options in `names` ("--lr 0.1" and "--lr=0.1" both go).
std::vector<std::string> without_options(const std::vector<std::string>& args, const std::vector<std::string>& names);

// How one trainer ended.
struct TrainerOutcome {
  int index = 0;
  SweepPoint point;
  std::string status = "not run";  // ok, diverged, failed (bad input), preempted
  std::string message;             // the error of a trainer that stopped
  double accuracy = 0, val_loss = 0, time_s = 0, units_per_s = 0;
  double time_to_target_s = -1;  // training seconds to --target-accuracy (-1: not reached, or no target)
  int64_t steps = 0;
};

// `dtrain train` with --trainers or --sweep (argv as cmd_train got it, argv[0] "train"). Returns
// the exit status: 0 when every trainer finished; else that of the first one that did not (2 bad
// input, 3 divergence, 42 preempted: rerunning the command resumes the unfinished trainers from
// their checkpoints and keeps the finished ones' results).
int run_trainer_groups(int argc, char** argv, const TrainConfig& cfg, comm::Runtime& rt);

}  // namespace dtrain::train

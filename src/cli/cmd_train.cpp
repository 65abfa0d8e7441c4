#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/trainer.h"

namespace dtrain::cli {

int cmd_train(int argc, char** argv) {
  if (wants_lm_training(argc, argv)) return cmd_train_lm(argc, argv);
  train::TrainConfig cfg;
  if (!train::parse_train_config(argc, argv, cfg)) return 0;
  // Around the whole command: a signal during set-up stops the run at its first step, one after
  // the last step no longer kills a finished run.
  train::PreemptionGuard preemption(train::parse_signal_list(cfg.preempt_signals, "preempt-signals"));
  comm::Runtime& rt = comm::Runtime::get();
  if (rt.topology().rank == 0) std::printf("%s", rt.topology_table().c_str());
  else rt.topology_table();  // collective: every rank takes part
  train::Trainer trainer(cfg, rt);
  // A preempted run has written its checkpoint; the job scripts requeue on this exit code.
  return trainer.run().preempted_by != 0 ? kExitPreempted : kExitDone;
}

}  // namespace dtrain::cli

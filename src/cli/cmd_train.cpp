// dtrain train: one configuration and one loop for every model; the model decides the task (image
// classifier or the GPT).
#include <cstdio>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/sweep.h"
#include "dtrain/train/trainer.h"

namespace dtrain::cli {

int cmd_train(int argc, char** argv) {
  train::TrainConfig cfg;
  if (!train::parse_train_config(argc, argv, cfg)) return kExitDone;
  comm::Runtime& rt = comm::Runtime::get();
  if (cfg.print_config) {
    if (rt.topology().rank == 0) std::printf("%s", train::config_ini(cfg).c_str());
    return kExitDone;
  }
  // From here to the end of the process (never destroyed; reachable, so no leak): a signal during
  // set-up stops the run at its first step, and one after the last step, or during MPI's finalize,
  // no longer kills a rank that has finished or checkpointed. That late signal happens: srun
  // forwards SIGUSR1 to another node's tasks after the first node's ranks may have agreed on the
  // preemption through the first copies, and a rank dead of it turned a requeue into a failed job.
  static const train::PreemptionGuard* const preemption =
      new train::PreemptionGuard(train::parse_signal_list(cfg.preempt_signals, "preempt-signals"));
  (void)preemption;
  if (rt.topology().rank == 0) std::printf("%s", rt.topology_table().c_str());
  else rt.topology_table();  // collective: every rank takes part
  if (cfg.trainers > 1 || !cfg.sweep.empty()) return train::run_trainer_groups(argc, argv, cfg, rt);
  // A preempted run has written its checkpoint; the job scripts requeue on this exit status.
  const int preempted_by = train::Trainer(cfg, rt).run().preempted_by;
  return preempted_by != 0 ? kExitPreempted : kExitDone;
}

}  // namespace dtrain::cli

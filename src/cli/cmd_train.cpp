#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/train/trainer.h"

namespace dtrain::cli {

int cmd_train(int argc, char** argv) {
  train::TrainConfig cfg;
  if (!train::parse_train_config(argc, argv, cfg)) return 0;
  comm::Runtime& rt = comm::Runtime::get();
  if (rt.topology().rank == 0) std::printf("%s", rt.topology_table().c_str());
  else rt.topology_table();  // collective: every rank takes part
  train::Trainer trainer(cfg, rt);
  trainer.run();
  return 0;
}

}  // namespace dtrain::cli

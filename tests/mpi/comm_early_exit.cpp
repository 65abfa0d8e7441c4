// One rank leaves early: the last rank does two allreduces, then finalises and exits; the others
// go on to a third. They must end within DTRAIN_COMM_TIMEOUT (set short by the test) with a
// message naming the missing rank, and the job must exit non-zero. Checked by expect_abort.cmake.
// With the argument `create` the last rank never comes to the creation of a communicator (it
// sleeps): the others end the job at the phase's deadline, naming the communicator.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/runtime.h"

int main(int argc, char** argv) {
  using namespace dtrain::comm;
  Runtime& rt = Runtime::init(&argc, &argv);
  Communicator& world = rt.world();
  const int last = world.size() - 1;
  if (argc > 1 && std::strcmp(argv[1], "create") == 0) {
    if (world.rank() == last) std::this_thread::sleep_for(std::chrono::seconds(120));
    auto late = make_mpi_communicator(MPI_COMM_WORLD, "late");
    std::fprintf(stderr, "rank %d: made '%s', which must not happen\n", world.rank(), late->name().c_str());
    Runtime::finalize();
    return 0;
  }
  dtrain::Tensor t = dtrain::Tensor::full({1 << 16}, 1.0f);
  for (int step = 0; step < 5; ++step) {
    if (world.rank() == last && step == 2) {
      std::fprintf(stderr, "rank %d: leaving early after 2 allreduces\n", last);
      Runtime::finalize();
      return 0;
    }
    world.allreduce(t, ReduceOp::Sum)->wait();  // default timeout and action: abort the job
  }
  std::fprintf(stderr, "rank %d: all steps done, which must not happen\n", world.rank());
  Runtime::finalize();
  return 0;
}

#pragma once
// A deadline for the blocking MPI phases that no communicator's timeout covers: start-up (MPI_Init
// and the bootstrap's collectives), a control channel's set-up, creating and freeing shared windows,
// and shutdown. A rank whose phase has not finished within DTRAIN_COMM_TIMEOUT seconds (0: none)
// says which phase it was in and ends the job, instead of waiting forever for a rank that never
// started or is gone.
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace dtrain::comm::detail {

class PhaseDeadline {
 public:
  // How a rank whose phase ran out ends: the whole job through MPI_Abort, or only this process
  // while MPI_Init itself has not returned (MPI may not be called then; the launcher ends the rest).
  enum class Ending { abort_job, exit_process };

  explicit PhaseDeadline(std::string phase, Ending ending = Ending::abort_job);
  PhaseDeadline(std::string phase, double seconds, Ending ending);
  ~PhaseDeadline();  // the phase finished: the watcher stops
  PhaseDeadline(const PhaseDeadline&) = delete;
  PhaseDeadline& operator=(const PhaseDeadline&) = delete;

 private:
  void watch(std::string phase, double seconds, Ending ending);

  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::thread watcher_;
};

}  // namespace dtrain::comm::detail

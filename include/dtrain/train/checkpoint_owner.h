#pragma once
// One writer per checkpoint folder. The run that writes --checkpoint-dir owns it for its life
// through DIR/.dtrain-owner: its run id, host, pid, job and launch (written by world rank 0), held with an
// advisory lock (flock) and a lease the owner renews every kOwnerRenewS seconds (the file's
// modification time). A second run on the folder is refused with both named: its start would
// remove the first's unfinished writes, its pruning the first's sets, either would resume the
// other's. An owner that is gone is taken over, with a message:
//   - its lock is free and its pid is not alive on this host (a killed run on this host);
//   - it is an earlier launch of this job (the job scripts run their launches one after another
//     and count them in DTRAIN_LAUNCH: a relaunch after a lost node, a requeue);
//   - on another host, its lease was last renewed more than kOwnerLeaseS seconds ago.
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace dtrain::train {

inline constexpr int kOwnerRenewS = 30;
inline constexpr int kOwnerLeaseS = 300;

// Who holds a folder, as DIR/.dtrain-owner says it ("key value" lines).
struct FolderOwnerRecord {
  int64_t run_id = 0;
  std::string host, job, launch;  // job: SLURM_JOB_ID or PBS_JOBID; launch: DTRAIN_LAUNCH ("" outside a job script)
  int64_t pid = 0;
  std::string text() const;  // "run 123 (host h, pid 9, job 77, launch 0.1)"
};

class FolderOwner {
 public:
  // Takes `dir` (made when missing) for run `run_id`. InputError naming both runs and the folder
  // when a live run holds it.
  FolderOwner(const std::string& dir, int64_t run_id);
  ~FolderOwner();  // the owner file is emptied (when it is still this run's), the lock released
  FolderOwner(const FolderOwner&) = delete;
  FolderOwner& operator=(const FolderOwner&) = delete;

  // "took over checkpoint folder DIR from <owner> (why)" when a gone owner was replaced, else "".
  const std::string& note() const { return note_; }
  static std::string file_of(const std::string& dir);  // DIR/.dtrain-owner
  static FolderOwnerRecord read(const std::string& file);  // run_id 0: a missing or empty file (no owner)
  static void write(const std::string& file, const FolderOwnerRecord& r);  // as a run would (tests)

 private:
  // Why the recorded owner is gone ("" while it may be alive). `locked`: this process got the lock.
  std::string why_gone(const FolderOwnerRecord& old, bool locked) const;
  void renew();  // the lease, until the destructor

  std::string file_, note_;
  FolderOwnerRecord me_;
  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread renewer_;
};

}  // namespace dtrain::train

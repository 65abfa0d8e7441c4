#include "dtrain/train/checkpoint_owner.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "dtrain/core/env.h"
#include "dtrain/core/error.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

std::string this_host() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool pid_alive(int64_t pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

}  // namespace

std::string FolderOwnerRecord::text() const {
  std::string s = "run " + std::to_string(run_id) + " (host " + host + ", pid " + std::to_string(pid);
  if (!job.empty()) s += ", job " + job;
  if (!launch.empty()) s += ", launch " + launch;
  return s + ")";
}

std::string FolderOwner::file_of(const std::string& dir) { return (fs::path(dir) / ".dtrain-owner").string(); }

FolderOwnerRecord FolderOwner::read(const std::string& file) {
  FolderOwnerRecord r;
  std::ifstream in(file);
  for (std::string key, value; in >> key && std::getline(in >> std::ws, value);) {
    if (key == "run_id") r.run_id = std::strtoll(value.c_str(), nullptr, 10);
    if (key == "pid") r.pid = std::strtoll(value.c_str(), nullptr, 10);
    if (key == "host") r.host = value;
    if (key == "job") r.job = value;
    if (key == "launch") r.launch = value;
  }
  return r;
}

void FolderOwner::write(const std::string& file, const FolderOwnerRecord& r) {
  std::ofstream out(file, std::ios::trunc);
  out << "run_id " << r.run_id << "\nhost " << r.host << "\npid " << r.pid << "\n";
  if (!r.job.empty()) out << "job " << r.job << "\n";
  if (!r.launch.empty()) out << "launch " << r.launch << "\n";
  DT_INPUT_CHECK(out.flush(), "cannot write the checkpoint folder's owner file '" << file << "'");
}

FolderOwner::FolderOwner(const std::string& dir, int64_t run_id) : file_(file_of(dir)) {
  const std::string slurm_job = env_or_empty("SLURM_JOB_ID");
  me_ = {run_id, this_host(), slurm_job.empty() ? env_or_empty("PBS_JOBID") : slurm_job, env::get("DTRAIN_LAUNCH"),
         static_cast<int64_t>(::getpid())};
  std::error_code ec;
  fs::create_directories(dir, ec);
  fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DT_INPUT_CHECK(fd_ >= 0, "option --checkpoint-dir: cannot open '" << file_ << "': " << std::strerror(errno));
  // A file system without flock (some NFS and Lustre mounts) leaves the record and the lease. An
  // earlier launch of this job is gone even while its lock lingers (a lost node's, until the file
  // system's lease on it runs out; a rank 0 still tearing down).
  const bool locked = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
  const bool held = !locked && errno == EWOULDBLOCK;
  const FolderOwnerRecord old = read(file_);
  const bool relaunch = old.run_id != 0 && !old.job.empty() && old.job == me_.job && old.launch != me_.launch;
  const std::string gone =
      relaunch ? "an earlier launch of job " + old.job : held || old.run_id == 0 ? "" : why_gone(old, locked);
  if ((held && !relaunch) || (old.run_id != 0 && gone.empty())) {
    ::close(fd_);
    fd_ = -1;
    throw InputError("option --checkpoint-dir '" + dir + "' belongs to " + (old.run_id ? old.text() : "another run") +
                     ", which is still running (" + (held ? "it holds the folder's lock" : "its lease is fresh") +
                     "); this run, " + me_.text() + ", would destroy its checkpoint sets: give another " +
                     "--checkpoint-dir or stop that run (" + file_ + " names the owner)");
  }
  if (!gone.empty()) note_ = "took over checkpoint folder " + dir + " from " + old.text() + " (" + gone + ")";
  try {
    write(file_, me_);
    renewer_ = std::thread([this] { renew(); });
  } catch (...) {
    ::close(fd_);  // the lock with it: the folder stays free for another run of this process
    throw;
  }
}

std::string FolderOwner::why_gone(const FolderOwnerRecord& old, bool locked) const {
  if (old.host == me_.host && (locked || !pid_alive(old.pid)))
    return locked ? "its lock is free: it ended" : "its pid is not alive";
  struct stat st {};
  if (::fstat(fd_, &st) == 0 && std::time(nullptr) - st.st_mtime > kOwnerLeaseS)
    return "its lease was last renewed " + std::to_string(std::time(nullptr) - st.st_mtime) + " s ago";
  return "";
}

void FolderOwner::renew() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::seconds(kOwnerRenewS), [this] { return stop_; }))
    ::futimens(fd_, nullptr);  // the lease: now
}

FolderOwner::~FolderOwner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  // Emptied, not removed (a run opening it now would lock a file no longer in the folder), and only
  // when it is still this run's (another may have taken a lapsed lease over meanwhile).
  if (read(file_).run_id == me_.run_id && ::ftruncate(fd_, 0) != 0) {
  }
  ::close(fd_);
}

}  // namespace dtrain::train

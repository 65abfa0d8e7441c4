#include "control/forensics.h"

#include <dirent.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

// With gcc's libbacktrace (found by cmake/Dependencies.cmake) frames are named from the symbol
// table, static functions of the executable included, with file:line where there is debug info;
// otherwise from the dynamic symbols (dladdr).
#if defined(DTRAIN_STACKTRACE_BACKTRACE)
#define BOOST_STACKTRACE_USE_BACKTRACE
#endif
#include <boost/stacktrace.hpp>

#include "control/flight_recorder.h"
#include "dtrain/comm/forensics.h"
#include "dtrain/comm/runtime.h"

namespace dtrain::comm {
namespace {
std::mutex& run_dir_mu() {
  static auto* m = new std::mutex;  // leaked: a timeout may write during exit
  return *m;
}
std::string& run_dir_value() {
  static auto* d = new std::string(".");
  return *d;
}
}  // namespace

void set_run_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(run_dir_mu());
  run_dir_value() = dir.empty() ? "." : dir;
}

std::string run_dir() {
  std::lock_guard<std::mutex> lock(run_dir_mu());
  return run_dir_value();
}

namespace detail {
namespace {

using Frame = boost::stacktrace::frame::native_frame_ptr_t;
constexpr int kMaxThreads = 512;
constexpr int kMaxFrames = 64;

// One slot per thread to capture; the signal handler touches nothing else.
struct ThreadSlot {
  std::atomic<pid_t> tid{0};
  std::atomic<int> frames{-1};  // -1 until the thread has written its stack
  Frame pc[kMaxFrames];
};
ThreadSlot g_slots[kMaxThreads];
std::atomic<int> g_slot_count{0};

// glibc keeps the first real-time signals for itself (SIGRTMIN accounts for them); neither MPI,
// CUDA nor the trainer's preemption signals use this one.
int capture_signal() { return SIGRTMIN + 4; }

pid_t this_tid() { return static_cast<pid_t>(syscall(SYS_gettid)); }

// Stores the calling thread's stack in its slot, without the `skip` innermost frames. Runs in the
// signal handler: atomics, a table lookup and the unwinder only.
void capture_this_thread(size_t skip) {
  const pid_t tid = this_tid();
  const int n = g_slot_count.load();
  for (int i = 0; i < n; ++i)
    if (g_slots[i].tid.load() == tid) {
      const size_t got = boost::stacktrace::safe_dump_to(skip, g_slots[i].pc, sizeof g_slots[i].pc);
      g_slots[i].frames.store(static_cast<int>(got));
      return;
    }
}

void on_capture_signal(int) {
  const int saved = errno;
  capture_this_thread(2);  // the handler and the kernel's signal trampoline
  errno = saved;
}

std::vector<pid_t> task_ids() {
  std::vector<pid_t> ids;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d))
      if (const int id = std::atoi(e->d_name); id > 0) ids.push_back(id);
    closedir(d);
  }
  return ids;
}

std::string thread_name(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

std::string clock_now() {
  const time_t t = std::time(nullptr);
  tm parts{};
  localtime_r(&t, &parts);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", &parts);
  return buf;
}

}  // namespace

std::string thread_backtraces() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_handler = on_capture_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(capture_signal(), &sa, nullptr);  // stays installed: a late signal must find it
  });
  const std::vector<pid_t> tids = task_ids();
  const pid_t self = this_tid();
  const int n = std::min(static_cast<int>(tids.size()), kMaxThreads);
  g_slot_count.store(0);
  for (int i = 0; i < n; ++i) {
    g_slots[i].frames.store(-1);
    g_slots[i].tid.store(tids[static_cast<size_t>(i)]);
  }
  g_slot_count.store(n);
  capture_this_thread(0);  // this thread first: it also loads the unwinder before a handler needs it
  for (int i = 0; i < n; ++i)
    if (tids[static_cast<size_t>(i)] != self)
      syscall(SYS_tgkill, getpid(), tids[static_cast<size_t>(i)], capture_signal());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  auto all_in = [n] {
    for (int i = 0; i < n; ++i)
      if (g_slots[i].frames.load() < 0) return false;
    return true;
  };
  while (!all_in() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::ostringstream os;
  os << tids.size() << " threads"
     << (static_cast<int>(tids.size()) > n ? " (the first " + std::to_string(n) + " shown)" : "") << "\n";
  for (int i = 0; i < n; ++i) {
    const ThreadSlot& s = g_slots[i];
    os << "\nthread " << s.tid.load() << " '" << thread_name(s.tid.load()) << "'"
       << (s.tid.load() == self ? " (the one writing this file)" : "") << "\n";
    const int frames = s.frames.load();
    if (frames < 0)
      os << "  (no stack: the thread did not answer the capture signal within 1 s; it blocks signals)\n";
    else
      os << boost::stacktrace::to_string(boost::stacktrace::stacktrace::from_dump(s.pc, sizeof(Frame) * frames));
  }
  return os.str();
}

std::string write_hang_forensics(const std::string& reason) {
  static auto* mu = new std::mutex;  // leaked: may run during exit
  static bool written = false;
  static std::string path;
  std::lock_guard<std::mutex> lock(*mu);
  if (written) return path;
  written = true;
  const bool rt = Runtime::initialized();
  const int rank = rt ? Runtime::get().topology().rank : 0;
  const std::filesystem::path dir(run_dir());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string file = (dir / ("hang-rank" + std::to_string(rank) + ".txt")).string();
  std::ofstream out(file);
  out << "dtrain hang forensics: world rank " << rank << (rt ? " on " + Runtime::get().topology().host : "") << ", pid "
      << getpid() << ", " << clock_now() << "\n"
      << "reason: " << reason << "\n\n== flight recorders: each communicator's last collectives, oldest first ==\n";
  for (const auto& r : live_flight_recorders()) r->write(out);
  out << "\n== threads: ";
  out << thread_backtraces();
  out.close();
  if (out)
    path = file;
  else
    std::fprintf(stderr, "dtrain: rank %d could not write its hang forensics to %s\n", rank, file.c_str());
  return path;
}

}  // namespace detail
}  // namespace dtrain::comm

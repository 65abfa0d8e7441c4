#include "dtrain/train/signals.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "dtrain/core/error.h"

namespace dtrain::train {

namespace {

// Written by the handler (on the signal thread where dtrain's main set one up), read by the step
// loop: a lock-free atomic is safe in a handler and between threads.
std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free);
int g_active = 0;  // guards alive (the CLI's around the whole command, the trainer's around its loop)

extern "C" void on_preemption_signal(int sig) {
  int none = 0;
  g_received.compare_exchange_strong(none, sig);
}

struct NamedSignal {
  const char* name;
  int number;
};
constexpr NamedSignal kSignals[] = {{"TERM", SIGTERM}, {"USR1", SIGUSR1}, {"USR2", SIGUSR2},
                                    {"INT", SIGINT},   {"HUP", SIGHUP},   {"CONT", SIGCONT}};

}  // namespace

PreemptionGuard::PreemptionGuard(const std::vector<int>& signals) : signals_(signals) {
  if (g_active++ == 0) g_received = 0;  // a guard inside another keeps what the outer one saw
  for (int sig : signals_) {
    struct sigaction act {};
    act.sa_handler = on_preemption_signal;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;  // MPI and file calls in flight carry on; the loop checks between steps
    auto* old = new struct sigaction();
    sigaction(sig, &act, old);
    previous_.push_back(old);
  }
}

PreemptionGuard::~PreemptionGuard() {
  --g_active;
  for (size_t i = 0; i < signals_.size(); ++i) {
    auto* old = static_cast<struct sigaction*>(previous_[i]);
    sigaction(signals_[i], old, nullptr);
    delete old;
  }
}

void take_preemption_signals_on_own_thread() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t set;
    sigemptyset(&set);
    for (const NamedSignal& s : kSignals) sigaddset(&set, s.number);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);  // this thread, and every thread it starts from now on
    std::thread([set] {
      pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
      for (;;) pause();  // the handler (or the default action: end the process) runs here
    }).detach();
  });
}

int PreemptionGuard::received() { return g_received; }
void PreemptionGuard::clear() { g_received = 0; }

int agree_on_preemption(comm::Communicator* comm) {
  Tensor flag = Tensor::from({1}, {static_cast<float>(PreemptionGuard::received())});
  if (comm && comm->size() > 1) comm->allreduce(flag, comm::ReduceOp::Max)->wait();
  return static_cast<int>(flag.f32()[0]);
}

std::vector<int> parse_signal_list(const std::string& list, const std::string& option) {
  std::vector<int> out;
  if (list.empty() || list == "none") return out;
  std::stringstream ss(list);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    std::string name = tok.rfind("SIG", 0) == 0 ? tok.substr(3) : tok;
    int found = 0;
    for (const NamedSignal& s : kSignals)
      if (name == s.name) found = s.number;
    DT_INPUT_CHECK(found != 0, "option --" << option << ": '" << tok
                                           << "' is not one of TERM, USR1, USR2, INT, HUP, CONT (or none)");
    out.push_back(found);
  }
  return out;
}

std::string signal_name(int sig) {
  for (const NamedSignal& s : kSignals)
    if (s.number == sig) return std::string("SIG") + s.name;
  return "signal " + std::to_string(sig);
}

}  // namespace dtrain::train

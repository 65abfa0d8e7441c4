// The preemption signal module: signal lists, and a guard that records a signal and restores the
// previous handler. The multi-rank agreement is tested end to end by preempt_mpirun.sh.
#include <gtest/gtest.h>

#include <pthread.h>
#include <unistd.h>

#include <csignal>

#include "dtrain/core/error.h"
#include "dtrain/train/signals.h"

using namespace dtrain;
using namespace dtrain::train;

TEST(Signals, ParsesLists) {
  EXPECT_EQ(parse_signal_list("TERM,USR1", "preempt-signals"), (std::vector<int>{SIGTERM, SIGUSR1}));
  EXPECT_EQ(parse_signal_list("SIGUSR2", "preempt-signals"), (std::vector<int>{SIGUSR2}));
  EXPECT_TRUE(parse_signal_list("none", "preempt-signals").empty());
  EXPECT_TRUE(parse_signal_list("", "preempt-signals").empty());
  EXPECT_THROW(parse_signal_list("TERM,KILL", "preempt-signals"), InputError);
  try {
    parse_signal_list("BOGUS", "preempt-signals");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--preempt-signals"), std::string::npos) << e.what();
  }
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
}

static volatile std::sig_atomic_t g_outer = 0;
extern "C" void outer_handler(int sig) { g_outer = sig; }

TEST(Signals, GuardRecordsTheFirstSignalAndRestoresThePreviousHandler) {
  std::signal(SIGUSR2, outer_handler);
  {
    PreemptionGuard guard({SIGUSR1, SIGUSR2});
    EXPECT_EQ(PreemptionGuard::received(), 0);
    std::raise(SIGUSR2);
    std::raise(SIGUSR1);
    EXPECT_EQ(PreemptionGuard::received(), SIGUSR2);  // the first one wins
    EXPECT_EQ(g_outer, 0);
    PreemptionGuard::clear();
    EXPECT_EQ(PreemptionGuard::received(), 0);
  }
  std::raise(SIGUSR2);
  EXPECT_EQ(g_outer, SIGUSR2);
  std::signal(SIGUSR2, SIG_DFL);
}

// In a child process (the mask it sets must not reach the other tests): after
// take_preemption_signals_on_own_thread, this thread blocks the signal, and one sent to the process
// reaches the guard through the signal thread.
TEST(SignalsDeathTest, TheSignalThreadTakesWhatTheMainThreadBlocks) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        take_preemption_signals_on_own_thread();
        PreemptionGuard guard({SIGUSR1});
        sigset_t mask;
        pthread_sigmask(SIG_BLOCK, nullptr, &mask);
        if (!sigismember(&mask, SIGUSR1)) std::_Exit(3);
        kill(getpid(), SIGUSR1);
        for (int i = 0; i < 500 && PreemptionGuard::received() == 0; ++i) usleep(10000);
        std::_Exit(PreemptionGuard::received() == SIGUSR1 ? 0 : 4);
      },
      testing::ExitedWithCode(0), "");
}

// Without a guard the signal keeps its default action: the process ends by it.
TEST(SignalsDeathTest, WithoutAGuardTheSignalStillEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        take_preemption_signals_on_own_thread();
        kill(getpid(), SIGTERM);
        sleep(10);
        std::_Exit(5);
      },
      testing::KilledBySignal(SIGTERM), "");
}

// WaitClock: the clock every deadline of the communication layer waits on. A child process polls it
// while the test stops it for real (SIGSTOP, then SIGCONT, as `scontrol suspend` and resume do):
// the stop is left out of the time waited, and polling without a stop counts every second.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "dtrain/core/timer.h"

using namespace dtrain;

namespace {

struct Waited {
  double wall = 0, waited = 0, stopped = 0;
};

// A child polls a WaitClock every 10 ms for `wall_s` seconds of wall time and reports what it read;
// the parent stops it for `stop_s` seconds (none when 0) a little after it started.
Waited poll_in_a_child(double wall_s, double stop_s) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    Waited w;
    const double t0 = now_s();
    WaitClock clock;
    while (now_s() - t0 < wall_s) {
      w.waited = clock.waited();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w.waited = clock.waited();
    w.stopped = clock.stopped();
    w.wall = now_s() - t0;
    const ssize_t n = write(fds[1], &w, sizeof w);
    _exit(n == static_cast<ssize_t>(sizeof w) ? 0 : 1);
  }
  close(fds[1]);
  if (stop_s > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(child, SIGSTOP);
    std::this_thread::sleep_for(std::chrono::duration<double>(stop_s));
    kill(child, SIGCONT);
  }
  Waited w;
  EXPECT_EQ(read(fds[0], &w, sizeof w), static_cast<ssize_t>(sizeof w));
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return w;
}

}  // namespace

TEST(WaitClock, AStoppedProcessDoesNotCountTheStop) {
  const double stop_s = WaitClock::kStopGapS + 1.5;
  const Waited w = poll_in_a_child(stop_s + 1.5, stop_s);
  EXPECT_GE(w.wall, stop_s + 1.5);
  EXPECT_GE(w.stopped, stop_s - 0.2) << "the stop was counted as waiting";
  EXPECT_NEAR(w.waited + w.stopped, w.wall, 0.05);
  EXPECT_LT(w.waited, w.wall - stop_s + 0.5);
}

TEST(WaitClock, PollingWithoutAStopCountsEverySecond) {
  const Waited w = poll_in_a_child(1.0, 0);
  EXPECT_EQ(w.stopped, 0.0);
  EXPECT_NEAR(w.waited, w.wall, 0.05);
}

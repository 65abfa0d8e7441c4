#pragma once
// Typed errors. Library code never exits: it throws one of these, the CLI turns it into one message
// and a non-zero exit on every rank.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

// Set once by the runtime (comm bootstrap) so every error names the rank and host it came from.
void set_error_context(int rank, const std::string& host);
std::string error_context();  // "rank 3 on node07" or "" before bootstrap

class Error : public std::runtime_error {
 public:
  Error(const std::string& domain, const std::string& what, const char* file, int line);
  const std::string& message() const { return message_; }  // without location, for users
  const std::string& domain() const { return domain_; }

 private:
  std::string domain_;
  std::string message_;
};

// A user-facing error in the input (bad option, missing file, wrong shape): reported without file:line.
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// The run diverged: a non-finite loss or non-finite weights. Not bad input (the options were
// valid), not a crash: the CLI exits with kExitDiverged so a job script does not requeue it.
class DivergenceError : public std::runtime_error {
 public:
  explicit DivergenceError(const std::string& what) : std::runtime_error(what) {}
};

// The exit statuses of every dtrain command, the same on every rank (README "Exit statuses"; the
// job scripts in cluster/ act on them).
enum ExitStatus : int {
  kExitDone = 0,
  kExitFailure = 1,    // a runtime failure (one rank's error, a library error, a lost rank)
  kExitBadInput = 2,   // InputError: a bad option, a missing or broken file, a wrong shape
  kExitDiverged = 3,   // DivergenceError: non-finite loss or weights
  kExitPreempted = 42  // a preemption signal: checkpoint written, the job scripts requeue
};

namespace detail {
[[noreturn]] void throw_error(const char* domain, const std::string& msg, const char* file, int line);
}  // namespace detail
}  // namespace dtrain

#define DT_STR(...) (static_cast<std::ostringstream&&>(std::ostringstream() << __VA_ARGS__)).str()

// DT_CHECK(cond, "message " << value): an internal invariant or an argument check.
#define DT_CHECK(cond, ...)                                                                 \
  do {                                                                                      \
    if (!(cond)) ::dtrain::detail::throw_error("check", DT_STR(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

// DT_INPUT_CHECK(cond, "message"): the user gave something wrong; the message must name it.
#define DT_INPUT_CHECK(cond, ...)                                    \
  do {                                                               \
    if (!(cond)) throw ::dtrain::InputError(DT_STR(__VA_ARGS__));   \
  } while (0)

#pragma once
// A hang's forensics file: <run dir>/hang-rank<world rank>.txt with the reason, every live flight
// recorder and a backtrace of every thread of this process.
#include <string>

namespace dtrain::comm::detail {

// Writes this rank's file once; a later or concurrent call waits for the first and returns the
// same path ("" when it could not be written). Threads are captured by a signal each thread
// answers with its own stack (Boost.Stacktrace's async-signal-safe dump); one that does not answer
// within a second (it blocks the signal) is listed without a stack.
std::string write_hang_forensics(const std::string& reason);

// Every thread's backtrace, as written to the file.
std::string thread_backtraces();

}  // namespace dtrain::comm::detail

#include "dtrain/core/error.h"

#include <mutex>

namespace dtrain {
namespace {
std::mutex g_ctx_mu;
std::string g_ctx;
}  // namespace

void set_error_context(int rank, const std::string& host) {
  std::lock_guard<std::mutex> lock(g_ctx_mu);
  g_ctx = "rank " + std::to_string(rank) + " on " + host;
}

std::string error_context() {
  std::lock_guard<std::mutex> lock(g_ctx_mu);
  return g_ctx;
}

static std::string format(const std::string& domain, const std::string& msg, const char* file, int line) {
  std::string ctx = error_context();
  std::string out = domain + " error";
  if (!ctx.empty()) out += " (" + ctx + ")";
  out += ": " + msg + " [" + file + ":" + std::to_string(line) + "]";
  return out;
}

Error::Error(const std::string& domain, const std::string& what, const char* file, int line)
    : std::runtime_error(format(domain, what, file, line)), domain_(domain), message_(what) {}

namespace detail {
void throw_error(const char* domain, const std::string& msg, const char* file, int line) {
  throw Error(domain, msg, file, line);
}
}  // namespace detail
}  // namespace dtrain

#include "dtrain/train/metrics.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain::train {

std::string fixed(double v, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << v;
  return o.str();
}

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\')
      out += '\\', out += c;
    else if (c == '\n')
      out += "\\n";
    else if (static_cast<unsigned char>(c) < 0x20)
      out += ' ';
    else
      out += c;
  }
  out += '"';
}

std::string to_json(const JsonFields& fields) {
  std::string out = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) out += ", ";
    json_string(out, fields[i].first);
    out += ": ";
    const JsonValue& v = fields[i].second;
    if (auto* n = std::get_if<int64_t>(&v)) {
      out += std::to_string(*n);
    } else if (auto* d = std::get_if<double>(&v)) {
      if (std::isfinite(*d)) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.9g", *d);
        out += buf;
      } else {
        out += "null";  // JSON has no NaN/Inf
      }
    } else {
      json_string(out, std::get<std::string>(v));
    }
  }
  return out + "}";
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);  // fopen names what failed
  f_ = std::fopen(path.c_str(), append ? "a" : "w");
  DT_INPUT_CHECK(f_, "option --metrics: cannot open '" << path << "' for writing: " << std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const JsonFields& fields) {
  if (!f_) return;
  std::string line = to_json(fields) + "\n";
  std::fwrite(line.data(), 1, line.size(), f_);
  std::fflush(f_);
}

namespace {
// Whether a person watches this process's output: it goes to a terminal, no batch system runs the
// job, and the launcher that started this rank (mpirun, orted, srun's step daemon: the parent)
// writes to a terminal too. Under `mpirun ... > log` a rank's output is a pty of mpirun's, so its
// own isatty alone would draw a bar's carriage returns into the log file.
bool output_is_watched() {
  if (!isatty(STDOUT_FILENO)) return false;
  if (std::getenv("SLURM_JOB_ID") || std::getenv("PBS_JOBID")) return false;
  char target[256];
  const std::string parent_out = "/proc/" + std::to_string(getppid()) + "/fd/1";
  const ssize_t n = readlink(parent_out.c_str(), target, sizeof target - 1);
  if (n <= 0) return true;  // no /proc, or no permission: the own terminal decides
  const std::string out(target, static_cast<size_t>(n));
  return out.rfind("/dev/pts/", 0) == 0 || out.rfind("/dev/tty", 0) == 0;
}
}  // namespace

Progress::Progress(const std::string& mode, bool speak)
    : speak_(speak), bar_(speak && (mode == "on" || (mode == "auto" && output_is_watched()))) {}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

void Progress::update(int64_t epoch, int64_t epochs, int64_t done, int64_t total, const std::string& stats,
                      double eta_s) {
  if (!bar_) return;
  const int width = 24;
  int filled = total > 0 ? static_cast<int>(width * done / total) : 0;
  std::string bar(static_cast<size_t>(filled), '=');
  if (filled < width) bar += '>', bar += std::string(static_cast<size_t>(width - filled - 1), ' ');
  std::printf("\r\033[Kepoch %lld/%lld [%s] %lld/%lld %s ETA %s", static_cast<long long>(epoch),
              static_cast<long long>(epochs), bar.c_str(), static_cast<long long>(done), static_cast<long long>(total),
              stats.c_str(), format_duration(eta_s).c_str());
  std::fflush(stdout);
  dirty_ = true;
}

void Progress::line(const std::string& text) {
  if (!speak_) return;
  if (dirty_) std::printf("\r\033[K");
  dirty_ = false;
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
}

}  // namespace dtrain::train

#pragma once
// Run output: a JSON-lines metrics file and the console (progress bar on a terminal, plain lines
// otherwise). Only rank 0 writes either.
#include <cstdio>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace dtrain::train {

using JsonValue = std::variant<int64_t, double, std::string>;
using JsonFields = std::vector<std::pair<std::string, JsonValue>>;
std::string to_json(const JsonFields& fields);

// `v` with `digits` digits after the point, for log lines ("0.2526").
std::string fixed(double v, int digits);

class MetricsWriter {
 public:
  MetricsWriter() = default;
  explicit MetricsWriter(const std::string& path, bool append);  // throws InputError naming the path
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const JsonFields& fields);  // one line, flushed

 private:
  std::FILE* f_ = nullptr;
};

class Progress {
 public:
  // mode: "auto" (a bar when stdout is a terminal), "on", "off"; enabled only where `speak`.
  Progress(const std::string& mode, bool speak);
  bool bar() const { return bar_; }
  // Redraws the bar: "epoch 2/10 [=====>    ] 412/938 loss 0.3121 acc 88.1% 5123 samples/s ETA 1:02"
  void update(int64_t epoch, int64_t epochs, int64_t done, int64_t total, const std::string& stats, double eta_s);
  void line(const std::string& text);  // a plain line (ends the bar's line first)

 private:
  bool speak_, bar_;
  bool dirty_ = false;
};

std::string format_duration(double s);  // "1:02:03" or "2:05"

}  // namespace dtrain::train

#pragma once
// A Work made of stages: a collective, then local compute that launches the next collective, ...,
// then a finishing step (decoding into the bucket). Stages advance inside test() and wait(), on
// the caller's thread; every rank issues the same collectives in the same order, so ordering
// across ranks holds as long as callers wait on Works in a consistent order with their other
// calls on the same communicator.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm::detail {

class StagedWork final : public Work {
 public:
  using Stage = std::function<std::shared_ptr<Work>()>;
  StagedWork(std::string desc, std::shared_ptr<Work> first, std::vector<Stage> then, std::function<void()> finish)
      : desc_(std::move(desc)), current_(std::move(first)), then_(std::move(then)), finish_(std::move(finish)) {}

  bool test() override {
    while (!done_) {
      if (!current_->test()) return false;
      advance();
    }
    return true;
  }

  void wait(double timeout_s) override {
    double start = now_s();
    while (!done_) {
      // The limit covers the whole chain; each collective gets what is left of it.
      double left = timeout_s > 0 ? std::max(1e-3, timeout_s - (now_s() - start)) : timeout_s;
      current_->wait(left);
      advance();
    }
  }

  bool completed() const override { return done_; }
  std::string error() const override { return current_ ? current_->error() : ""; }
  std::string description() const override { return desc_ + (current_ ? " (at " + current_->description() + ")" : ""); }
  int64_t sequence() const override { return current_ ? current_->sequence() : 0; }

 private:
  void advance() {
    if (next_ < then_.size()) {
      current_ = then_[next_++]();
      return;
    }
    if (finish_) finish_();
    done_ = true;
    current_.reset();
    then_.clear();
    finish_ = nullptr;
  }

  std::string desc_;
  std::shared_ptr<Work> current_;
  std::vector<Stage> then_;
  std::function<void()> finish_;
  size_t next_ = 0;
  bool done_ = false;
};

// Adds the time a scope takes to a counter (seconds).
class ScopedSeconds {
 public:
  explicit ScopedSeconds(double& acc) : acc_(acc), t0_(now_s()) {}
  ~ScopedSeconds() { acc_ += now_s() - t0_; }
  ScopedSeconds(const ScopedSeconds&) = delete;
  ScopedSeconds& operator=(const ScopedSeconds&) = delete;

 private:
  double& acc_;
  double t0_;
};

}  // namespace dtrain::comm::detail

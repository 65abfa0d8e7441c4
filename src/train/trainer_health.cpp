// The one loop's health checks: stragglers named by their step-time split, replicas compared by
// parameter hashes (silent corruption), and the test hooks that provoke them and hangs.
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <sstream>
#include <thread>

#include "dtrain/core/env.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

// The test hooks that make this rank a straggler (DTRAIN_TEST_SLOW, RANK:SECTION:MS) or a hung
// rank (DTRAIN_TEST_STOP, RANK:STEP); DTRAIN_TEST_FLIP_BIT is read where it acts.
void Trainer::parse_test_hooks() {
  if (const std::string slow = env::get("DTRAIN_TEST_SLOW"); !slow.empty()) {
    const auto a = slow.find(':'), b = slow.rfind(':');
    if (a != b && std::stoi(slow.substr(0, a)) == rank_) {
      slow_section_ = slow.substr(a + 1, b - a - 1);
      slow_ms_ = std::stoi(slow.substr(b + 1));
    }
  }
  if (const std::string stop = env::get("DTRAIN_TEST_STOP"); !stop.empty()) {
    const auto a = stop.find(':');
    if (a != std::string::npos && std::stoi(stop.substr(0, a)) == rank_) stop_after_ = std::stol(stop.substr(a + 1));
  }
}

void Trainer::test_delay(const char* section) const {
  if (slow_ms_ > 0 && slow_section_ == section) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
}

// Stragglers: the ranks share their step-time split since the last comparison; a rank whose busy
// time (the step without the exchange wait, which a slow peer inflates on everyone else) exceeds
// the median rank's by more than --straggler-threshold (and 1 ms a step) is named, with the section
// furthest above that section's median.
void Trainer::find_stragglers() {
  static const char* kSections[] = {"data wait", "forward", "backward", "exchange wait", "optimizer"};
  const int world = world_.size();
  Tensor mine = Tensor::empty({5}), all = Tensor::empty({5 * static_cast<int64_t>(world)});
  for (int i = 0; i < 5; ++i) mine.f32()[i] = static_cast<float>(split_[static_cast<size_t>(i)]);
  split_.assign(5, 0.0);
  if (world == 1) return;
  world_.allgather(mine, all)->wait();
  auto value = [&](int r, int i) { return static_cast<double>(all.f32()[r * 5 + i]); };
  auto busy = [&](int r) { return value(r, 0) + value(r, 1) + value(r, 2) + value(r, 4); };
  auto median = [&](const std::function<double(int)>& f) {
    std::vector<double> v(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) v[static_cast<size_t>(r)] = f(r);
    const int mid = (world - 1) / 2;  // the lower median: of 2 ranks, the faster one is the reference
    std::nth_element(v.begin(), v.begin() + mid, v.end());
    return v[static_cast<size_t>(mid)];
  };
  const double typical = median(busy), steps = static_cast<double>(cfg_.straggler_every);
  for (int r = 0; r < world; ++r) {
    // Above the threshold, and by 1 ms a step at least: sub-millisecond jitter costs nothing.
    if (busy(r) <= (1.0 + cfg_.straggler_threshold) * typical || busy(r) - typical < 1e-3 * steps) continue;
    int worst = 0;
    double excess = -1;
    for (int i : {0, 1, 2, 4}) {
      const double over = value(r, i) - median([&](int q) { return value(q, i); });
      if (over > excess) excess = over, worst = i;
    }
    say("straggler: rank " + std::to_string(r) + " is busy " + fixed(1e3 * busy(r) / steps, 2) + " ms per step, " +
        fixed(100 * (busy(r) / typical - 1), 0) + " % over the median rank, most in " + kSections[worst] + " (" +
        fixed(1e3 * value(r, worst) / steps, 2) + " ms against " +
        fixed(1e3 * median([&](int q) { return value(q, worst); }) / steps, 2) + " ms)");
    if (metrics_)
      metrics_->write({{"event", std::string("straggler")},
                       {"step", step_},
                       {"rank", static_cast<int64_t>(r)},
                       {"section", std::string(kSections[worst])},
                       {"busy_s_per_step", busy(r) / steps},
                       {"median_busy_s_per_step", typical / steps}});
  }
}

// The DTRAIN_TEST_CHECKPOINT_READ_DELAY hook ("RANK:MS"): world rank RANK waits MS milliseconds
// before it reads the set or weights it starts from, as on a slow file system.
void Trainer::delay_read_if_asked() const {
  const std::string delay = env::get("DTRAIN_TEST_CHECKPOINT_READ_DELAY");
  const auto colon = delay.find(':');
  if (colon == std::string::npos || std::stoi(delay.substr(0, colon)) != rank_) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(std::stol(delay.substr(colon + 1))));
}

// The DTRAIN_TEST_FLIP_BIT hook ("RANK:STEP"): one bit of this rank's first weight flips after
// step STEP, a silent corruption for check_replicas to find. (A flip of the lowest bit can vanish
// again: the next update rounds it away.)
void Trainer::flip_bit_if_asked() {
  const std::string flip = env::get("DTRAIN_TEST_FLIP_BIT");
  const auto colon = flip.find(':');
  if (colon == std::string::npos || std::stol(flip.substr(0, colon)) != world_.rank() ||
      std::stol(flip.substr(colon + 1)) != step_)
    return;
  Tensor& value = task_->model().parameters().front()->value;
  Tensor host = to_host(value).clone();
  uint32_t bits;
  std::memcpy(&bits, host.f32(), 4);
  bits ^= 1u << 22;  // the top mantissa bit: the value moves by up to half, as a memory error would leave it
  std::memcpy(host.f32(), &bits, 4);
  copy_any(host, value);
}

// Silent corruption: data-parallel replicas hold the same parameters after every step (ZeRO-1's
// all-gather included), so a CRC-32 per parameter, gathered over the dp group, must agree. A
// mismatch names the ranks and the first differing parameter on every rank of the world (the tp
// and pp peers too) and stops the run here, before its next checkpoint could keep the bad weights.
void Trainer::check_replicas() {
  const std::vector<nn::Parameter*> params = task_->model().parameters();
  const int dp = grid_->dp_size();
  const auto n = static_cast<int64_t>(params.size());
  Tensor mine = Tensor::empty({n}, DType::I32), all = Tensor::empty({n * dp}, DType::I32);
  for (int64_t i = 0; i < n; ++i) {
    const Tensor host = to_host(params[static_cast<size_t>(i)]->value);
    mine.data<int32_t>()[i] = static_cast<int32_t>(crc32(0L, static_cast<const Bytef*>(host.raw()),
                                                         static_cast<uInt>(host.nbytes())));
  }
  if (dp > 1) grid_->dp().allgather(mine, all)->wait();
  comm::agree_on_inputs(world_, [&] {
    const int32_t* h = all.data<int32_t>();
    for (int64_t i = 0; i < n && dp > 1; ++i)
      for (int r = 1; r < dp; ++r)
        if (h[r * n + i] != h[i])
          throw DivergenceError("the data-parallel replicas differ after step " + std::to_string(step_) +
                                ": parameter " + params[static_cast<size_t>(i)]->name + " of dp rank " +
                                std::to_string(r) + " (world rank " +
                                std::to_string(grid_->rank_of(r, grid_->tp_rank(), grid_->pp_rank())) + ") is not dp rank 0's (world rank " +
                                std::to_string(grid_->rank_of(0, grid_->tp_rank(), grid_->pp_rank())) +
                                "): silent corruption (memory, network or a bug); stopped before the next checkpoint");
  });
}

}  // namespace dtrain::train

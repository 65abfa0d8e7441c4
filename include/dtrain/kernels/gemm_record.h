#pragma once
// Which GEMMs a piece of work runs, and how long each took where it ran. While a GemmRecording is
// alive on a thread, the CPU engine notes every GEMM it runs on that thread (batch, shape,
// transposes) with its wall time; `dtrain bench lm-gemm` records a training step's forward and
// backward this way, then times the same GEMMs alone to give the step's GEMM limit.
#include <cstdint>
#include <vector>

namespace dtrain {

struct GemmCall {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  bool batched = false;  // through Engine::gemm_batched (else Engine::gemm)
  double seconds = 0;    // wall time of the call where it ran
  double flop() const {
    return 2.0 * static_cast<double>(batch) * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  }
  bool same_shape(const GemmCall& o) const {
    return batch == o.batch && m == o.m && n == o.n && k == o.k && ta == o.ta && tb == o.tb && batched == o.batched;
  }
};

// This thread's recording while it lives; recordings do not nest (a second one on the same thread
// is an error).
class GemmRecording {
 public:
  GemmRecording();
  ~GemmRecording();
  GemmRecording(const GemmRecording&) = delete;
  GemmRecording& operator=(const GemmRecording&) = delete;
  const std::vector<GemmCall>& calls() const { return calls_; }

 private:
  friend class GemmNote;
  std::vector<GemmCall> calls_;
};

// An engine's scope around one GEMM: noted, with its time, in this thread's recording if there is
// one (otherwise it costs one thread-local read).
class GemmNote {
 public:
  GemmNote(bool batched, int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k);
  ~GemmNote();
  GemmNote(const GemmNote&) = delete;
  GemmNote& operator=(const GemmNote&) = delete;

 private:
  GemmRecording* rec_;
  GemmCall call_;
  double t0_ = 0;
};

}  // namespace dtrain

#include "dtrain/kernels/gemm_record.h"

#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"

namespace dtrain {

namespace {
thread_local GemmRecording* current = nullptr;
}

GemmRecording::GemmRecording() {
  DT_CHECK(current == nullptr, "a GEMM recording is already active on this thread");
  current = this;
}

GemmRecording::~GemmRecording() { current = nullptr; }

GemmNote::GemmNote(bool batched, int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k) : rec_(current) {
  if (!rec_) return;
  call_ = GemmCall{batch, m, n, k, ta, tb, batched, 0.0};
  t0_ = now_s();
}

GemmNote::~GemmNote() {
  if (!rec_) return;
  call_.seconds = now_s() - t0_;
  rec_->calls_.push_back(call_);
}

}  // namespace dtrain

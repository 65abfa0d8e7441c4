// PowerSGD: rank-r approximation with one power iteration per step, warm start, error feedback.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

PowerSgdCompressor::PowerSgdCompressor(int rank, uint64_t seed) : rank_(rank), seed_(seed) {
  DT_CHECK(rank >= 1, "PowerSGD rank " << rank << " must be >= 1");
}

std::string PowerSgdCompressor::name() const { return "powersgd(" + std::to_string(rank_) + ")"; }

std::pair<int64_t, int64_t> PowerSgdCompressor::matrix_shape(int64_t n, int64_t rows_hint) {
  if (rows_hint > 0) return {rows_hint, n / rows_hint};
  int64_t cols = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n)))));
  int64_t rows = std::max<int64_t>(1, (n + cols - 1) / cols);
  return {rows, cols};
}

namespace {
// The step's matrices, shared by its stages. M is rows x cols, P rows x r, Q cols x r, row-major, on
// the bucket's device. The products run in exact fp32 whatever the run's math precision.
struct PowerSgdStep {
  int64_t n, rows, cols, r;
  Tensor m, p, q;
};

void multiply_m_q(PowerSgdStep& s) {  // P = M Q
  Engine& e = engine_for(s.m.device());
  ScopedMathPrecision exact(e, MathPrecision::F32);
  e.gemm(false, false, s.rows, s.r, s.cols, 1.f, s.m, s.q, 0.f, s.p);
}

void multiply_mt_p(PowerSgdStep& s) {  // Q = M^T P
  Engine& e = engine_for(s.m.device());
  ScopedMathPrecision exact(e, MathPrecision::F32);
  e.gemm(true, false, s.cols, s.r, s.rows, 1.f, s.m, s.p, 0.f, s.q);
}
}  // namespace

std::shared_ptr<Work> PowerSgdCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel();
  auto [rows, cols] = matrix_shape(n, st.rows);
  if (dense_ || rank_ >= std::min(rows, cols) || (rows + cols) * rank_ >= n) {
    // The warm-up, or a rank-r factorisation that would send as much as the bucket itself.
    stats_.bytes_sent += static_cast<int64_t>(bucket.nbytes());
    return comm.allreduce(bucket, op);
  }
  const Device dev = bucket.device();
  Engine& e = engine_for(dev);
  auto step = std::make_shared<PowerSgdStep>();
  step->n = n;
  step->rows = rows;
  step->cols = cols;
  step->r = rank_;
  step->p = Tensor::empty({rows, step->r}, DType::F32, dev);
  std::shared_ptr<Work> first;
  {
    detail::ScopedSeconds t(stats_.compress_s);
    Tensor& residual = BucketState::on(st.residual, dev);
    if (!residual.defined()) residual = zeros_on({n}, dev);
    // A Q loaded from a checkpoint part (Compressor::load_state_tensors) is checked here, where its
    // shape is known: one of another size would be read and written past its end.
    DT_INPUT_CHECK(!st.factor.defined() || st.factor.numel() == cols * step->r,
                   name() << ": the kept state of bucket " << st.id << " holds a Q of " << st.factor.numel()
                          << " values, but the bucket's is " << cols << " x " << step->r
                          << " (a corrupt checkpoint part?)");
    if (!st.factor.defined()) {
      // The same seed on every rank: all ranks start from the same Q, as they must.
      Tensor q = Tensor::empty({cols, step->r});
      Rng rng(derive_seed(seed_, static_cast<uint64_t>(st.id)));
      float* v = q.f32();
      for (int64_t i = 0; i < cols * step->r; ++i) v[i] = rng.normal();
      st.factor = q;
    }
    step->q = Tensor::empty({cols, step->r}, DType::F32, dev);
    copy_any(st.factor, step->q);
    // M holds gradient + residual, zero-padded to whole rows (a flat bucket's last row may be partial).
    step->m = zeros_on({rows, cols}, dev);
    Tensor head = step->m.reshape({rows * cols}).slice0(0, n);
    e.add(bucket, residual, head);
    multiply_m_q(*step);
  }
  first = comm.allreduce(step->p, ReduceOp::Sum);

  Communicator* c = &comm;
  double* enc = &stats_.compress_s;
  double* dec = &stats_.decompress_s;
  BucketState* state = &st;
  auto second = [step, c, enc]() {
    detail::ScopedSeconds t(*enc);
    engine_for(step->p.device()).orthonormalize_columns(step->p);
    multiply_mt_p(*step);
    return c->allreduce(step->q, ReduceOp::Sum);
  };
  const int size = comm.size();
  auto finish = [step, bucket, state, size, op, dec]() mutable {
    detail::ScopedSeconds t(*dec);
    Engine& e = engine_for(bucket.device());
    ScopedMathPrecision exact(e, MathPrecision::F32);
    // Q now holds the sum over ranks; the mean approximation is A = P (Q / size)^T, into M's padding
    // rows' worth of scratch; the bucket takes its first n values.
    e.scale(step->q, 1.f / static_cast<float>(size));
    Tensor approx = Tensor::empty({step->rows, step->cols}, DType::F32, bucket.device());
    e.gemm(false, true, step->rows, step->cols, step->r, 1.f, step->p, step->q, 0.f, approx);
    Tensor head = approx.reshape({step->rows * step->cols}).slice0(0, step->n);
    e.copy(head, bucket);
    // Error feedback against the mean approximation: residual = M - A.
    e.copy(step->m.reshape({step->rows * step->cols}).slice0(0, step->n), state->residual);
    e.axpy(-1.f, bucket, state->residual);
    if (op == ReduceOp::Sum) e.scale(bucket, static_cast<float>(size));
    state->factor = step->q;  // warm start for the next step
  };
  stats_.bytes_sent += (rows + cols) * step->r * static_cast<int64_t>(sizeof(float));
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), first,
                                              std::vector<detail::StagedWork::Stage>{second}, finish);
}

}  // namespace dtrain::comm

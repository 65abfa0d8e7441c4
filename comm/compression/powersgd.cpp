// PowerSGD: rank-r approximation with one power iteration per step, warm start, error feedback.
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"

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
// The step's matrices, shared by its stages. M is rows x cols, P rows x r, Q cols x r, row-major.
struct PowerSgdStep {
  int64_t n, rows, cols, r;
  Tensor m, p, q;
};

// P = M Q
void multiply_m_q(const PowerSgdStep& s) {
  const float* m = s.m.f32();
  const float* q = s.q.f32();
  float* p = s.p.f32();
  std::memset(p, 0, static_cast<size_t>(s.rows * s.r) * sizeof(float));
  for (int64_t i = 0; i < s.rows; ++i)
    for (int64_t j = 0; j < s.cols; ++j) {
      float mij = m[i * s.cols + j];
      for (int64_t c = 0; c < s.r; ++c) p[i * s.r + c] += mij * q[j * s.r + c];
    }
}

// Q = M^T P
void multiply_mt_p(const PowerSgdStep& s) {
  const float* m = s.m.f32();
  const float* p = s.p.f32();
  float* q = s.q.f32();
  std::memset(q, 0, static_cast<size_t>(s.cols * s.r) * sizeof(float));
  for (int64_t i = 0; i < s.rows; ++i)
    for (int64_t j = 0; j < s.cols; ++j) {
      float mij = m[i * s.cols + j];
      for (int64_t c = 0; c < s.r; ++c) q[j * s.r + c] += mij * p[i * s.r + c];
    }
}
}  // namespace

std::shared_ptr<Work> PowerSgdCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel();
  auto [rows, cols] = matrix_shape(n, st.rows);
  if (rank_ >= std::min(rows, cols) || (rows + cols) * rank_ >= n) {
    // A rank-r factorisation would send as much as the bucket itself.
    stats_.bytes_sent += static_cast<int64_t>(bucket.nbytes());
    return comm.allreduce(bucket, op);
  }
  auto step = std::make_shared<PowerSgdStep>();
  step->n = n;
  step->rows = rows;
  step->cols = cols;
  step->r = rank_;
  step->p = Tensor::empty({rows, step->r});
  std::shared_ptr<Work> first;
  {
    detail::ScopedSeconds t(stats_.compress_s);
    if (!st.residual.defined()) st.residual = Tensor::zeros({n});
    // A Q loaded from a checkpoint part (Compressor::load_state_tensors) is checked here, where its
    // shape is known: one of another size would be read and written past its end.
    DT_INPUT_CHECK(!st.factor.defined() || st.factor.numel() == cols * step->r,
                   name() << ": the kept state of bucket " << st.id << " holds a Q of " << st.factor.numel()
                          << " values, but the bucket's is " << cols << " x " << step->r
                          << " (a corrupt checkpoint part?)");
    if (!st.factor.defined()) {
      // The same seed on every rank: all ranks start from the same Q, as they must.
      st.factor = Tensor::empty({cols, step->r});
      Rng rng(derive_seed(seed_, static_cast<uint64_t>(st.id)));
      float* q = st.factor.f32();
      for (int64_t i = 0; i < cols * step->r; ++i) q[i] = rng.normal();
    }
    step->q = st.factor.clone();
    step->m = Tensor::zeros({rows, cols});
    float* m = step->m.f32();
    const float* g = bucket.f32();
    const float* res = st.residual.f32();
    for (int64_t i = 0; i < n; ++i) m[i] = g[i] + res[i];
    multiply_m_q(*step);
  }
  first = comm.allreduce(step->p, ReduceOp::Sum);

  Communicator* c = &comm;
  double* enc = &stats_.compress_s;
  double* dec = &stats_.decompress_s;
  BucketState* state = &st;
  auto second = [step, c, enc]() {
    detail::ScopedSeconds t(*enc);
    codec::orthonormalize_columns(step->p.f32(), step->rows, step->r);
    multiply_mt_p(*step);
    return c->allreduce(step->q, ReduceOp::Sum);
  };
  int size = comm.size();
  auto finish = [step, bucket, state, size, op, dec] {
    detail::ScopedSeconds t(*dec);
    // Q now holds the sum over ranks; the mean approximation is P (Q / size)^T.
    float* q = step->q.f32();
    for (int64_t i = 0; i < step->cols * step->r; ++i) q[i] /= static_cast<float>(size);
    const float* p = step->p.f32();
    const float* m = step->m.f32();
    float* out = bucket.f32();
    float* res = state->residual.f32();
    float scale = op == ReduceOp::Sum ? static_cast<float>(size) : 1.0f;
    for (int64_t e = 0; e < step->n; ++e) {
      int64_t i = e / step->cols, j = e % step->cols;
      float a = 0;
      for (int64_t k = 0; k < step->r; ++k) a += p[i * step->r + k] * q[j * step->r + k];
      res[e] = m[e] - a;  // error feedback against the mean approximation
      out[e] = a * scale;
    }
    state->factor = step->q;  // warm start for the next step
  };
  stats_.bytes_sent += (rows + cols) * step->r * static_cast<int64_t>(sizeof(float));
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), first,
                                              std::vector<detail::StagedWork::Stage>{second}, finish);
}

}  // namespace dtrain::comm

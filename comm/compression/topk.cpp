// Top-k sparsification with error feedback.
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"

namespace dtrain::comm {

TopKCompressor::TopKCompressor(double ratio, float momentum_correction) : ratio_(ratio) {
  DT_CHECK(ratio > 0 && ratio <= 1, "top-k ratio " << ratio << " must be in (0, 1]");
  set_momentum_correction(momentum_correction);
}

void TopKCompressor::set_momentum_correction(float m) {
  DT_CHECK(m >= 0 && m < 1, "top-k momentum correction " << m << " must be in [0, 1)");
  momentum_ = m;
}

void TopKCompressor::set_ratio(double ratio) {
  DT_CHECK(ratio > 0 && ratio <= 1, "top-k ratio " << ratio << " must be in (0, 1]");
  ratio_ = ratio;
}

std::string TopKCompressor::name() const {
  char b[32];
  std::snprintf(b, sizeof b, "topk(%g)", ratio_);
  return b;
}

std::shared_ptr<Work> TopKCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel();
  const int64_t k = std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio_ * n))));
  // Payload (bytes): k int32 indices, then k f32 values.
  Tensor payload = Tensor::empty({8 * k}, DType::U8);
  {
    detail::ScopedSeconds t(stats_.compress_s);
    if (!st.residual.defined()) st.residual = Tensor::zeros({n});
    float* acc = st.residual.f32();  // becomes gradient + residual, then what is left unsent
    const float* g = bucket.f32();
    float* u = nullptr;
    if (momentum_ > 0) {
      if (!st.velocity.defined()) st.velocity = Tensor::zeros({n});
      u = st.velocity.f32();
      const float m = momentum_;
      for (int64_t i = 0; i < n; ++i) {
        u[i] = m * u[i] + g[i];
        acc[i] += u[i];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] += g[i];
    }
    std::vector<int32_t> idx = codec::topk_indices(acc, n, k);
    auto* pi = payload.data<int32_t>();
    auto* pv = reinterpret_cast<float*>(payload.data<uint8_t>() + 4 * k);
    for (int64_t j = 0; j < k; ++j) {
      pi[j] = idx[static_cast<size_t>(j)];
      pv[j] = acc[pi[j]];
      acc[pi[j]] = 0;           // sent exactly: nothing of it stays behind
      if (u) u[pi[j]] = 0;      // momentum factor masking: a sent coordinate's momentum restarts
    }
  }
  stats_.bytes_sent += 8 * k;
  Tensor gathered = Tensor::empty({8 * k * comm.size()}, DType::U8);
  auto w = comm.allgather(payload, gathered);
  int size = comm.size();
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, gathered, payload, n, k, size, op, dec] {
    detail::ScopedSeconds t(*dec);
    float* out = bucket.f32();
    std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
    for (int r = 0; r < size; ++r) {  // rank order: the same sum on every rank
      const uint8_t* block = gathered.data<uint8_t>() + 8 * k * r;
      const auto* pi = reinterpret_cast<const int32_t*>(block);
      const auto* pv = reinterpret_cast<const float*>(block + 4 * k);
      for (int64_t j = 0; j < k; ++j) out[pi[j]] += pv[j];
    }
    if (op == ReduceOp::Avg)
      for (int64_t i = 0; i < n; ++i) out[i] /= static_cast<float>(size);
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

}  // namespace dtrain::comm

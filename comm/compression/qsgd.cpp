// QSGD: stochastic quantisation to s levels of the vector's norm (unbiased, no error feedback).
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"

namespace dtrain::comm {

QsgdCompressor::QsgdCompressor(int levels, uint64_t seed) : levels_(levels), seed_(seed) {
  DT_CHECK(levels >= 1 && levels <= 127, "QSGD levels " << levels << " must be in [1, 127] (they travel as int8)");
}

std::string QsgdCompressor::name() const { return "qsgd(" + std::to_string(levels_) + ")"; }

std::shared_ptr<Work> QsgdCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel();
  // Payload (bytes): the f32 norm, then n int8 levels.
  Tensor payload = Tensor::empty({4 + n}, DType::U8);
  {
    detail::ScopedSeconds t(stats_.compress_s);
    // Each rank and bucket draws from its own reproducible stream.
    if (!st.rng)
      st.rng = std::make_unique<Rng>(
          derive_seed(seed_, static_cast<uint64_t>(comm.rank()) * 1000003u + static_cast<uint64_t>(st.id)));
    float norm =
        codec::qsgd_encode(bucket.f32(), n, levels_, *st.rng, reinterpret_cast<int8_t*>(payload.data<uint8_t>() + 4));
    std::memcpy(payload.raw(), &norm, 4);
  }
  stats_.bytes_sent += 4 + n;
  Tensor gathered = Tensor::empty({(4 + n) * comm.size()}, DType::U8);
  auto w = comm.allgather(payload, gathered);
  int size = comm.size();
  float s = static_cast<float>(levels_);
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, gathered, payload, n, size, s, op, dec] {
    detail::ScopedSeconds t(*dec);
    float* out = bucket.f32();
    std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
    for (int r = 0; r < size; ++r) {
      const uint8_t* block = gathered.data<uint8_t>() + (4 + n) * r;
      float norm;
      std::memcpy(&norm, block, 4);
      const auto* q = reinterpret_cast<const int8_t*>(block + 4);
      for (int64_t i = 0; i < n; ++i) out[i] += norm * static_cast<float>(q[i]) / s;
    }
    if (op == ReduceOp::Avg)
      for (int64_t i = 0; i < n; ++i) out[i] /= static_cast<float>(size);
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

}  // namespace dtrain::comm

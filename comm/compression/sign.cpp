// 1-bit (scaled sign) compression with error feedback.
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"

namespace dtrain::comm {

std::shared_ptr<Work> SignCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel();
  const int64_t nb = (n + 7) / 8;
  // Payload (bytes): the f32 scale, then n sign bits.
  Tensor payload = Tensor::empty({4 + nb}, DType::U8);
  {
    detail::ScopedSeconds t(stats_.compress_s);
    if (!st.residual.defined()) st.residual = Tensor::zeros({n});
    float* acc = st.residual.f32();
    const float* g = bucket.f32();
    double l1 = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc[i] += g[i];
      l1 += std::fabs(acc[i]);
    }
    float scale = n > 0 ? static_cast<float>(l1 / static_cast<double>(n)) : 0.0f;
    std::memcpy(payload.raw(), &scale, 4);
    uint8_t* bits = payload.data<uint8_t>() + 4;
    codec::pack_signs(acc, n, bits);
    for (int64_t i = 0; i < n; ++i) acc[i] -= scale * codec::signed_unit(bits, i);
  }
  stats_.bytes_sent += 4 + nb;
  Tensor gathered = Tensor::empty({(4 + nb) * comm.size()}, DType::U8);
  auto w = comm.allgather(payload, gathered);
  int size = comm.size();
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, gathered, payload, n, nb, size, op, dec] {
    detail::ScopedSeconds t(*dec);
    float* out = bucket.f32();
    std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
    for (int r = 0; r < size; ++r) {
      const uint8_t* block = gathered.data<uint8_t>() + (4 + nb) * r;
      float scale;
      std::memcpy(&scale, block, 4);
      for (int64_t i = 0; i < n; ++i) out[i] += scale * codec::signed_unit(block + 4, i);
    }
    if (op == ReduceOp::Avg)
      for (int64_t i = 0; i < n; ++i) out[i] /= static_cast<float>(size);
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

}  // namespace dtrain::comm

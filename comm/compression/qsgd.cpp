// QSGD: stochastic quantisation to s levels of the vector's norm (unbiased, no error feedback).
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

QsgdCompressor::QsgdCompressor(int levels, uint64_t seed) : levels_(levels), seed_(seed) {
  DT_CHECK(levels >= 1 && levels <= 127, "QSGD levels " << levels << " must be in [1, 127] (they travel as int8)");
}

std::string QsgdCompressor::name() const { return "qsgd(" + std::to_string(levels_) + ")"; }

std::shared_ptr<Work> QsgdCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel(), bytes = 4 + n, size = comm.size();
  const Device dev = bucket.device();
  Tensor payload = Tensor::empty({bytes}, DType::U8, dev);  // the f32 norm, then n int8 levels
  {
    detail::ScopedSeconds t(stats_.compress_s);
    // Each rank, bucket and reduce draws its own reproducible numbers.
    const uint64_t seed =
        derive_seed(derive_seed(seed_, static_cast<uint64_t>(comm.rank()) * 1000003u + static_cast<uint64_t>(st.id)),
                    static_cast<uint64_t>(st.draws++));
    engine_for(dev).qsgd_encode(bucket, levels_, seed, payload);
  }
  stats_.bytes_sent += bytes;
  Tensor gathered = Tensor::empty({bytes * size}, DType::U8, dev);
  auto w = comm.allgather(payload, gathered);
  const int levels = levels_;
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, gathered, bytes, size, levels, op, dec]() mutable {
    detail::ScopedSeconds t(*dec);
    Engine& e = engine_for(bucket.device());
    e.fill(bucket, 0.f);
    for (int64_t r = 0; r < size; ++r) e.qsgd_decode_add(gathered.slice0(r * bytes, (r + 1) * bytes), levels, bucket);
    if (op == ReduceOp::Avg) e.scale(bucket, 1.f / static_cast<float>(size));
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

}  // namespace dtrain::comm

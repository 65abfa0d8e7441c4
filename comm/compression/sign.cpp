// 1-bit (scaled sign) compression with error feedback.
#include <cmath>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

std::shared_ptr<Work> SignCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& st) {
  const int64_t n = bucket.numel(), bytes = 4 + (n + 7) / 8, size = comm.size();
  const Device dev = bucket.device();
  Engine& e = engine_for(dev);
  Tensor payload = Tensor::empty({bytes}, DType::U8, dev);  // the f32 scale, then n sign bits
  {
    detail::ScopedSeconds t(stats_.compress_s);
    Tensor& acc = BucketState::on(st.residual, dev);
    if (!acc.defined()) acc = zeros_on({n}, dev);
    e.axpy(1.f, bucket, acc);
    e.sign_encode(acc, payload);  // acc keeps what the scaled signs did not carry
  }
  stats_.bytes_sent += bytes;
  Tensor gathered = Tensor::empty({bytes * size}, DType::U8, dev);
  auto w = comm.allgather(payload, gathered);
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, gathered, bytes, size, op, dec]() mutable {
    detail::ScopedSeconds t(*dec);
    Engine& e = engine_for(bucket.device());
    e.fill(bucket, 0.f);
    for (int64_t r = 0; r < size; ++r) e.sign_decode_add(gathered.slice0(r * bytes, (r + 1) * bytes), bucket);
    if (op == ReduceOp::Avg) e.scale(bucket, 1.f / static_cast<float>(size));
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

}  // namespace dtrain::comm

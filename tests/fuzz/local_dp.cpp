#include "local_dp.h"

#include <cstring>

#include "dtrain/nn/layers.h"
#include "dtrain/nn/models.h"

namespace dtrain::fuzz {

namespace {

// t *= factor for the dtypes the exchange sums.
void scale(Tensor& t, int factor) {
  if (factor == 1) return;
  DT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::I32, "mirrored sum of " << t.str());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype() == DType::F32)
      t.data<float>()[i] *= static_cast<float>(factor);
    else
      t.data<int32_t>()[i] *= factor;
  }
}

}  // namespace

std::shared_ptr<comm::Work> MirroredCommunicator::do_allreduce(Tensor& t, comm::ReduceOp op) {
  if (op == comm::ReduceOp::Sum) scale(t, size());
  return comm::make_completed_work("allreduce");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_broadcast(Tensor&, int) {
  return comm::make_completed_work("broadcast");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_allgather(const Tensor& in, Tensor& out) {
  DT_CHECK(out.nbytes() == in.nbytes() * static_cast<size_t>(size()),
           "allgather of " << in.str() << " into " << out.str());
  for (int r = 0; r < size(); ++r)  // memmove: `in` may be a block of `out`
    std::memmove(static_cast<char*>(out.raw()) + r * in.nbytes(), in.raw(), in.nbytes());
  return comm::make_completed_work("allgather");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_reduce_scatter(const Tensor& in, Tensor& out, comm::ReduceOp op) {
  DT_CHECK(in.nbytes() == out.nbytes() * static_cast<size_t>(size()),
           "reduce_scatter of " << in.str() << " into " << out.str());
  std::memcpy(out.raw(), static_cast<const char*>(in.raw()) + rank() * out.nbytes(), out.nbytes());
  if (op == comm::ReduceOp::Sum) scale(out, size());
  return comm::make_completed_work("reduce_scatter");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_send(const Tensor&, int, int) {
  DT_CHECK(false, "a mirrored communicator has no peer to send to");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_recv(Tensor&, int, int) {
  DT_CHECK(false, "a mirrored communicator has no peer to receive from");
}
std::shared_ptr<comm::Work> MirroredCommunicator::do_barrier() { return comm::make_completed_work("barrier"); }
std::unique_ptr<comm::Communicator> MirroredCommunicator::do_split(int color, int, const std::string&) {
  return color == kNoColor ? nullptr : std::make_unique<MirroredCommunicator>(rank(), size());
}

LocalDataParallel::LocalDataParallel(const std::string& c, int rank) : compression(c), comm(rank, 2) {
  nn::ModelSpec spec;
  spec.name = "mlp";
  spec.input = {1, 2, 2};
  spec.classes = 3;
  spec.hidden = {24,
                 20};  // matrices wider than 16 floats: a tensor's storage is rounded up to 64 bytes, unseen by ASan
  model = nn::make_model(spec);
  parallel::DataParallelOptions opt;
  opt.compression = compression;
  dp = std::make_unique<parallel::ReplicatedDataParallel>(*model, comm, opt);
}

void LocalDataParallel::step() {
  Tensor x = Tensor::from({2, 1, 2, 2}, {0.5f, -1.f, 2.f, 0.25f, 1.5f, 0.f, -0.5f, 1.f});
  Tensor y = Tensor::zeros({2}, DType::I32);
  y.data<int32_t>()[1] = 2;
  nn::SoftmaxCrossEntropy xent;
  dp->begin_backward();
  xent.forward(model->forward(x), y);
  model->backward(xent.backward());
  dp->finish();
}

}  // namespace dtrain::fuzz

// NCCL backend on device buffers. Skips, saying why, without NCCL or without a GPU.
#include <gtest/gtest.h>

#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"

#if defined(DTRAIN_WITH_NCCL)
#include <cuda_runtime_api.h>
#endif

using namespace dtrain;
using namespace dtrain::comm;

namespace {

#if defined(DTRAIN_WITH_NCCL)
class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0)
      GTEST_SKIP() << "no CUDA device on this machine: the NCCL backend is compiled but not exercised";
    device_ = Runtime::get().topology().cuda_device;
    try {
      allocate(4, Device::cuda(device_));
    } catch (const std::exception&) {
      // No CUDA allocator registered in this binary (the CUDA engine registers its caching one).
      register_allocator(DeviceType::CUDA, [](size_t bytes, Device d) {
        cudaSetDevice(d.index);
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
        return std::make_shared<Storage>(p, bytes, d, [](void* q) { cudaFree(q); });
      });
    }
    comm_ = make_nccl_communicator(Runtime::get().world(), device_);
  }
  Tensor to_device(const Tensor& host) {
    Tensor d = Tensor::empty(host.shape(), host.dtype(), Device::cuda(device_));
    cudaMemcpy(d.raw(), host.raw(), host.nbytes(), cudaMemcpyHostToDevice);
    return d;
  }
  Tensor to_host(const Tensor& dev) {
    Tensor h = Tensor::empty(dev.shape(), dev.dtype());
    cudaMemcpy(h.raw(), dev.raw(), dev.nbytes(), cudaMemcpyDeviceToHost);
    return h;
  }
  int device_ = -1;
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclTest, AllreduceSumAvgExact) {
  Communicator& c = *comm_;
  const int n = c.size();
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
    Tensor h = Tensor::empty({4099});
    for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = (c.rank() + 1) * static_cast<float>(i % 7 + 1);
    Tensor d = to_device(h);
    c.allreduce(d, op)->wait();
    Tensor r = to_host(d);
    for (int64_t i = 0; i < r.numel(); ++i) {
      float k = static_cast<float>(i % 7 + 1);
      float want = op == ReduceOp::Sum ? k * n * (n + 1) / 2 : op == ReduceOp::Avg ? k * (n + 1) / 2.0f : k * n;
      ASSERT_EQ(r.f32()[i], want) << reduce_op_name(op) << " i=" << i;
    }
  }
}

TEST_F(NcclTest, BroadcastAllgatherReduceScatterSendRecv) {
  Communicator& c = *comm_;
  const int n = c.size();
  Tensor h = Tensor::full({100}, static_cast<float>(c.rank() + 1));
  Tensor d = to_device(h);
  c.broadcast(d, n - 1)->wait();
  EXPECT_EQ(to_host(d).f32()[50], static_cast<float>(n));

  Tensor in = to_device(Tensor::full({10}, static_cast<float>(c.rank())));
  Tensor out = Tensor::empty({10 * n}, DType::F32, Device::cuda(device_));
  c.allgather(in, out)->wait();
  Tensor g = to_host(out);
  for (int r = 0; r < n; ++r) EXPECT_EQ(g.f32()[r * 10 + 3], static_cast<float>(r));

  Tensor rs_in = to_device(Tensor::full({10 * n}, 1.0f));
  Tensor rs_out = Tensor::empty({10}, DType::F32, Device::cuda(device_));
  c.reduce_scatter(rs_in, rs_out, ReduceOp::Sum)->wait();
  EXPECT_EQ(to_host(rs_out).f32()[9], static_cast<float>(n));

  if (n > 1) {
    Tensor s = to_device(Tensor::full({1000}, static_cast<float>(c.rank())));
    Tensor r = Tensor::empty({1000}, DType::F32, Device::cuda(device_));
    auto wr = c.recv(r, (c.rank() + n - 1) % n, 0);
    auto ws = c.send(s, (c.rank() + 1) % n, 0);
    ws->wait();
    wr->wait();
    EXPECT_EQ(to_host(r).f32()[999], static_cast<float>((c.rank() + n - 1) % n));
  }
  c.barrier();
}

TEST_F(NcclTest, SplitAndHostBuffersRefused) {
  auto sub = comm_->split(comm_->rank() % 2, comm_->rank());
  ASSERT_NE(sub, nullptr);
  Tensor d = to_device(Tensor::full({8}, 1.0f));
  sub->allreduce(d, ReduceOp::Sum)->wait();
  EXPECT_EQ(to_host(d).f32()[0], static_cast<float>(sub->size()));
  Tensor host = Tensor::zeros({8});
  EXPECT_THROW(comm_->allreduce(host, ReduceOp::Sum), Error);
}
#else
TEST(Nccl, NotBuilt) { GTEST_SKIP() << "this dtrain was built without NCCL: the NCCL backend is not compiled"; }
#endif

TEST(Nccl, FactoryRefusesWhatItCannotDo) {
  if (nccl_compiled() && cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present: covered by NcclTest";
  EXPECT_THROW(make_nccl_communicator(Runtime::get().world(), 0), Error);
}

}  // namespace

// NCCL backend: device buffers on this rank's GPU, one NCCL stream per communicator, the unique
// id carried by MPI_Bcast over a private MPI communicator (the "shadow", which also gives the
// timeout side channel and the sub-communicators for split). Works complete on a CUDA event;
// waiting polls the event and ncclCommGetAsyncError, so a wait can time out, say which ranks are
// missing, and abort the NCCL communicator instead of hanging in cudaStreamSynchronize.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "control/control_channel.h"
#include "control/phase_deadline.h"
#include "control/sequence_check.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/timer.h"

// One check macro per error domain (nccl, and cuda as comm uses it).
#define DT_NCCL_CHECK(call)                                                                                   \
  do {                                                                                                        \
    ncclResult_t dt_nccl_rc_ = (call);                                                                        \
    if (dt_nccl_rc_ != ncclSuccess)                                                                           \
      ::dtrain::detail::throw_error("nccl", std::string(#call " failed: ") + ncclGetErrorString(dt_nccl_rc_), \
                                    __FILE__, __LINE__);                                                      \
  } while (0)
#define DT_COMM_CUDA_CHECK(call)                                                                              \
  do {                                                                                                        \
    cudaError_t dt_cuda_rc_ = (call);                                                                         \
    if (dt_cuda_rc_ != cudaSuccess)                                                                           \
      ::dtrain::detail::throw_error("cuda", std::string(#call " failed: ") + cudaGetErrorString(dt_cuda_rc_), \
                                    __FILE__, __LINE__);                                                      \
  } while (0)

namespace dtrain::comm {

bool nccl_compiled() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace detail {
namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U8:
      return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  return ncclSum;
}

std::string buf_str(const Tensor& t) { return std::string(dtype_name(t.dtype())) + shape_str(t.shape()); }

}  // namespace

class NcclWork final : public Work {
 public:
  NcclWork(std::string desc, int64_t seq, int peer, ncclComm_t comm, int device, cudaEvent_t ev,
           std::shared_ptr<ControlChannel> channel, double timeout_s, TimeoutAction action, std::vector<Tensor> keep)
      : desc_(std::move(desc)),
        seq_(seq),
        peer_(peer),
        comm_(comm),
        device_(device),
        ev_(ev),
        channel_(std::move(channel)),
        timeout_s_(timeout_s),
        action_(action),
        keep_(std::move(keep)) {}
  ~NcclWork() override {
    if (ev_) cudaEventDestroy(ev_);
  }

  bool test() override {
    if (done_) {
      if (!err_.empty()) DT_CHECK(false, err_);
      return true;
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      done_ = true;
      err_ = desc_ + ": NCCL reported " + ncclGetErrorString(async) + " (" + ncclGetLastError(comm_) + ")";
      DT_CHECK(false, err_);
    }
    cudaError_t q = cudaEventQuery(ev_);
    if (q == cudaErrorNotReady) return false;
    done_ = true;
    keep_.clear();
    if (q != cudaSuccess) {
      err_ = desc_ + ": " + cudaGetErrorString(q);
      DT_CHECK(false, err_);
    }
    if (seq_ > 0) channel_->note_completed(seq_);
    return true;
  }

  void wait(double timeout_s) override {
    const double limit = timeout_s < 0 ? timeout_s_ : timeout_s;
    WaitClock clock;  // a stop of the whole job (SIGSTOP, scontrol suspend) does not count
    StallWatch stall(limit);  // a desync found by any rank ends the wait; a long one asks for a check
    while (!test()) {
      const double waited = clock.waited();
      if (limit > 0 && waited >= limit) on_timeout(limit, waited);
      stall.tick(waited);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  bool order_stream(void* stream) override {
    if (done_) return test();  // rethrows a failure
    DT_COMM_CUDA_CHECK(cudaSetDevice(device_));
    DT_COMM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), ev_, 0));
    return true;
  }

  bool completed() const override { return done_; }
  std::string error() const override { return err_; }
  std::string description() const override { return desc_; }
  int64_t sequence() const override { return seq_; }

 private:
  [[noreturn]] void on_timeout(double limit, double waited) {
    double grace = std::clamp(limit / 4, 0.5, 3.0);
    bool can_query = control_service_running();
    std::vector<PeerStatus> peers = can_query ? channel_->query(grace) : std::vector<PeerStatus>{};
    std::vector<int> missing;
    std::string report = format_timeout_report(desc_, channel_->size(), seq_ > 0 ? seq_ : 0, seq_ > 0 ? -1 : peer_,
                                               waited, grace, peers, can_query, &missing);
    // The NCCL kernels may spin forever: abort the communicator so the GPU is released.
    ncclCommAbort(comm_);
    if (action_ == TimeoutAction::Abort) {
      report += channel_->hang_forensics(report, seq_, peers, grace);
      abort_job(1, "comm timeout: " + report + "\naborting the job", 0.25 * channel_->rank());
    }
    done_ = true;
    err_ = report + " (NCCL communicator aborted)";
    throw CommTimeoutError(report, missing, __FILE__, __LINE__);
  }

  std::string desc_;
  int64_t seq_;
  int peer_;
  ncclComm_t comm_;
  int device_;
  cudaEvent_t ev_;
  std::shared_ptr<ControlChannel> channel_;
  double timeout_s_;
  TimeoutAction action_;
  std::vector<Tensor> keep_;  // buffers stay alive until the event fires
  bool done_ = false;
  std::string err_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Communicator> shadow, ncclComm_t comm, int device, std::string name)
      : Communicator(shadow->rank(), shadow->size(), std::move(name)),
        shadow_(std::move(shadow)),
        comm_(comm),
        device_(device) {
    DT_COMM_CUDA_CHECK(cudaSetDevice(device_));
    DT_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DT_COMM_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    channel_ = std::make_shared<ControlChannel>(mpi_comm_of(*shadow_), this->name(), recorder());
    if (Runtime::initialized() && Runtime::get().threaded_progress()) control_service_add(channel_);
    timeout_s_ = shadow_->timeout();
  }

  ~NcclCommunicator() override {
    control_service_remove(channel_.get());
    channel_->release();
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
    cudaFree(scratch_);
  }

  const char* backend() const override { return "nccl"; }
  bool supports(Device d) const override { return d.type == DeviceType::CUDA && d.index == device_; }
  cudaStream_t stream() const { return stream_; }
  void set_input_stream(cudaStream_t s) { input_ = s; }

 protected:
  std::shared_ptr<Work> do_allreduce(Tensor& t, ReduceOp op) override {
    return launch("allreduce", buf_str(t) + " " + reduce_op_name(op), true, -1, {t}, [&](cudaStream_t s) {
      return ncclAllReduce(t.device_raw(), t.device_raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                           nccl_op(op), comm_, s);
    });
  }
  std::shared_ptr<Work> do_broadcast(Tensor& t, int root) override {
    return launch("broadcast", buf_str(t) + " root " + std::to_string(root), true, -1, {t}, [&](cudaStream_t s) {
      return ncclBroadcast(t.device_raw(), t.device_raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), root,
                           comm_, s);
    });
  }
  std::shared_ptr<Work> do_allgather(const Tensor& in, Tensor& out) override {
    return launch("allgather", buf_str(in), true, -1, {in, out}, [&](cudaStream_t s) {
      return ncclAllGather(in.device_raw(), out.device_raw(), static_cast<size_t>(in.numel()), nccl_type(in.dtype()),
                           comm_, s);
    });
  }
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    return launch("reduce_scatter", buf_str(in) + " " + reduce_op_name(op), true, -1, {in, out}, [&](cudaStream_t s) {
      return ncclReduceScatter(in.device_raw(), out.device_raw(), static_cast<size_t>(out.numel()),
                               nccl_type(in.dtype()), nccl_op(op), comm_, s);
    });
  }
  std::shared_ptr<Work> do_send(const Tensor& t, int peer, int tag) override {
    // NCCL has no tags: sends and receives between two ranks match in the order they are issued.
    return launch("send", buf_str(t) + " to rank " + std::to_string(peer) + " tag " + std::to_string(tag), false, peer,
                  {t}, [&](cudaStream_t s) {
                    return ncclSend(t.device_raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm_,
                                    s);
                  });
  }
  std::shared_ptr<Work> do_recv(Tensor& t, int peer, int tag) override {
    return launch("recv", buf_str(t) + " from rank " + std::to_string(peer) + " tag " + std::to_string(tag), false,
                  peer, {t}, [&](cudaStream_t s) {
                    return ncclRecv(t.device_raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm_,
                                    s);
                  });
  }
  std::shared_ptr<Work> do_barrier() override {
    return launch("barrier", "", true, -1, {},
                  [&](cudaStream_t s) { return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, s); });
  }
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override {
    auto sub_shadow = shadow_->split(color, key, name + "/bootstrap");
    ncclComm_t sub = nullptr;
    DT_COMM_CUDA_CHECK(cudaSetDevice(device_));
    {  // a rank that died or never came waits NCCL's split forever
      PhaseDeadline deadline("splitting NCCL communicator '" + this->name() + "' into '" + name + "'", timeout_s_,
                             PhaseDeadline::Ending::abort_job);
      DT_NCCL_CHECK(ncclCommSplit(comm_, color == kNoColor ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    }
    if (!sub_shadow || !sub) return nullptr;
    auto c = std::make_unique<NcclCommunicator>(std::move(sub_shadow), sub, device_, name);
    c->set_input_stream(input_);  // a sub-communicator's collectives wait for the same compute stream
    c->set_timeout(timeout_s_);
    c->set_timeout_action(timeout_action_);
    return c;
  }

 private:
  template <class F>
  std::shared_ptr<Work> launch(const char* what, const std::string& args, bool collective, int peer,
                               std::vector<Tensor> keep, F&& enqueue) {
    DT_COMM_CUDA_CHECK(cudaSetDevice(device_));
    if (input_) {
      // Order after the producer's stream with an event, never with a host synchronisation.
      cudaEvent_t ready;
      DT_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      DT_COMM_CUDA_CHECK(cudaEventRecord(ready, input_));
      DT_COMM_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
      cudaEventDestroy(ready);
    }
    int64_t seq = collective ? next_sequence() : 0;
    std::string desc = std::string(what) + (collective ? " #" + std::to_string(seq) : std::string()) +
                       (args.empty() ? "" : " " + args) + " on '" + name() + "'";
    if (collective) channel_->note_entered(seq, desc);
    DT_NCCL_CHECK(enqueue(stream_));
    cudaEvent_t done;
    DT_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DT_COMM_CUDA_CHECK(cudaEventRecord(done, stream_));
    return std::make_shared<NcclWork>(desc, seq, peer, comm_, device_, done, channel_, timeout_s_, timeout_action_,
                                      std::move(keep));
  }

  std::unique_ptr<Communicator> shadow_;
  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t input_ = nullptr;
  void* scratch_ = nullptr;
  std::shared_ptr<ControlChannel> channel_;
};

}  // namespace detail

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device, const std::string& name) {
  DT_CHECK(mpi_comm_of(bootstrap) != MPI_COMM_NULL,
           "make_nccl_communicator: the bootstrap communicator must use the MPI backend, not " << bootstrap.backend());
  int devices = cuda_device_count();
  DT_CHECK(device >= 0 && device < devices,
           "make_nccl_communicator: CUDA device " << device << " does not exist (" << devices << " visible)");
  auto shadow = make_mpi_communicator(mpi_comm_of(bootstrap), name + "/bootstrap");
  // Rank 0 makes the unique id; MPI_Bcast carries it to the others.
  Tensor id = Tensor::zeros({static_cast<int64_t>(sizeof(ncclUniqueId))}, DType::U8);
  if (shadow->rank() == 0) DT_NCCL_CHECK(ncclGetUniqueId(reinterpret_cast<ncclUniqueId*>(id.device_raw())));
  shadow->broadcast(id, 0)->wait();
  ncclUniqueId uid;
  std::memcpy(&uid, id.device_raw(), sizeof uid);
  DT_COMM_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  {  // a rank that died or never came waits NCCL's set-up forever
    detail::PhaseDeadline deadline("setting up NCCL communicator '" + name + "' (ncclCommInitRank)", shadow->timeout(),
                                   detail::PhaseDeadline::Ending::abort_job);
    DT_NCCL_CHECK(ncclCommInitRank(&comm, shadow->size(), uid, shadow->rank()));
  }
  return std::make_unique<detail::NcclCommunicator>(std::move(shadow), comm, device, name);
}

void* nccl_stream(Communicator& c) {
  auto* n = dynamic_cast<detail::NcclCommunicator*>(&c);
  DT_CHECK(n, "nccl_stream: '" << c.name() << "' uses the " << c.backend() << " backend, not nccl");
  return n->stream();
}

void nccl_set_input_stream(Communicator& c, void* stream) {
  auto* n = dynamic_cast<detail::NcclCommunicator*>(&c);
  DT_CHECK(n, "nccl_set_input_stream: '" << c.name() << "' uses the " << c.backend() << " backend, not nccl");
  n->set_input_stream(static_cast<cudaStream_t>(stream));
}

}  // namespace dtrain::comm

// CudaEngine: construction, streams, the registry entry points, and the contract's element-wise,
// reduction, row-wise and optimizer operations (each a checked call into a kernels.h launcher).
#include "cuda_engine.h"

#include <cmath>
#include <cstddef>
#include <cstring>

#include "caching_allocator.h"
#include "cuda_common.h"
#include "cuda_install.h"
#include "kernels.h"
#include "plans.h"

namespace dtrain::cuda {

namespace {

void check_dev(const Tensor& t, const char* what, int index, DType dtype = DType::F32) {
  DT_CHECK(t.defined() && t.dtype() == dtype && t.device() == Device::cuda(index),
           what << " must be a " << dtype_name(dtype) << " tensor on cuda:" << index << ", got "
                << (t.defined() ? t.str() : "undefined"));
}

void check_same_numel(const Tensor& a, const Tensor& b, const char* op) {
  DT_CHECK(a.numel() == b.numel(), op << ": " << a.str() << " and " << b.str() << " differ in size");
}

// Offsets of the reduction results inside the engine's 64-byte scalar area.
constexpr size_t kOffDouble = 0;  // f64 sum
constexpr size_t kOffCount = 8;   // u64 count
constexpr size_t kOffFlag = 16;   // i32 flag
constexpr size_t kOffFlagF = 20;  // f32 flag

}  // namespace

// ------------------------------------------------------------------ registry entry points
namespace detail {

int install() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: CUDA stays unavailable
    return 0;
  }
  if (n > 0)
    register_allocator(DeviceType::CUDA, [](size_t bytes, Device d) {
      CachingAllocator& a = allocator_for(d.index);
      void* p = a.allocate(bytes);
      return std::make_shared<Storage>(p, bytes, d, [&a](void* q) { a.release(q); });
    });
  return n;
}

std::unique_ptr<Engine> make_engine(int device_index) { return std::make_unique<CudaEngine>(device_index); }

}  // namespace detail

CudaEngine& cuda_engine(int index) {
  DT_CHECK(enable_cuda() > index, "cuda:" << index << " is not available (" << enable_cuda() << " GPUs visible)");
  auto* e = dynamic_cast<CudaEngine*>(&engine_for(Device::cuda(index)));
  DT_CHECK(e, "the engine of cuda:" << index << " is not dtrain's CUDA engine");
  return *e;
}

void* compute_stream(int device) { return cuda_engine(device).compute(); }
void* comm_stream(int device) { return cuda_engine(device).comm(); }
void comm_waits_for_compute(int device) { cuda_engine(device).comm_waits_for_compute(); }
void compute_waits_for_comm(int device) { cuda_engine(device).compute_waits_for_comm(); }

std::shared_ptr<void> upload_async(const Tensor& pinned_src, Tensor& dst) {
  cudaEvent_t ev = cuda_engine(dst.device().index).upload_async(pinned_src, dst);
  return std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

void compute_waits_for(const std::shared_ptr<void>& uploaded, int device) {
  if (uploaded) cuda_engine(device).compute_waits_for(static_cast<cudaEvent_t>(uploaded.get()));
}

void host_waits_for(const std::shared_ptr<void>& uploaded) {
  if (uploaded) DT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(uploaded.get())));
}

std::string library_versions() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);  // 0 without a driver: not an error here
  auto dotted = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  return "CUDA runtime " + dotted(runtime) + ", driver " + (driver ? dotted(driver) : std::string("none")) +
         ", cuDNN " + std::to_string(cudnnGetVersion());
}

DeviceInfo device_info(int device) {
  cudaDeviceProp p{};
  DT_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  int clock_khz = 0;
  DT_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  DeviceInfo info;
  info.name = p.name;
  info.compute_capability = p.major * 10 + p.minor;
  info.sms = p.multiProcessorCount;
  info.clock_ghz = clock_khz * 1e-6;
  info.memory_gib = static_cast<double>(p.totalGlobalMem) / (1u << 30);
  // Dense FLOP per SM per clock (an FMA counts 2), from the architecture whitepapers:
  // A100 (8.0): 128 fp32, 1024 tf32, 2048 bf16; H100 (9.0): 256 fp32, 2048 tf32, 4096 bf16.
  double fp32 = 0, tf32 = 0, bf16 = 0;
  if (info.compute_capability == 80)
    fp32 = 128, tf32 = 1024, bf16 = 2048;
  else if (info.compute_capability >= 90 && info.compute_capability < 100)
    fp32 = 256, tf32 = 2048, bf16 = 4096;
  else if (info.compute_capability >= 86 && info.compute_capability < 90)
    fp32 = 256, tf32 = 512, bf16 = 1024;
  double sm_ghz = info.sms * info.clock_ghz * 1e-3;  // TFLOP/s per FLOP/clk/SM
  info.peak_fp32 = fp32 * sm_ghz;
  info.peak_tf32 = tf32 * sm_ghz;
  info.peak_bf16 = bf16 * sm_ghz;
  return info;
}

// ------------------------------------------------------------------ engine lifetime and streams
CudaEngine::CudaEngine(int device_index) : index_(device_index) {
  bind();
  // Non-blocking streams: no implicit ordering with the legacy default stream either.
  DT_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  DT_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
  DT_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  DT_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  DT_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
  DT_CUBLAS_CHECK(cublasLtCreate(&lt_));
  DT_CUDNN_CHECK(cudnnCreate(&dnn_));
  DT_CUDNN_CHECK(cudnnSetStream(dnn_, compute_));
  scalars_ = Tensor::empty({64}, DType::U8, device());
  DT_CUDA_CHECK(cudaHostAlloc(&host_scalars_, 64, cudaHostAllocDefault));
}

CudaEngine::~CudaEngine() {
  // Runs at exit; errors cannot be reported any more, so they are ignored.
  cudaSetDevice(index_);
  cudaStreamSynchronize(compute_);
  cudaStreamSynchronize(comm_);
  cudaStreamSynchronize(copy_);
  gemm_plans_.clear();
  conv_plans_.clear();
  pool_plans_.clear();
  bn_plans_.clear();
  if (dnn_) cudnnDestroy(dnn_);
  if (lt_) cublasLtDestroy(lt_);
  cudaEventDestroy(compute_done_);
  cudaEventDestroy(comm_done_);
  cudaStreamDestroy(compute_);
  cudaStreamDestroy(comm_);
  cudaStreamDestroy(copy_);
  if (host_scalars_) cudaFreeHost(host_scalars_);
}

std::string CudaEngine::describe() const {
  DeviceInfo d = device_info(index_);
  return "cuda:" + std::to_string(index_) + " (" + d.name + ", sm_" + std::to_string(d.compute_capability) + ", " +
         std::to_string(d.sms) + " SMs, cuDNN " + std::to_string(cudnnGetVersion()) + ", math " +
         math_precision_name(math_) + ")";
}

void CudaEngine::bind() const { DT_CUDA_CHECK(cudaSetDevice(index_)); }

void CudaEngine::synchronize() { DT_CUDA_CHECK(cudaStreamSynchronize(compute_)); }

// Why events and not a host sync: the host keeps queueing backward kernels while the comm stream
// waits on the device for exactly the work recorded so far.
void CudaEngine::comm_waits_for_compute() {
  DT_CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
  DT_CUDA_CHECK(cudaStreamWaitEvent(comm_, compute_done_, 0));
}

void CudaEngine::compute_waits_for_comm() {
  DT_CUDA_CHECK(cudaEventRecord(comm_done_, comm_));
  DT_CUDA_CHECK(cudaStreamWaitEvent(compute_, comm_done_, 0));
}

// The copy waits (on the device) for the compute work queued so far: dst's last readers, and any
// kernel still using memory the allocator handed out again as dst (it reuses blocks in compute
// order). Its own event lets the compute stream wait for exactly this batch.
cudaEvent_t CudaEngine::upload_async(const Tensor& pinned_src, Tensor& dst) {
  DT_CHECK(pinned_src.device().is_cpu() && dst.device() == device() && pinned_src.nbytes() == dst.nbytes(),
           "upload_async " << pinned_src.str() << " -> " << dst.str() << " on the engine of " << device().str());
  cudaPointerAttributes attr{};
  const cudaError_t probe = cudaPointerGetAttributes(&attr, pinned_src.device_raw());
  if (probe != cudaSuccess) (void)cudaGetLastError();  // clears the probe's own error only
  const bool pinned = probe == cudaSuccess && attr.type == cudaMemoryTypeHost;
  DT_CHECK(pinned, "upload_async needs a page-locked source (cuda::pinned_empty), got " << pinned_src.str());
  bind();
  cudaEvent_t before = nullptr, done = nullptr;
  DT_CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
  DT_CUDA_CHECK(cudaEventRecord(before, compute_));
  DT_CUDA_CHECK(cudaStreamWaitEvent(copy_, before, 0));
  cudaEventDestroy(before);  // released once it fired; the wait above is already queued
  DT_CUDA_CHECK(
      cudaMemcpyAsync(dst.device_raw(), pinned_src.device_raw(), pinned_src.nbytes(), cudaMemcpyHostToDevice, copy_));
  DT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  DT_CUDA_CHECK(cudaEventRecord(done, copy_));
  return done;
}

void CudaEngine::compute_waits_for(cudaEvent_t ev) {
  bind();
  DT_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev, 0));
}

void* CudaEngine::workspace(size_t bytes) {
  if (!workspace_.defined() || workspace_.nbytes() < bytes) {
    // The old buffer may still be used by queued work: the allocator reuses it only in stream order.
    // Made on the first GEMM or convolution, at least as large as one cuBLASLt call may ask for, so
    // that a new shape (an epoch's short last batch) does not allocate inside a step.
    const size_t size = std::max(bytes, kGemmWorkspaceBytes);
    workspace_ = Tensor::empty({static_cast<int64_t>(size)}, DType::U8, device());
  }
  return bytes ? workspace_.device_raw() : nullptr;
}

Tensor CudaEngine::lowp_copy(const Tensor& src, DType dtype) {
  Tensor t = Tensor::empty({src.numel()}, dtype, device());
  k::cast(src.device_raw(), src.dtype(), t.device_raw(), dtype, src.numel(), compute_);
  return t;
}

void CudaEngine::read_back(const void* dev, void* host, size_t bytes) {
  DT_CUDA_CHECK(cudaMemcpyAsync(host_scalars_, dev, bytes, cudaMemcpyDeviceToHost, compute_));
  DT_CUDA_CHECK(cudaStreamSynchronize(compute_));
  std::memcpy(host, host_scalars_, bytes);
}

// ------------------------------------------------------------------ element-wise
void CudaEngine::unary_forward(Unary op, const Tensor& x, Tensor& y) {
  check_dev(x, "unary input", index_);
  check_dev(y, "unary output", index_);
  check_same_numel(x, y, "unary_forward");
  bind();
  k::unary_forward(op, x.device_f32(), y.device_f32(), x.numel(), compute_);
}

void CudaEngine::unary_backward(Unary op, const Tensor& x, const Tensor& dy, Tensor& dx) {
  check_dev(x, "x", index_);
  check_dev(dy, "dy", index_);
  check_dev(dx, "dx", index_);
  check_same_numel(x, dy, "unary_backward");
  check_same_numel(x, dx, "unary_backward");
  bind();
  k::unary_backward(op, x.device_f32(), dy.device_f32(), dx.device_f32(), x.numel(), compute_);
}

void CudaEngine::dropout_forward(const Tensor& x, float p, uint64_t seed, Tensor& mask, Tensor& y) {
  check_dev(x, "dropout input", index_);
  check_dev(mask, "dropout mask", index_);
  DT_CHECK(p >= 0.f && p < 1.f, "dropout probability must be in [0, 1), got " << p);
  check_same_numel(x, mask, "dropout_forward");
  bind();
  k::dropout_mask(mask.device_f32(), p, seed, mask.numel(), compute_);
  mul(x, mask, y);
}

void CudaEngine::mul(const Tensor& a, const Tensor& b, Tensor& y) {
  check_dev(a, "a", index_);
  check_dev(b, "b", index_);
  check_dev(y, "y", index_);
  check_same_numel(a, y, "mul");
  check_same_numel(b, y, "mul");
  bind();
  k::mul(a.device_f32(), b.device_f32(), y.device_f32(), y.numel(), compute_);
}

void CudaEngine::add(const Tensor& a, const Tensor& b, Tensor& y) {
  check_dev(a, "a", index_);
  check_dev(b, "b", index_);
  check_dev(y, "y", index_);
  check_same_numel(a, y, "add");
  check_same_numel(b, y, "add");
  bind();
  k::add(a.device_f32(), b.device_f32(), y.device_f32(), y.numel(), compute_);
}

void CudaEngine::axpy(float alpha, const Tensor& x, Tensor& y) {
  check_dev(x, "x", index_);
  check_dev(y, "y", index_);
  check_same_numel(x, y, "axpy");
  bind();
  k::axpy(alpha, x.device_f32(), y.device_f32(), y.numel(), compute_);
}

void CudaEngine::scale(Tensor& y, float alpha) {
  check_dev(y, "y", index_);
  bind();
  k::scale(y.device_f32(), alpha, y.numel(), compute_);
}

void CudaEngine::fill(Tensor& y, float value) {
  DT_CHECK(y.defined() && y.device() == device(),
           "fill: " << (y.defined() ? y.str() : "undefined") << " is not on " << device().str());
  bind();
  if (value == 0.f) {
    DT_CUDA_CHECK(cudaMemsetAsync(y.device_raw(), 0, y.nbytes(), compute_));
    return;
  }
  check_dev(y, "fill of a non-zero value: y", index_);
  k::fill(y.device_f32(), value, y.numel(), compute_);
}

void CudaEngine::copy(const Tensor& src, Tensor& dst) {
  DT_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype(), "copy " << src.str() << " into " << dst.str());
  DT_CHECK(src.device() == device() || dst.device() == device(),
           "copy " << src.str() << " -> " << dst.str() << " on the engine of " << device().str());
  DT_CHECK((src.device().is_cpu() || src.device() == device()) && (dst.device().is_cpu() || dst.device() == device()),
           "copy between two GPUs (" << src.str() << " -> " << dst.str() << ") is not a single engine's job");
  if (src.nbytes() == 0) return;
  bind();
  DT_CUDA_CHECK(cudaMemcpyAsync(dst.device_raw(), src.device_raw(), src.nbytes(), cudaMemcpyDefault, compute_));
  // A pageable host buffer may be reused as soon as copy returns, so a copy involving one waits;
  // pinned buffers (cudaHostAlloc) stay asynchronous, which lets the next batch's upload overlap.
  const void* host = src.device().is_cpu() ? src.device_raw() : (dst.device().is_cpu() ? dst.device_raw() : nullptr);
  if (host) {
    cudaPointerAttributes attr{};
    const cudaError_t probe = cudaPointerGetAttributes(&attr, host);
    if (probe != cudaSuccess) (void)cudaGetLastError();  // clears the probe's own error only
    const bool pinned = probe == cudaSuccess && attr.type == cudaMemoryTypeHost;
    if (!pinned || dst.device().is_cpu()) DT_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }
}

void CudaEngine::cast(const Tensor& src, Tensor& dst) {
  DT_CHECK(src.device() == device() && dst.device() == device(), "cast " << src.str() << " -> " << dst.str());
  check_same_numel(src, dst, "cast");
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  auto lowp = [](DType t) { return t == DType::BF16 || t == DType::F16; };
  DT_CHECK((src.dtype() == DType::F32 && lowp(dst.dtype())) || (lowp(src.dtype()) && dst.dtype() == DType::F32),
           "cast from " << dtype_name(src.dtype()) << " to " << dtype_name(dst.dtype()) << " is not defined");
  bind();
  k::cast(src.device_raw(), src.dtype(), dst.device_raw(), dst.dtype(), src.numel(), compute_);
}

void CudaEngine::add_row_bias(Tensor& y, const Tensor& bias) {
  check_dev(y, "y", index_);
  check_dev(bias, "bias", index_);
  int64_t n = bias.numel();
  DT_CHECK(n > 0 && y.numel() % n == 0, "add_row_bias " << y.str() << " + " << bias.str());
  bind();
  k::add_row_bias(y.device_f32(), bias.device_f32(), y.numel() / n, n, compute_);
}

void CudaEngine::row_bias_grad(const Tensor& dy, Tensor& dbias) {
  check_dev(dy, "dy", index_);
  check_dev(dbias, "dbias", index_);
  int64_t n = dbias.numel();
  DT_CHECK(n > 0 && dy.numel() % n == 0, "row_bias_grad " << dy.str() << " -> " << dbias.str());
  bind();
  k::row_bias_grad(dy.device_f32(), dbias.device_f32(), dy.numel() / n, n, compute_);
}

double CudaEngine::sum_squares(const Tensor& x) {
  check_dev(x, "sum_squares input", index_);
  bind();
  auto* acc = reinterpret_cast<double*>(static_cast<char*>(scalars_.device_raw()) + kOffDouble);
  DT_CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(double), compute_));
  k::sum_squares(x.device_f32(), x.numel(), acc, compute_);
  double s = 0;
  read_back(acc, &s, sizeof s);
  return s;
}

bool CudaEngine::all_finite(const Tensor& x) {
  check_dev(x, "all_finite input", index_);
  bind();
  auto* flag = reinterpret_cast<float*>(static_cast<char*>(scalars_.device_raw()) + kOffFlagF);
  DT_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(float), compute_));
  k::check_finite(x.device_f32(), x.numel(), flag, compute_);
  float f = 0;
  read_back(flag, &f, sizeof f);
  return f == 0.f;
}

void CudaEngine::unscale_and_check(Tensor& x, float inv_scale, Tensor& found_inf) {
  check_dev(x, "unscale_and_check input", index_);
  check_dev(found_inf, "found_inf", index_);
  bind();
  k::unscale_and_check(x.device_f32(), inv_scale, x.numel(), found_inf.device_f32(), compute_);
}

// ------------------------------------------------------------------ softmax cross-entropy, LayerNorm
double CudaEngine::softmax_xent_forward(const Tensor& logits, const Tensor& labels, Tensor& probs, int64_t* correct) {
  check_dev(logits, "logits", index_);
  check_dev(labels, "labels", index_, DType::I32);
  check_dev(probs, "probs", index_);
  DT_CHECK(logits.dim() == 2 && labels.numel() == logits.size(0) && probs.numel() == logits.numel(),
           "softmax_xent: logits " << logits.str() << ", labels " << labels.str() << ", probs " << probs.str());
  bind();
  char* sc = static_cast<char*>(scalars_.device_raw());
  DT_CUDA_CHECK(cudaMemsetAsync(sc, 0, 24, compute_));
  k::softmax_xent_forward(logits.device_f32(), labels.device_data<int32_t>(), probs.device_f32(), logits.size(0),
                          logits.size(1), reinterpret_cast<double*>(sc + kOffDouble),
                          reinterpret_cast<unsigned long long*>(sc + kOffCount), reinterpret_cast<int*>(sc + kOffFlag),
                          compute_);
  char host[24];
  read_back(sc, host, sizeof host);
  int bad = 0;
  std::memcpy(&bad, host + kOffFlag, sizeof bad);
  DT_CHECK(!bad, "a label is out of range [0, " << logits.size(1) << ")");
  double loss = 0;
  unsigned long long hits = 0;
  std::memcpy(&loss, host + kOffDouble, sizeof loss);
  std::memcpy(&hits, host + kOffCount, sizeof hits);
  if (correct) *correct = static_cast<int64_t>(hits);
  return loss;
}

void CudaEngine::softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, Tensor& probs, Tensor& stats) {
  check_dev(logits, "logits", index_);
  check_dev(labels, "labels", index_, DType::I32);
  check_dev(probs, "probs", index_);
  check_dev(stats, "xent stats", index_);
  DT_CHECK(logits.dim() == 2 && labels.numel() == logits.size(0) && probs.numel() == logits.numel(),
           "softmax_xent: logits " << logits.str() << ", labels " << labels.str() << ", probs " << probs.str());
  DT_CHECK(stats.numel() == kXentStatsFloats, "xent stats must be " << kXentStatsFloats << " f32, got " << stats.str());
  static_assert(offsetof(XentStats, loss_sum) == kOffDouble && offsetof(XentStats, hits) == kOffCount &&
                offsetof(XentStats, bad_label) == kOffFlag);
  bind();
  // The kernel adds into the three fields (atomics), so the running totals stay on the device.
  char* sc = static_cast<char*>(stats.device_raw());
  k::softmax_xent_forward(logits.device_f32(), labels.device_data<int32_t>(), probs.device_f32(), logits.size(0),
                          logits.size(1), reinterpret_cast<double*>(sc + kOffDouble),
                          reinterpret_cast<unsigned long long*>(sc + kOffCount), reinterpret_cast<int*>(sc + kOffFlag),
                          compute_);
}

void CudaEngine::softmax_xent_backward(const Tensor& probs, const Tensor& labels, float scale, Tensor& dlogits) {
  check_dev(probs, "probs", index_);
  check_dev(labels, "labels", index_, DType::I32);
  check_dev(dlogits, "dlogits", index_);
  DT_CHECK(probs.dim() == 2 && labels.numel() == probs.size(0), "softmax_xent_backward: probs " << probs.str());
  check_same_numel(probs, dlogits, "softmax_xent_backward");
  bind();
  k::softmax_xent_backward(probs.device_f32(), labels.device_data<int32_t>(), scale, dlogits.device_f32(),
                           probs.size(0), probs.size(1), compute_);
}

void CudaEngine::row_max(const Tensor& x, Tensor& out) {
  check_dev(x, "row_max input", index_);
  check_dev(out, "row_max output", index_);
  DT_CHECK(x.dim() == 2 && out.numel() == x.size(0), "row_max of " << x.str() << " into " << out.str());
  bind();
  k::row_max(x.device_f32(), out.device_f32(), x.size(0), x.size(1), compute_);
}

void CudaEngine::softmax_rows(const Tensor& x, float scale, Tensor& y) {
  check_dev(x, "softmax_rows input", index_);
  check_dev(y, "softmax_rows output", index_);
  DT_CHECK(x.dim() == 2 && y.numel() == x.numel(), "softmax_rows of " << x.str() << " into " << y.str());
  bind();
  k::softmax_rows(x.device_f32(), scale, y.device_f32(), x.size(0), x.size(1), compute_);
}

void CudaEngine::vocab_xent_partials(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                     Tensor& sumexp, Tensor& target) {
  check_dev(logits, "logits", index_);
  check_dev(labels, "labels", index_, DType::I32);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&rowmax, &sumexp, &target})
    check_dev(*t, "vocab_xent row vector", index_);
  const int64_t m = logits.size(0);
  DT_CHECK(
      logits.dim() == 2 && labels.numel() == m && rowmax.numel() == m && sumexp.numel() == m && target.numel() == m,
      "vocab_xent_partials: logits " << logits.str() << ", labels " << labels.str());
  bind();
  k::vocab_xent_partials(logits.device_f32(), labels.device_data<int32_t>(), offset, rowmax.device_f32(),
                         sumexp.device_f32(), target.device_f32(), m, logits.size(1), compute_);
}

void CudaEngine::vocab_xent_loss_accumulate(const Tensor& rowmax, const Tensor& sumexp, const Tensor& target,
                                            const Tensor& labels, Tensor& stats) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&rowmax, &sumexp, &target, &stats})
    check_dev(*t, "vocab_xent_loss_accumulate", index_);
  const int64_t m = rowmax.numel();
  DT_CHECK(labels.dtype() == DType::I32 && labels.device() == rowmax.device() && labels.numel() == m,
           "vocab_xent_loss_accumulate: labels " << labels.str() << " for " << m << " rows");
  DT_CHECK(sumexp.numel() == m && target.numel() == m && stats.numel() == kXentStatsFloats,
           "vocab_xent_loss_accumulate: " << rowmax.str() << ", " << sumexp.str() << ", " << target.str() << ", stats "
                                          << stats.str());
  bind();
  char* st = static_cast<char*>(stats.device_raw());
  k::vocab_xent_loss(rowmax.device_f32(), sumexp.device_f32(), target.device_f32(), labels.device_data<int32_t>(), m,
                     reinterpret_cast<double*>(st + kOffDouble), reinterpret_cast<unsigned long long*>(st + kOffCount),
                     compute_);
}

void CudaEngine::vocab_xent_backward(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                     const Tensor& sumexp, float scale, Tensor& dlogits) {
  check_dev(logits, "logits", index_);
  check_dev(labels, "labels", index_, DType::I32);
  check_dev(dlogits, "dlogits", index_);
  check_dev(rowmax, "vocab_xent rowmax", index_);
  check_dev(sumexp, "vocab_xent sumexp", index_);
  DT_CHECK(
      logits.dim() == 2 && labels.numel() == logits.size(0) && rowmax.numel() == logits.size(0) &&
          sumexp.numel() == logits.size(0),
      "vocab_xent_backward: logits " << logits.str() << ", rowmax " << rowmax.str() << ", sumexp " << sumexp.str());
  check_same_numel(logits, dlogits, "vocab_xent_backward");
  bind();
  k::vocab_xent_backward(logits.device_f32(), labels.device_data<int32_t>(), offset, rowmax.device_f32(),
                         sumexp.device_f32(), scale, dlogits.device_f32(), logits.size(0), logits.size(1), compute_);
}

void CudaEngine::layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& mean,
                                   Tensor& rstd, Tensor& y) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &gamma, &beta, &mean, &rstd, &y})
    check_dev(*t, "layernorm tensor", index_);
  int64_t d = gamma.numel();
  DT_CHECK(d > 0 && x.size(-1) == d && y.numel() == x.numel() && mean.numel() == x.numel() / d &&
               rstd.numel() == x.numel() / d && beta.numel() == d,
           "layernorm over " << d << " features of " << x.str());
  bind();
  k::layernorm_forward(x.device_f32(), gamma.device_f32(), beta.device_f32(), eps, mean.device_f32(), rstd.device_f32(),
                       y.device_f32(), x.numel() / d, d, compute_);
}

void CudaEngine::layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                                    const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &dy, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta})
    check_dev(*t, "layernorm tensor", index_);
  int64_t d = gamma.numel();
  DT_CHECK(d > 0 && x.size(-1) == d && dy.numel() == x.numel() && dx.numel() == x.numel() &&
               mean.numel() == x.numel() / d && rstd.numel() == x.numel() / d && dgamma.numel() == d &&
               dbeta.numel() == d,
           "layernorm_backward over " << d << " features of " << x.str());
  bind();
  k::layernorm_backward(x.device_f32(), dy.device_f32(), gamma.device_f32(), mean.device_f32(), rstd.device_f32(),
                        dx.device_f32(), dgamma.device_f32(), dbeta.device_f32(), x.numel() / d, d, compute_);
}

void CudaEngine::rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& rstd, Tensor& y) {
  const int64_t d = gamma.numel();
  DT_CHECK(d > 0 && x.size(-1) == d, "rmsnorm over " << d << " features of " << x.str());
  const int64_t m = x.numel() / d;
  DT_CHECK(y.numel() == x.numel() && rstd.numel() == m,
           "rmsnorm of " << x.str() << " into " << y.str() << ", rstd " << rstd.str());
  bind();
  k::rmsnorm_forward(x.device_f32(), gamma.device_f32(), eps, rstd.device_f32(), y.device_f32(), m, d, compute_);
}

void CudaEngine::rmsnorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd,
                                  Tensor& dx, Tensor& dgamma) {
  const int64_t d = gamma.numel();
  const int64_t m = x.numel() / d;
  DT_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dgamma.numel() == d && rstd.numel() == m,
           "rmsnorm_backward of " << x.str() << " with dy " << dy.str() << " into " << dx.str());
  bind();
  k::rmsnorm_backward(x.device_f32(), dy.device_f32(), gamma.device_f32(), rstd.device_f32(), dx.device_f32(),
                      dgamma.device_f32(), m, d, compute_);
}

// ------------------------------------------------------------------ per-channel reductions (SyncBatchNorm)
namespace {
struct NchwView {
  int64_t n, c, hw;
};
NchwView nchw(const Tensor& x, int64_t channels) {
  DT_CHECK(x.dim() >= 2 && x.size(1) == channels, "per-channel op over " << channels << " channels of " << x.str());
  return {x.size(0), channels, x.numel() / (x.size(0) * channels)};
}
}  // namespace

void CudaEngine::channel_sums(const Tensor& x, int64_t channels, Tensor& sum, Tensor& sumsq) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &sum, &sumsq}) check_dev(*t, "channel_sums", index_);
  NchwView v = nchw(x, channels);
  DT_CHECK(sum.numel() == channels && sumsq.numel() == channels,
           "channel_sums into " << sum.str() << ", " << sumsq.str());
  bind();
  k::channel_reduce(x.device_f32(), nullptr, sum.device_f32(), sumsq.device_f32(), v.n, v.c, v.hw, compute_);
}

void CudaEngine::channel_dot(const Tensor& a, const Tensor& b, int64_t channels, Tensor& out) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&a, &b, &out}) check_dev(*t, "channel_dot", index_);
  check_same_numel(a, b, "channel_dot");
  NchwView v = nchw(a, channels);
  DT_CHECK(out.numel() == channels, "channel_dot into " << out.str());
  bind();
  k::channel_reduce(a.device_f32(), b.device_f32(), out.device_f32(), nullptr, v.n, v.c, v.hw, compute_);
}

void CudaEngine::channel_affine(const Tensor& x, int64_t channels, const Tensor& scale, const Tensor& shift,
                                Tensor& y) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &scale, &shift, &y})
    check_dev(*t, "channel_affine", index_);
  check_same_numel(x, y, "channel_affine");
  NchwView v = nchw(x, channels);
  bind();
  k::channel_affine(x.device_f32(), scale.device_f32(), shift.device_f32(), y.device_f32(), v.n, v.c, v.hw, compute_);
}

// ------------------------------------------------------------------ optimizer updates
void CudaEngine::sgd_update(Tensor& param, const Tensor& grad, Tensor& buf, float lr, float momentum, float dampening,
                            float weight_decay, bool nesterov) {
  check_dev(param, "param", index_);
  check_dev(grad, "grad", index_);
  check_same_numel(param, grad, "sgd_update");
  float* b = nullptr;
  if (momentum != 0.f) {
    check_dev(buf, "momentum buffer", index_);
    check_same_numel(param, buf, "sgd_update");
    b = buf.device_f32();
  }
  bind();
  k::sgd_update(param.device_f32(), grad.device_f32(), b, param.numel(), lr, momentum, dampening, weight_decay,
                nesterov, compute_);
}

void CudaEngine::adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1,
                             float beta2, float eps, float weight_decay, bool decoupled, int64_t step) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v})
    check_dev(*t, "adam tensor", index_);
  check_same_numel(param, grad, "adam_update");
  check_same_numel(param, m, "adam_update");
  check_same_numel(param, v, "adam_update");
  DT_CHECK(step >= 1, "adam step counts from 1");
  // The bias corrections as the CPU engine computes them, so both engines step identically.
  float bias1 = 1.f - std::pow(beta1, static_cast<float>(step));
  float bias2 = 1.f - std::pow(beta2, static_cast<float>(step));
  bind();
  k::adam_update(param.device_f32(), grad.device_f32(), m.device_f32(), v.device_f32(), param.numel(), lr, beta1, beta2,
                 eps, weight_decay, decoupled, bias1, bias2, compute_);
}

}  // namespace dtrain::cuda

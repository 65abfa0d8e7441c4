#include "cpu_engine.h"

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include <cblas.h>

#include "dtrain/core/topk.h"
#include "dtrain/kernels/functors.h"
#include "dtrain/kernels/gemm_record.h"
#include "simd.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "../cuda/cuda_install.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif
#endif

namespace dtrain {

namespace {
std::mutex g_engines_mu;
EngineFactory g_factories[kDeviceTypes] = {};
std::unordered_map<int, std::unique_ptr<Engine>>& cuda_engines() {
  static std::unordered_map<int, std::unique_ptr<Engine>> m;
  return m;
}
}  // namespace

void register_engine(DeviceType type, EngineFactory factory) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  g_factories[static_cast<int>(type)] = factory;
}

Engine& engine_for(Device device) {
  if (device.is_cpu()) {
    static cpu::CpuEngine cpu_engine;
    return cpu_engine;
  }
  if (device.type == DeviceType::SIM) {
    DT_CHECK(device.index == 0, "the simulated device has one index, 0; asked for " << device.str());
    static cpu::CpuEngine sim_engine(Device::sim());
    return sim_engine;
  }
  std::lock_guard<std::mutex> lock(g_engines_mu);
  auto& m = cuda_engines();
  auto it = m.find(device.index);
  if (it != m.end()) return *it->second;
  EngineFactory f = g_factories[static_cast<int>(DeviceType::CUDA)];
  DT_CHECK(f, "no engine for " << device.str() << ": dtrain was built without CUDA");
  return *(m[device.index] = f(device.index));
}

const char* math_precision_name(MathPrecision p) {
  switch (p) {
    case MathPrecision::F32:
      return "fp32";
    case MathPrecision::TF32:
      return "tf32";
    case MathPrecision::BF16:
      return "bf16";
    case MathPrecision::F16:
      return "fp16";
  }
  return "?";
}

MathPrecision math_precision_from_name(const std::string& name) {
  for (MathPrecision p : {MathPrecision::F32, MathPrecision::TF32, MathPrecision::BF16, MathPrecision::F16})
    if (name == math_precision_name(p)) return p;
  throw InputError("unknown precision '" + name + "' (expected fp32, tf32, bf16 or fp16)");
}

Tensor zeros_on(const Shape& shape, Device device, DType dtype) {
  if (device.is_cpu()) return Tensor::zeros(shape, dtype);
  Tensor t = Tensor::empty(shape, dtype, device);
  if (dtype == DType::F32) {
    engine_for(device).fill(t, 0.f);
  } else {  // the engines fill f32; other dtypes come as zero bytes from the host
    Tensor h = Tensor::zeros(shape, dtype);
    engine_for(device).copy(h, t);
  }
  return t;
}

void copy_any(const Tensor& src, Tensor& dst) {
  if (src.device().is_cpu() && dst.device().is_cpu())
    dst.copy_from(src);
  else
    engine_for(src.device().is_cpu() ? dst.device() : src.device()).copy(src, dst);
}

XentStats xent_stats(const Tensor& host_row) {
  DT_CHECK(host_row.device().is_cpu() && host_row.dtype() == DType::F32 && host_row.numel() == kXentStatsFloats,
           "xent_stats reads " << kXentStatsFloats << " f32 on the host, got " << host_row.str());
  XentStats st;
  std::memcpy(&st, host_row.device_raw(), sizeof st);
  return st;
}

Tensor to_host(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  copy_any(t, h);
  return h;
}

Tensor host_copy(const Tensor& src, const Tensor* reuse) {
  if (reuse && reuse->defined() && reuse->device().is_cpu() && reuse->shape() == src.shape() &&
      reuse->dtype() == src.dtype()) {
    Tensor out = *reuse;
    copy_any(src, out);
    return out;
  }
  return src.device().is_cpu() ? src.clone() : to_host(src);
}

Tensor stage_to(const Tensor& host, Device device, StagedTensor& st) {
  if (device.is_cpu()) return host;
  if (device.type == DeviceType::SIM) {
    stage_async(host, device, st);
    return take_staged(st);
  }
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  // Through the copy stream with an event: the page-locked buffer is rewritten only after its last
  // upload left it, so a caller need not sync the device between two batches.
  stage_async(host, device, st);
  return take_staged(st);
#else
  DT_CHECK(false, "stage_to " << device.str() << ": this build has no GPU engine");
  return host;
#endif
}

void stage_async(const Tensor& host, Device device, StagedTensor& st) {
  if (device.is_cpu()) {
    st.host = Tensor();
    st.device = host;
    st.uploaded.reset();
    return;
  }
  if (device.type == DeviceType::SIM) {  // synchronous: the CPU engine has no queue
    if (!st.device.defined() || st.device.shape() != host.shape() || st.device.dtype() != host.dtype())
      st.device = Tensor::empty(host.shape(), host.dtype(), device);
    copy_any(host, st.device);
    return;
  }
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  cuda::host_waits_for(st.uploaded);  // the page-locked buffer's last upload has left it
  st.uploaded.reset();
  if (!st.host.defined() || st.host.shape() != host.shape() || st.host.dtype() != host.dtype()) {
    st.host = cuda::pinned_empty(host.shape(), host.dtype());
    st.device = Tensor::empty(host.shape(), host.dtype(), device);
  }
  st.host.copy_from(host);
  st.uploaded = cuda::upload_async(st.host, st.device);
#else
  DT_CHECK(false, "stage_async " << device.str() << ": this build has no GPU engine");
#endif
}

Tensor take_staged(StagedTensor& st) {
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (st.uploaded) cuda::compute_waits_for(st.uploaded, st.device.device().index);
#endif
  return st.device;
}

// The CUDA engine lives in dtrain_kernels_cuda, which dtrain_kernels links when CUDA is found; the
// registry is here, so the dependency points one way (kernels -> kernels_cuda -> core).
int enable_cuda() {
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  static const int count = [] {
    int n = cuda::detail::install();  // registers the caching allocator
    if (n > 0) register_engine(DeviceType::CUDA, &cuda::detail::make_engine);
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) + " (" + v->hash +
         ")";
}

std::string blas_info() {
  const char* cfg = openblas_get_config();
  return std::string("OpenBLAS ") + (cfg ? cfg : "?");
}

namespace cpu {

// Loops smaller than this run on the calling thread: OpenMP's fork/join costs more than the work.
constexpr int64_t kParallelGrain = 1 << 15;

CpuEngine::CpuEngine(Device device) : eng_(dnnl::engine::kind::cpu, 0), strm_(eng_), device_(device) {
  threads_ = omp_get_max_threads();
}

std::string CpuEngine::describe() const {
  return "cpu (oneDNN " + onednn_version() + ", " + std::to_string(threads_) + " threads)";
}

void CpuEngine::set_threads(int threads) {
  DT_CHECK(threads >= 1, "thread count must be >= 1, got " << threads);
  threads_ = threads;
  omp_set_num_threads(threads);
}

static void check_f32(const Tensor& t, const char* what) {
  DT_CHECK(t.defined() && t.dtype() == DType::F32 && cpu_addressable(t),
           what << " must be an f32 CPU tensor, got " << (t.defined() ? t.str() : "undefined"));
}

// ------------------------------------------------------------------ GEMM
void CpuEngine::gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a, const Tensor& b,
                     float beta, Tensor& c) {
  if (a.dtype() != DType::F32 || b.dtype() != DType::F32 || rounds_gemm(m, n))
    return gemm_batched(1, ta, tb, m, n, k, alpha, a, m * k, b, k * n, beta, c, m * n);
  GemmNote note(false, 1, ta, tb, m, n, k);
  check_f32(a, "gemm A");
  check_f32(b, "gemm B");
  check_f32(c, "gemm C");
  DT_CHECK(a.numel() >= m * k && b.numel() >= k * n && c.numel() >= m * n,
           "gemm " << m << "x" << n << "x" << k << ": operands too small (" << a.str() << ", " << b.str() << ", "
                   << c.str() << ")");
  // x W^T (every Linear's forward) runs at 40 % of the N/N rate through dnnl_sgemm on these
  // processors (85 against 215 GFLOP/s for the GPT's shapes); oneDNN's matmul primitive does not.
  // The choice looks at the rows (tokens) only: tensor parallelism shards n or k, and every rank
  // must run the same implementation as one rank would, or their rounding drifts apart.
  if (tb && !ta && m >= 16 &&
      gemm_batched_f32_matmul(1, ta, tb, m, n, k, alpha, a.device_f32(), m * k, b.device_f32(), k * n, beta,
                              c.device_f32(), m * n))
    return;
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a.device_f32(), ta ? m : k,
                                b.device_f32(), tb ? k : n, beta, c.device_f32(), n);
  DT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st));
}

void CpuEngine::gemm_batched(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                             const Tensor& a, int64_t sa, const Tensor& b, int64_t sb, float beta, Tensor& c,
                             int64_t sc) {
  GemmNote note(true, batch, ta, tb, m, n, k);
  if (a.dtype() != DType::F32 || b.dtype() != DType::F32 || rounds_gemm(m, n))
    return gemm_lowp(batch, ta, tb, m, n, k, alpha, a, sa, b, sb, beta, c, sc);
  check_f32(a, "gemm_batched A");
  check_f32(b, "gemm_batched B");
  check_f32(c, "gemm_batched C");
  DT_CHECK(a.numel() >= (batch - 1) * sa + m * k && b.numel() >= (batch - 1) * sb + k * n &&
               c.numel() >= (batch - 1) * sc + m * n,
           "gemm_batched: operands too small");
  // One oneDNN matmul over the batch beats a loop of small sgemm calls (attention's per-head
  // products are 128x128x32: the call overhead is a large part of each). The choice depends on the
  // product's shape only, not on the batch count: tensor parallelism splits the heads, and a rank
  // with one head must round as one rank with all heads does. Products under 16 rows or columns
  // stay on sgemm, as under bf16: on the tests' tiny GPTs (T 8, head width 4) the primitive's
  // rounding moved tensor-parallel runs 2e-5 from one rank in a few AdamW steps, past the 1e-5
  // those tests allow, and such products gain little.
  if (std::min(m, n) >= 16 && gemm_batched_f32_matmul(batch, ta, tb, m, n, k, alpha, a.device_f32(), sa, b.device_f32(),
                                                      sb, beta, c.device_f32(), sc))
    return;
  for (int64_t i = 0; i < batch; ++i) {
    dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a.device_f32() + i * sa, ta ? m : k,
                                  b.device_f32() + i * sb, tb ? k : n, beta, c.device_f32() + i * sc, n);
    DT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st));
  }
}

// ------------------------------------------------------------------ element-wise
template <typename F>
static void map1(const Tensor& x, Tensor& y, F f) {
  check_f32(x, "input");
  check_f32(y, "output");
  DT_CHECK(x.numel() == y.numel(), "element-wise op on " << x.str() << " -> " << y.str());
  const float* px = x.device_f32();
  float* py = y.device_f32();
  int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) py[i] = f(px[i]);
}

// a, b and y: f32 tensors of one size.
static void check_binary(const Tensor& a, const Tensor& b, const Tensor& y) {
  check_f32(a, "input");
  check_f32(b, "input");
  check_f32(y, "output");
  DT_CHECK(a.numel() == y.numel() && b.numel() == y.numel(),
           "element-wise op on " << a.str() << ", " << b.str() << " -> " << y.str());
}

template <typename F>
static void map2(const Tensor& a, const Tensor& b, Tensor& y, F f) {
  check_binary(a, b, y);
  const float* pa = a.device_f32();
  const float* pb = b.device_f32();
  float* py = y.device_f32();
  int64_t n = y.numel();
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) py[i] = f(pa[i], pb[i]);
}

// y = f(x) / y = f(a, b) through a kernel of the active table, sliced across threads.
static void vec1(const Tensor& x, Tensor& y, void (*kernel)(const float*, float*, int64_t)) {
  check_f32(x, "input");
  check_f32(y, "output");
  DT_CHECK(x.numel() == y.numel(), "element-wise op on " << x.str() << " -> " << y.str());
  const float* px = x.device_f32();
  float* py = y.device_f32();
  for_slices(x.numel(), kParallelGrain, 16, [&](int64_t b, int64_t n) { kernel(px + b, py + b, n); });
}

static void vec2(const Tensor& a, const Tensor& b, Tensor& y,
                 void (*kernel)(const float*, const float*, float*, int64_t)) {
  check_binary(a, b, y);
  const float* pa = a.device_f32();
  const float* pb = b.device_f32();
  float* py = y.device_f32();
  for_slices(y.numel(), kParallelGrain, 16, [&](int64_t i, int64_t n) { kernel(pa + i, pb + i, py + i, n); });
}

void CpuEngine::unary_forward(Unary op, const Tensor& x, Tensor& y) {
  if (op == Unary::Relu)
    map1(x, y, fn::Relu{});
  else if (op == Unary::GeluExact)
    map1(x, y, fn::GeluExact{});
  else
    vec1(x, y, simd::active().gelu_forward);
}

void CpuEngine::unary_backward(Unary op, const Tensor& x, const Tensor& dy, Tensor& dx) {
  if (op == Unary::Relu)
    map2(x, dy, dx, fn::ReluGrad{});
  else if (op == Unary::GeluExact)
    map2(x, dy, dx, fn::GeluExactGrad{});
  else
    vec2(x, dy, dx, simd::active().gelu_backward);
}

void CpuEngine::dropout_forward(const Tensor& x, float p, uint64_t seed, Tensor& mask, Tensor& y) {
  check_f32(x, "dropout input");
  DT_CHECK(p >= 0.f && p < 1.f, "dropout probability must be in [0, 1), got " << p);
  check_f32(mask, "dropout mask");
  DT_CHECK(mask.numel() == x.numel(), "dropout mask " << mask.str() << " for input " << x.str());
  fn::DropoutMask f{p, 1.f / (1.f - p), seed};
  float* pm = mask.device_f32();
  int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) pm[i] = f(static_cast<uint64_t>(i));
  mul(x, mask, y);
}

void CpuEngine::mul(const Tensor& a, const Tensor& b, Tensor& y) { vec2(a, b, y, simd::active().mul); }
void CpuEngine::add(const Tensor& a, const Tensor& b, Tensor& y) { vec2(a, b, y, simd::active().add); }
void CpuEngine::axpy(float alpha, const Tensor& x, Tensor& y) {
  check_f32(x, "axpy x");
  check_f32(y, "axpy y");
  DT_CHECK(x.numel() == y.numel(), "axpy " << x.str() << " into " << y.str());
  const float* px = x.device_f32();
  float* py = y.device_f32();
  auto kernel = simd::active().axpy;
  for_slices(y.numel(), kParallelGrain, 16, [&](int64_t i, int64_t n) { kernel(alpha, px + i, py + i, n); });
}
void CpuEngine::scale(Tensor& y, float alpha) {
  check_f32(y, "scale y");
  float* py = y.device_f32();
  auto kernel = simd::active().scale;
  for_slices(y.numel(), kParallelGrain, 16, [&](int64_t i, int64_t n) { kernel(py + i, alpha, n); });
}
void CpuEngine::fill(Tensor& y, float value) {
  if (y.dtype() != DType::F32) {
    DT_CHECK(value == 0.f, "fill of " << y.str() << " with a non-zero value");
    if (y.nbytes()) std::memset(y.device_raw(), 0, y.nbytes());
    return;
  }
  map1(y, y, [value](float) { return value; });
}
void CpuEngine::copy(const Tensor& src, Tensor& dst) {
  DT_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype() && cpu_addressable(src) && cpu_addressable(dst),
           "copy " << src.str() << " into " << dst.str());
  if (src.nbytes()) std::memmove(dst.device_raw(), src.device_raw(), src.nbytes());
}

void CpuEngine::cast(const Tensor& src, Tensor& dst) {
  DT_CHECK(src.numel() == dst.numel(), "cast " << src.str() << " -> " << dst.str());
  int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  if (src.dtype() == DType::F32 && dst.dtype() == DType::BF16) {
    f32_to_bf16(src.device_f32(), dst.device_data<uint16_t>(), n);
  } else if (src.dtype() == DType::BF16 && dst.dtype() == DType::F32) {
    const uint16_t* s = src.device_data<uint16_t>();
    float* d = dst.device_f32();
#pragma omp parallel for if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  } else if (src.dtype() == DType::F32 && dst.dtype() == DType::F16) {
    f32_to_f16(src.device_f32(), dst.device_data<uint16_t>(), n);
  } else if (src.dtype() == DType::F16 && dst.dtype() == DType::F32) {
    f16_to_f32(src.device_data<uint16_t>(), dst.device_f32(), n);
  } else {
    DT_CHECK(false, "cast from " << dtype_name(src.dtype()) << " to " << dtype_name(dst.dtype()) << " is not defined");
  }
}

void CpuEngine::add_row_bias(Tensor& y, const Tensor& bias) {
  check_f32(y, "y");
  check_f32(bias, "bias");
  int64_t n = bias.numel();
  DT_CHECK(n > 0 && y.numel() % n == 0, "add_row_bias " << y.str() << " + " << bias.str());
  int64_t m = y.numel() / n;
  float* py = y.device_f32();
  const float* pb = bias.device_f32();
  auto kernel = simd::active().add_row_bias;
  for_slices(m, kParallelGrain / n, 1, [&](int64_t i, int64_t rows) { kernel(py + i * n, pb, rows, n); });
}

void CpuEngine::row_bias_grad(const Tensor& dy, Tensor& dbias) {
  check_f32(dy, "dy");
  check_f32(dbias, "dbias");
  int64_t n = dbias.numel();
  DT_CHECK(n > 0 && dy.numel() % n == 0, "row_bias_grad " << dy.str() << " -> " << dbias.str());
  int64_t m = dy.numel() / n;
  simd::active().row_bias_grad(dy.device_f32(), dbias.device_f32(), m, n);
}

double CpuEngine::sum_squares(const Tensor& x) {
  check_f32(x, "sum_squares input");
  const float* p = x.device_f32();
  int64_t n = x.numel();
  auto kernel = simd::active().sum_squares;
  double s = 0;
#pragma omp parallel reduction(+ : s) if (n > kParallelGrain)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (n + nt - 1) / nt, b = std::min(n, id * per), e = std::min(n, b + per);
    s += kernel(p + b, e - b);
  }
  return s;
}

bool CpuEngine::all_finite(const Tensor& x) {
  check_f32(x, "all_finite input");
  const float* p = x.device_f32();
  int64_t n = x.numel();
  int bad = 0;
#pragma omp parallel for reduction(| : bad) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(p[i]);
  return !bad;
}

void CpuEngine::unscale_and_check(Tensor& x, float inv_scale, Tensor& found_inf) {
  check_f32(x, "unscale_and_check input");
  check_f32(found_inf, "found_inf");
  fn::Unscale f{inv_scale};
  float* p = x.device_f32();
  int64_t n = x.numel();
  int bad = 0;
#pragma omp parallel for reduction(| : bad) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    p[i] = f(p[i]);
    bad |= !fn::is_finite(p[i]);
  }
  if (bad) found_inf.device_f32()[0] = 1.f;
}

// ------------------------------------------------------------------ softmax cross-entropy
double CpuEngine::softmax_xent_forward(const Tensor& logits, const Tensor& labels, Tensor& probs, int64_t* correct) {
  check_f32(logits, "logits");
  DT_CHECK(logits.dim() == 2 && labels.dtype() == DType::I32 && labels.numel() == logits.size(0),
           "softmax_xent: logits " << logits.str() << ", labels " << labels.str());
  int64_t m = logits.size(0), c = logits.size(1);
  const float* x = logits.device_f32();
  const int32_t* y = labels.device_data<int32_t>();
  float* p = probs.device_f32();
  double loss = 0;
  int64_t hits = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * c;
    float* prow = p + i * c;
    int32_t label = y[i];
    DT_CHECK(label == kIgnoreLabel || (label >= 0 && label < c),
             "label " << label << " out of range [0, " << c << ") at row " << i);
    float mx = row[0];
    int64_t arg = 0;
    for (int64_t j = 1; j < c; ++j)
      if (row[j] > mx) mx = row[j], arg = j;
    double sum = 0;
    for (int64_t j = 0; j < c; ++j) {
      float e = std::exp(row[j] - mx);
      prow[j] = e;
      sum += e;
    }
    float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < c; ++j) prow[j] *= inv;
    if (label == kIgnoreLabel) continue;  // no loss on this target
    loss += -(static_cast<double>(row[label]) - mx - std::log(sum));
    hits += (arg == label);
  }
  if (correct) *correct = hits;
  return loss;
}

void CpuEngine::softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, Tensor& probs, Tensor& stats) {
  check_f32(stats, "xent stats");
  DT_CHECK(stats.numel() == kXentStatsFloats, "xent stats must be " << kXentStatsFloats << " f32, got " << stats.str());
  int64_t hits = 0;
  double loss = softmax_xent_forward(logits, labels, probs, &hits);  // a bad label throws here
  XentStats st;
  std::memcpy(&st, stats.device_raw(), sizeof st);
  st.loss_sum += loss;
  st.hits += static_cast<uint64_t>(hits);
  std::memcpy(stats.device_raw(), &st, sizeof st);
}

void CpuEngine::softmax_xent_backward(const Tensor& probs, const Tensor& labels, float scale, Tensor& dlogits) {
  int64_t m = probs.size(0), c = probs.size(1);
  const float* p = probs.device_f32();
  const int32_t* y = labels.device_data<int32_t>();
  float* d = dlogits.device_f32();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < c; ++j)
      d[i * c + j] = y[i] == kIgnoreLabel ? 0.f : (p[i * c + j] - (j == y[i] ? 1.f : 0.f)) * scale;
}

// ------------------------------------------------------------------ top-k sparsification
void CpuEngine::topk_abs(const Tensor& x, int64_t k, Tensor& idx) {
  check_f32(x, "x");
  const int64_t n = x.numel();
  DT_CHECK(k > 0 && k <= n && n <= INT32_MAX, "topk_abs: k = " << k << " of " << x.str());
  DT_CHECK(idx.dtype() == DType::I32 && idx.numel() == k, "topk_abs: idx " << idx.str() << " for k = " << k);
  const std::vector<int32_t> top = topk_abs_indices(x.device_f32(), n, k);  // the compressor's selection
  std::memcpy(idx.device_data<int32_t>(), top.data(), static_cast<size_t>(k) * sizeof(int32_t));
}

void CpuEngine::gather_and_clear(Tensor& x, const Tensor& idx, Tensor& vals) {
  check_f32(x, "x");
  DT_CHECK(idx.dtype() == DType::I32 && (!vals.defined() || vals.numel() == idx.numel()),
           "gather_and_clear: idx " << idx.str() << ", vals " << (vals.defined() ? vals.str() : "none"));
  float* v = x.device_f32();
  const int32_t* ix = idx.device_data<int32_t>();
  float* out = vals.defined() ? vals.device_f32() : nullptr;
  for (int64_t j = 0; j < idx.numel(); ++j) {
    DT_CHECK(ix[j] >= 0 && ix[j] < x.numel(), "gather_and_clear: index " << ix[j] << " outside " << x.str());
    if (out) out[j] = v[ix[j]];
    v[ix[j]] = 0.f;
  }
}

void CpuEngine::scatter_add(const Tensor& idx, const Tensor& vals, Tensor& y) {
  check_f32(y, "y");
  DT_CHECK(idx.dtype() == DType::I32 && vals.numel() == idx.numel(),
           "scatter_add: idx " << idx.str() << ", vals " << vals.str());
  float* out = y.device_f32();
  const int32_t* ix = idx.device_data<int32_t>();
  const float* v = vals.device_f32();
  for (int64_t j = 0; j < idx.numel(); ++j) {
    DT_CHECK(ix[j] >= 0 && ix[j] < y.numel(), "scatter_add: index " << ix[j] << " outside " << y.str());
    out[ix[j]] += v[j];
  }
}

// ------------------------------------------------------------------ optimizer updates
void CpuEngine::sgd_update(Tensor& param, const Tensor& grad, Tensor& buf, float lr, float momentum, float dampening,
                           float weight_decay, bool nesterov) {
  check_f32(param, "param");
  check_f32(grad, "grad");
  DT_CHECK(param.numel() == grad.numel(), "sgd_update " << param.str() << " with grad " << grad.str());
  fn::SgdStep f{lr, momentum, dampening, weight_decay, nesterov};
  float* p = param.device_f32();
  const float* g = grad.device_f32();
  float dummy = 0.f;
  float* b = momentum != 0.f ? buf.device_f32() : nullptr;
  int64_t n = param.numel();
#pragma omp parallel for if (n > kParallelGrain) firstprivate(dummy)
  for (int64_t i = 0; i < n; ++i) f(p[i], g[i], b ? b[i] : dummy);
}

void CpuEngine::adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1, float beta2,
                            float eps, float weight_decay, bool decoupled, int64_t step) {
  check_f32(param, "param");
  DT_CHECK(step >= 1, "adam step counts from 1");
  float bias1 = 1.f - std::pow(beta1, static_cast<float>(step));
  float bias2 = 1.f - std::pow(beta2, static_cast<float>(step));
  fn::AdamStep f{lr, beta1, beta2, eps, weight_decay, bias1, bias2, decoupled};
  float* p = param.device_f32();
  const float* g = grad.device_f32();
  float* pm = m.device_f32();
  float* pv = v.device_f32();
  DT_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
           "adam_update " << param.str() << " with grad " << grad.str() << ", m " << m.str() << ", v " << v.str());
  auto kernel = simd::active().adam_update;
  for_slices(param.numel(), kParallelGrain, 16,
             [&](int64_t i, int64_t n) { kernel(p + i, g + i, pm + i, pv + i, n, f); });
}

}  // namespace cpu
}  // namespace dtrain

// Int8 inference primitives (include/dtrain/kernels/int8.h) on the CPU engine's oneDNN engine and
// stream. Activations stay channels-last, the layout oneDNN's int8 convolutions read and write
// without reorders; only the weights are reordered, once, into the layout the primitive chose
// (format_tag::any, which also adds the compensation an s8 input needs).
#include "dtrain/kernels/int8.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "cpu_engine.h"
#include "dtrain/core/error.h"

namespace dtrain::int8 {

using cpu::dt;
using cpu::tag;
using dnnl::memory;

const char* qtype_name(QType t) { return t == QType::U8 ? "u8" : t == QType::S8 ? "s8" : "f32"; }
size_t qtype_size(QType t) { return t == QType::F32 ? 4 : 1; }

static dt dnnl_type(QType t) { return t == QType::U8 ? dt::u8 : t == QType::S8 ? dt::s8 : dt::f32; }

static cpu::CpuEngine& engine() { return static_cast<cpu::CpuEngine&>(engine_for(Device::cpu())); }

struct Int8Conv2d::Impl {
  QType in;
  bool relu;
  Int8Add add;
  std::vector<int8_t> w;  // (K, C, R, S), plain
  std::vector<float> bias, scales;
  struct Prim {
    dnnl::convolution_forward conv;
    memory::desc x_md, y_md;
    memory wts, bias;
  };
  std::map<int64_t, Prim> by_batch;

  Prim make(const ConvShape& g, QType out, int64_t n) {
    auto& eng = engine().dnnl_engine();
    Prim p;
    p.x_md = memory::desc({n, g.c, g.h, g.w}, dnnl_type(in), tag::nhwc);
    p.y_md = memory::desc({n, g.k, g.out_h(), g.out_w()}, dnnl_type(out), tag::nhwc);
    memory::desc w_any({g.k, g.c, g.r, g.s}, dt::s8, tag::any), b_md({g.k}, dt::f32, tag::x);
    dnnl::convolution_forward::desc d(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                                      p.x_md, w_any, b_md, p.y_md, {g.stride, g.stride}, {g.pad, g.pad},
                                      {g.pad, g.pad});
    dnnl::primitive_attr attr;
    attr.set_output_scales(1 << 1, scales);  // one scale per output channel (dimension 1 of y)
    dnnl::post_ops po;
    // The addend is read from y as its own type (a reinterpretation: s8 under a u8 output is allowed).
    if (add.type != QType::F32) po.append_sum(add.scale, dnnl_type(add.type));
    if (relu) po.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    attr.set_post_ops(po);
    dnnl::convolution_forward::primitive_desc pd(d, attr, eng);
    p.conv = dnnl::convolution_forward(pd);
    p.wts = memory(pd.weights_desc(), eng);
    memory user(memory::desc({g.k, g.c, g.r, g.s}, dt::s8, tag::oihw), eng, w.data());
    dnnl::reorder(user, p.wts).execute(engine().dnnl_stream(), user, p.wts);
    engine().dnnl_stream().wait();
    p.bias = memory(b_md, eng, bias.data());
    return p;
  }
};

Int8Conv2d::Int8Conv2d(const ConvShape& g, QType in, QType out, bool relu, std::vector<int8_t> weights,
                       std::vector<float> bias_acc, std::vector<float> out_scales, Int8Add add)
    : g_(g), out_(out), impl_(std::make_unique<Impl>()) {
  DT_CHECK(in != QType::F32, "int8 convolution: the input must be u8 or s8");
  DT_CHECK(add.type == QType::F32 || out != QType::F32, "int8 convolution: an addend needs a u8 or s8 output");
  DT_CHECK(static_cast<int64_t>(weights.size()) == g.k * g.c * g.r * g.s, "int8 convolution: weights hold "
                                                                              << weights.size() << " values");
  DT_CHECK(static_cast<int64_t>(bias_acc.size()) == g.k && static_cast<int64_t>(out_scales.size()) == g.k,
           "int8 convolution: need one bias and one scale per output channel");
  for (int8_t v : weights)
    DT_CHECK(v >= -kWeightMax && v <= kWeightMax,
             "int8 convolution: weight " << int{v} << " outside the 7 bits [-63, 63]");
  impl_->in = in;
  impl_->relu = relu;
  impl_->add = add;
  impl_->w = std::move(weights);
  impl_->bias = std::move(bias_acc);
  impl_->scales = std::move(out_scales);
  // oneDNN's kernels without VNNI shift an s8 input to u8 and halve the weights to keep their 16-bit
  // pair sums inside: doubled weights come back exact, and on VNNI processors the doubled weights
  // with half the scale give bitwise the same (acc + bias) * scale (powers of two scale exactly).
  if (in == QType::S8) {
    for (int8_t& v : impl_->w) v = static_cast<int8_t>(2 * v);
    for (float& b : impl_->bias) b *= 2.f;
    for (float& sc : impl_->scales) sc *= 0.5f;
  }
}
Int8Conv2d::~Int8Conv2d() = default;
Int8Conv2d::Int8Conv2d(Int8Conv2d&&) noexcept = default;

void Int8Conv2d::forward(int64_t n, const void* x, void* y) {
  auto it = impl_->by_batch.find(n);
  if (it == impl_->by_batch.end()) it = impl_->by_batch.emplace(n, impl_->make(g_, out_, n)).first;
  Impl::Prim& p = it->second;
  auto& eng = engine().dnnl_engine();
  memory xm(p.x_md, eng, const_cast<void*>(x)), ym(p.y_md, eng, y);
  p.conv.execute(engine().dnnl_stream(),
                 {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, p.wts}, {DNNL_ARG_BIAS, p.bias}, {DNNL_ARG_DST, ym}});
  engine().dnnl_stream().wait();
}

struct Int8MaxPool::Impl {
  struct Prim {
    dnnl::pooling_forward pool;
    memory::desc x_md, y_md;
  };
  std::map<int64_t, Prim> by_batch;
};

Int8MaxPool::Int8MaxPool(int64_t c, int64_t h, int64_t w, int64_t kernel, int64_t stride, QType type)
    : c_(c), h_(h), w_(w), kernel_(kernel), stride_(stride), type_(type), impl_(std::make_unique<Impl>()) {
  DT_CHECK(type != QType::F32, "int8 max pooling: the input must be u8 or s8");
}
Int8MaxPool::~Int8MaxPool() = default;
Int8MaxPool::Int8MaxPool(Int8MaxPool&&) noexcept = default;

void Int8MaxPool::forward(int64_t n, const void* x, void* y) {
  auto& eng = engine().dnnl_engine();
  auto it = impl_->by_batch.find(n);
  if (it == impl_->by_batch.end()) {
    Impl::Prim p;
    p.x_md = memory::desc({n, c_, h_, w_}, dnnl_type(type_), tag::nhwc);
    p.y_md = memory::desc({n, c_, out_h(), out_w()}, dnnl_type(type_), tag::nhwc);
    dnnl::pooling_forward::desc d(dnnl::prop_kind::forward_inference, dnnl::algorithm::pooling_max, p.x_md, p.y_md,
                                  {stride_, stride_}, {kernel_, kernel_}, {0, 0}, {0, 0});
    p.pool = dnnl::pooling_forward(dnnl::pooling_forward::primitive_desc(d, eng));
    it = impl_->by_batch.emplace(n, std::move(p)).first;
  }
  memory xm(it->second.x_md, eng, const_cast<void*>(x)), ym(it->second.y_md, eng, y);
  it->second.pool.execute(engine().dnnl_stream(), {{DNNL_ARG_SRC, xm}, {DNNL_ARG_DST, ym}});
  engine().dnnl_stream().wait();
}

template <typename Q>
static void quantize_rows(const float* x, int64_t n, int64_t c, int64_t hw, float inv_scale, Q* y, float lo, float hi) {
#pragma omp parallel for schedule(static) if (n * c * hw > (1 << 16))
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t p = 0; p < hw; ++p) {
        const float v = std::nearbyint(x[(i * c + ch) * hw + p] * inv_scale);
        y[(i * hw + p) * c + ch] = static_cast<Q>(std::min(hi, std::max(lo, v)));
      }
}

void quantize_nchw_to_nhwc(const float* x, int64_t n, int64_t c, int64_t h, int64_t w, float inv_scale, QType type,
                           void* y) {
  DT_CHECK(type != QType::F32, "quantize: the target must be u8 or s8");
  if (type == QType::U8)
    quantize_rows(x, n, c, h * w, inv_scale, static_cast<uint8_t*>(y), 0.f, 255.f);
  else
    quantize_rows(x, n, c, h * w, inv_scale, static_cast<int8_t*>(y), -128.f, 127.f);
}

void quantize_rows_symmetric(const float* w, int64_t rows, int64_t cols, int qmax, int8_t* q, float* scales) {
  const auto top = static_cast<float>(qmax);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    float m = 0.f;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(row[c]));
    const float s = m > 0.f ? m / top : 1.f;
    scales[r] = s;
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = static_cast<int8_t>(std::clamp(std::nearbyint(row[c] / s), -top, top));
  }
}

WeightOnlyInt8 WeightOnlyInt8::from(const float* w, int64_t rows, int64_t cols) {
  WeightOnlyInt8 out;
  out.rows = rows;
  out.cols = cols;
  out.q.resize(static_cast<size_t>(rows * cols));
  out.scale.resize(static_cast<size_t>(rows));
  quantize_rows_symmetric(w, rows, cols, 127, out.q.data(), out.scale.data());
  return out;
}

void gemm_weight_only_int8(const float* x, int64_t m, const WeightOnlyInt8& w, float* y) {
  constexpr int64_t kPanelFloats = 32 * 1024;  // 128 KiB of f32 weights per GEMM: stays in L2
  constexpr int64_t kManyRows = 64;
  const int64_t k = w.cols, n = w.rows;
  const int64_t rows = m >= kManyRows ? n : std::clamp<int64_t>(kPanelFloats / std::max<int64_t>(k, 1), 1, n);
  thread_local std::vector<float> panel;
  if (panel.size() < static_cast<size_t>(rows * k)) panel.resize(static_cast<size_t>(rows * k));
  for (int64_t n0 = 0; n0 < n; n0 += rows) {
    const int64_t np = std::min(rows, n - n0);
    for (int64_t r = 0; r < np; ++r) {
      const int8_t* q = w.q.data() + (n0 + r) * k;
      const float s = w.scale[static_cast<size_t>(n0 + r)];
      float* p = panel.data() + r * k;
      for (int64_t c = 0; c < k; ++c) p[c] = s * static_cast<float>(q[c]);
    }
    // y[:, n0:n0+np] = x (m, k) . panel (np, k)^T, row-major with ldc = n
    const dnnl_status_t st = dnnl_sgemm('N', 'T', m, np, k, 1.f, x, k, panel.data(), k, 0.f, y + n0, n);
    DT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st));
  }
}

}  // namespace dtrain::int8

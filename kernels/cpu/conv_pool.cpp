// Convolution and pooling on the CPU through oneDNN primitives.
// Tensors stay NCHW / OIHW; oneDNN picks its own (blocked) layouts with format_tag::any, and we
// reorder at the boundary. Primitives are built once per shape and cached: building one costs
// about as much as running it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "cpu_engine.h"

namespace dtrain::cpu {

static std::string conv_key(const Conv2dGeom& g, bool bf16) {
  std::ostringstream k;
  k << bf16 << ':' << g.n << ',' << g.c << ',' << g.h << ',' << g.w << ',' << g.k << ',' << g.r << ',' << g.s << ','
    << g.stride << ',' << g.pad;
  return k.str();
}

ConvPrims& CpuEngine::conv_prims(const Conv2dGeom& g) {
  std::lock_guard<std::mutex> lock(cache_mu_);
  // Under MathPrecision::BF16 the primitives read bf16 inputs (the reorders at the edges round the
  // f32 tensors) and write f32 outputs and gradients, so only the multiply is low precision.
  const bool bf16 = math_ == MathPrecision::BF16 && conv_bf16_native_;
  auto& slot = conv_cache_[conv_key(g, bf16)];
  if (slot) return *slot;
  if (bf16) {
    try {
      slot = make_conv_prims(g, true);
      return *slot;
    } catch (const dnnl::error&) {
      conv_bf16_native_ = false;  // no bf16 convolution on this processor: emulate (conv_input)
      conv_cache_.erase(conv_key(g, true));
    }
  }
  auto& f32_slot = conv_cache_[conv_key(g, false)];
  if (!f32_slot) f32_slot = make_conv_prims(g, false);
  return *f32_slot;
}

const void* CpuEngine::conv_input(const Tensor& t, std::vector<float>& rounded) const {
  if (!emulate_bf16_conv()) return t.device_raw();
  const int64_t n = t.numel();
  if (static_cast<int64_t>(rounded.size()) < n) rounded.resize(static_cast<size_t>(n));
  round_to_bf16(t.device_f32(), rounded.data(), n);
  return rounded.data();
}

std::unique_ptr<ConvPrims> CpuEngine::make_conv_prims(const Conv2dGeom& g, bool bf16) {
  auto p = std::make_unique<ConvPrims>();
  memory::dims xd{g.n, g.c, g.h, g.w}, wd{g.k, g.c, g.r, g.s}, bd{g.k}, yd{g.n, g.k, g.out_h(), g.out_w()};
  memory::dims st{g.stride, g.stride}, pad{g.pad, g.pad};
  p->x_md = plain(xd, tag::nchw);
  p->w_md = plain(wd, tag::oihw);
  p->b_md = plain(bd, tag::x);
  p->y_md = plain(yd, tag::nchw);
  const dt in = bf16 ? dt::bf16 : dt::f32;
  auto any = [](const memory::dims& d, dt t) { return memory::desc(d, t, tag::any); };
  dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                     any(xd, in), any(wd, in), p->b_md, any(yd, dt::f32), st, pad, pad);
  p->fwd_pd = dnnl::convolution_forward::primitive_desc(fd, eng_);
  p->fwd = dnnl::convolution_forward(p->fwd_pd);
  p->fx.init(eng_, p->x_md, p->fwd_pd.src_desc(), true, false);
  p->fw.init(eng_, p->w_md, p->fwd_pd.weights_desc(), true, false);
  p->fy.init(eng_, p->y_md, p->fwd_pd.dst_desc(), false, true);

  dnnl::convolution_backward_data::desc bdd(dnnl::algorithm::convolution_direct, any(xd, dt::f32), any(wd, in),
                                            any(yd, in), st, pad, pad);
  p->bwd_d_pd = dnnl::convolution_backward_data::primitive_desc(bdd, eng_, p->fwd_pd);
  p->bwd_d = dnnl::convolution_backward_data(p->bwd_d_pd);
  p->dy_d.init(eng_, p->y_md, p->bwd_d_pd.diff_dst_desc(), true, false);
  p->w_d.init(eng_, p->w_md, p->bwd_d_pd.weights_desc(), true, false);
  p->dx_d.init(eng_, p->x_md, p->bwd_d_pd.diff_src_desc(), false, true);

  dnnl::convolution_backward_weights::desc bwd(dnnl::algorithm::convolution_direct, any(xd, in), any(wd, dt::f32),
                                               p->b_md, any(yd, in), st, pad, pad);
  p->bwd_w_pd = dnnl::convolution_backward_weights::primitive_desc(bwd, eng_, p->fwd_pd);
  p->bwd_w = dnnl::convolution_backward_weights(p->bwd_w_pd);
  p->x_w.init(eng_, p->x_md, p->bwd_w_pd.src_desc(), true, false);
  p->dy_w.init(eng_, p->y_md, p->bwd_w_pd.diff_dst_desc(), true, false);
  p->dw_w.init(eng_, p->w_md, p->bwd_w_pd.diff_weights_desc(), false, true);
  p->dw_tmp = memory(p->w_md, eng_);
  p->db_tmp = memory(p->b_md, eng_);
  return p;
}

static void check_conv(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& y) {
  DT_CHECK(x.numel() == g.n * g.c * g.h * g.w && w.numel() == g.k * g.c * g.r * g.s &&
               y.numel() == g.n * g.k * g.out_h() * g.out_w(),
           "conv2d geometry does not match tensors x " << x.str() << ", w " << w.str() << ", y " << y.str());
}

void CpuEngine::conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  check_conv(g, x, w, y);
  ConvPrims& p = conv_prims(g);
  thread_local std::vector<float> rx, rw;
  std::unordered_map<int, memory> args;
  args[DNNL_ARG_SRC] = p.fx.input(eng_, strm_, p.x_md, const_cast<void*>(conv_input(x, rx)));
  args[DNNL_ARG_WEIGHTS] = p.fw.input(eng_, strm_, p.w_md, const_cast<void*>(conv_input(w, rw)));
  memory zero_bias;
  if (bias.defined()) {
    args[DNNL_ARG_BIAS] = memory(p.b_md, eng_, bias.device_raw());
  } else {
    zero_bias = memory(p.b_md, eng_);
    std::memset(zero_bias.get_data_handle(), 0, static_cast<size_t>(g.k) * 4);
    args[DNNL_ARG_BIAS] = zero_bias;
  }
  args[DNNL_ARG_DST] = p.fy.output(eng_, p.y_md, y.device_raw());
  p.fwd.execute(strm_, args);
  p.fy.finish(eng_, strm_, p.y_md, y.device_raw());
  strm_.wait();
}

void CpuEngine::conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx) {
  check_conv(g, dx, w, dy);
  ConvPrims& p = conv_prims(g);
  thread_local std::vector<float> rdy, rw;
  std::unordered_map<int, memory> args;
  args[DNNL_ARG_DIFF_DST] = p.dy_d.input(eng_, strm_, p.y_md, const_cast<void*>(conv_input(dy, rdy)));
  args[DNNL_ARG_WEIGHTS] = p.w_d.input(eng_, strm_, p.w_md, const_cast<void*>(conv_input(w, rw)));
  args[DNNL_ARG_DIFF_SRC] = p.dx_d.output(eng_, p.x_md, dx.device_raw());
  p.bwd_d.execute(strm_, args);
  p.dx_d.finish(eng_, strm_, p.x_md, dx.device_raw());
  strm_.wait();
}

void CpuEngine::conv2d_backward_weights(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                        Tensor& dbias) {
  check_conv(g, x, dw, dy);
  ConvPrims& p = conv_prims(g);
  thread_local std::vector<float> rx, rdy;
  std::unordered_map<int, memory> args;
  args[DNNL_ARG_SRC] = p.x_w.input(eng_, strm_, p.x_md, const_cast<void*>(conv_input(x, rx)));
  args[DNNL_ARG_DIFF_DST] = p.dy_w.input(eng_, strm_, p.y_md, const_cast<void*>(conv_input(dy, rdy)));
  void* dw_tmp = p.dw_tmp.get_data_handle();
  args[DNNL_ARG_DIFF_WEIGHTS] = p.dw_w.output(eng_, p.w_md, dw_tmp);
  args[DNNL_ARG_DIFF_BIAS] = p.db_tmp;
  p.bwd_w.execute(strm_, args);
  p.dw_w.finish(eng_, strm_, p.w_md, dw_tmp);
  strm_.wait();
  // Gradients accumulate (engine contract).
  const float* tw = static_cast<const float*>(dw_tmp);
  float* pdw = dw.device_f32();
  for (int64_t i = 0; i < dw.numel(); ++i) pdw[i] += tw[i];
  if (dbias.defined()) {
    const float* tb = static_cast<const float*>(p.db_tmp.get_data_handle());
    float* pdb = dbias.device_f32();
    for (int64_t i = 0; i < g.k; ++i) pdb[i] += tb[i];
  }
}

// ------------------------------------------------------------------ pooling

PoolPrims& CpuEngine::pool_prims(const Pool2dGeom& g, PoolKind kind) {
  std::ostringstream key;
  key << static_cast<int>(kind) << ',' << g.n << ',' << g.c << ',' << g.h << ',' << g.w << ',' << g.kernel << ','
      << g.stride << ',' << g.pad;
  std::lock_guard<std::mutex> lock(cache_mu_);
  auto& slot = pool_cache_[key.str()];
  if (slot) return *slot;
  auto p = std::make_unique<PoolPrims>();
  p->x_md = plain({g.n, g.c, g.h, g.w}, tag::nchw);
  p->y_md = plain({g.n, g.c, g.out_h(), g.out_w()}, tag::nchw);
  // Average pooling counts the padding, as PyTorch's default count_include_pad=True does.
  auto alg = kind == PoolKind::Max ? dnnl::algorithm::pooling_max : dnnl::algorithm::pooling_avg_include_padding;
  memory::dims st{g.stride, g.stride}, ker{g.kernel, g.kernel}, pad{g.pad, g.pad};
  dnnl::pooling_forward::desc fd(dnnl::prop_kind::forward_training, alg, p->x_md, p->y_md, st, ker, pad, pad);
  p->fwd_pd = dnnl::pooling_forward::primitive_desc(fd, eng_);
  p->fwd = dnnl::pooling_forward(p->fwd_pd);
  dnnl::pooling_backward::desc bd(alg, p->x_md, p->y_md, st, ker, pad, pad);
  p->bwd_pd = dnnl::pooling_backward::primitive_desc(bd, eng_, p->fwd_pd);
  p->bwd = dnnl::pooling_backward(p->bwd_pd);
  p->workspace_bytes = p->fwd_pd.workspace_desc().get_size();
  const std::string impl = p->fwd_pd.impl_info_str();
  p->own_max =
      kind == PoolKind::Max && (impl.find("simple") != std::string::npos || impl.find("ref") != std::string::npos);
  slot = std::move(p);
  return *slot;
}

namespace {

// One 2x2 window, stride 2, no padding (the common case), with the generic loop's rules: the first
// maximum in row-major order wins, NaN wins (v != v).
inline void max_of_four(float a, float b, float c, float d, int32_t ia, int32_t w, float& m, int32_t& at) {
  m = a;
  at = ia;
  if (m == m && (b > m || b != b)) m = b, at = ia + 1;
  if (m == m && (c > m || c != c)) m = c, at = ia + w;
  if (m == m && (d > m || d != d)) m = d, at = ia + w + 1;
}

// One NCHW plane, 2x2 windows with stride 2 and no padding (the common case).
void max_pool_plane_2x2(const Pool2dGeom& g, const float* xp, float* yp, int32_t* ip) {
  const int64_t oh = g.out_h(), ow = g.out_w();
  const int32_t w = static_cast<int32_t>(g.w);
  for (int64_t i = 0; i < oh; ++i) {
    const float* r0 = xp + 2 * i * g.w;
    const float* r1 = r0 + g.w;
    for (int64_t j = 0; j < ow; ++j)
      max_of_four(r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1], static_cast<int32_t>(2 * i * g.w + 2 * j), w,
                  yp[i * ow + j], ip[i * ow + j]);
  }
}

// One NCHW plane, any window, stride and padding.
void max_pool_plane(const Pool2dGeom& g, const float* xp, float* yp, int32_t* ip) {
  const int64_t oh = g.out_h(), ow = g.out_w();
  for (int64_t i = 0; i < oh; ++i) {
    const int64_t h0 = std::max<int64_t>(0, i * g.stride - g.pad), h1 = std::min(g.h, i * g.stride - g.pad + g.kernel);
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t w0 = std::max<int64_t>(0, j * g.stride - g.pad),
                    w1 = std::min(g.w, j * g.stride - g.pad + g.kernel);
      float m = -std::numeric_limits<float>::infinity();
      int64_t at = h0 * g.w + w0;
      bool nan = false;
      for (int64_t a = h0; a < h1 && !nan; ++a)
        for (int64_t b = w0; b < w1 && !nan; ++b) {
          float v = xp[a * g.w + b];
          nan = std::isnan(v);
          if (v > m || nan) m = v, at = a * g.w + b;
        }
      yp[i * ow + j] = m;
      ip[i * ow + j] = static_cast<int32_t>(at);
    }
  }
}

// Max pooling over NCHW planes; idx (i32, one per output) keeps the argmax's offset in its input
// plane. Padding never wins (it is -inf, as in PyTorch); the first maximum of a window wins ties;
// NaN propagates.
void max_pool_forward(const Pool2dGeom& g, const float* x, float* y, int32_t* idx) {
  const int64_t outs = g.out_h() * g.out_w(), planes = g.n * g.c;
  const bool two_by_two = g.kernel == 2 && g.stride == 2 && g.pad == 0;
#pragma omp parallel for if (planes * outs > (1 << 15))
  for (int64_t pl = 0; pl < planes; ++pl) {
    if (two_by_two)
      max_pool_plane_2x2(g, x + pl * g.h * g.w, y + pl * outs, idx + pl * outs);
    else
      max_pool_plane(g, x + pl * g.h * g.w, y + pl * outs, idx + pl * outs);
  }
}

void max_pool_backward(const Pool2dGeom& g, const float* dy, const int32_t* idx, float* dx) {
  const int64_t outs = g.out_h() * g.out_w(), planes = g.n * g.c, plane = g.h * g.w;
  std::memset(dx, 0, static_cast<size_t>(planes * plane) * sizeof(float));
#pragma omp parallel for if (planes * outs > (1 << 15))
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t o = 0; o < outs; ++o) dx[pl * plane + idx[pl * outs + o]] += dy[pl * outs + o];
}

}  // namespace

void CpuEngine::pool2d_forward(const Pool2dGeom& g, PoolKind kind, const Tensor& x, Tensor& y, Tensor* state) {
  DT_CHECK(x.numel() == g.n * g.c * g.h * g.w && y.numel() == g.n * g.c * g.out_h() * g.out_w(),
           "pool2d geometry does not match x " << x.str() << ", y " << y.str());
  PoolPrims& p = pool_prims(g, kind);
  if (p.own_max) {
    Tensor local;
    Tensor& ix = state ? *state : local;
    if (!ix.defined() || ix.dtype() != DType::I32 || ix.numel() != y.numel())
      ix = Tensor::empty({y.numel()}, DType::I32);
    max_pool_forward(g, x.device_f32(), y.device_f32(), ix.device_data<int32_t>());
    return;
  }
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(p.x_md, eng_, x.device_raw())},
                                       {DNNL_ARG_DST, memory(p.y_md, eng_, y.device_raw())}};
  Tensor ws;
  if (p.workspace_bytes) {
    if (state && state->defined() && state->nbytes() == p.workspace_bytes) {
      ws = *state;
    } else {
      ws = Tensor::empty({static_cast<int64_t>(p.workspace_bytes)}, DType::U8);
      if (state) *state = ws;
    }
    args[DNNL_ARG_WORKSPACE] = memory(p.fwd_pd.workspace_desc(), eng_, ws.device_raw());
  }
  p.fwd.execute(strm_, args);
  strm_.wait();
}

void CpuEngine::pool2d_backward(const Pool2dGeom& g, PoolKind kind, const Tensor& dy, const Tensor& state, Tensor& dx) {
  PoolPrims& p = pool_prims(g, kind);
  if (p.own_max) {
    DT_CHECK(state.defined() && state.dtype() == DType::I32 && state.numel() == dy.numel(),
             "max-pool backward needs the indices saved by a training forward");
    max_pool_backward(g, dy.device_f32(), state.device_data<int32_t>(), dx.device_f32());
    return;
  }
  std::unordered_map<int, memory> args{{DNNL_ARG_DIFF_DST, memory(p.y_md, eng_, dy.device_raw())},
                                       {DNNL_ARG_DIFF_SRC, memory(p.x_md, eng_, dx.device_raw())}};
  if (p.workspace_bytes) {
    DT_CHECK(state.defined() && state.nbytes() == p.workspace_bytes,
             "max-pool backward needs the workspace saved by a training forward");
    args[DNNL_ARG_WORKSPACE] = memory(p.fwd_pd.workspace_desc(), eng_, state.device_raw());
  }
  p.bwd.execute(strm_, args);
  strm_.wait();
}

}  // namespace dtrain::cpu

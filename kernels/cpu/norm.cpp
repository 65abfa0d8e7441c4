// BatchNorm (per channel over N and H*W), LayerNorm and RMSNorm (per row over the last dim), OpenMP
// loops.
#include <cmath>

#include "cpu_engine.h"
#include "simd.h"

namespace dtrain::cpu {

// x viewed as [N, C, HW].
struct NchwView {
  int64_t n, c, hw;
};
static NchwView nchw(const Tensor& x, int64_t channels) {
  DT_CHECK(x.dim() >= 2 && x.size(1) == channels, "batchnorm over " << channels << " channels of " << x.str());
  return {x.size(0), channels, x.numel() / (x.size(0) * channels)};
}

void CpuEngine::batchnorm_forward_train(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                        float eps, float momentum, Tensor& running_mean, Tensor& running_var,
                                        Tensor& save_mean, Tensor& save_invstd, Tensor& y) {
  NchwView v = nchw(x, channels);
  const float* px = x.device_f32();
  float* py = y.device_f32();
  const float* g = gamma.device_f32();
  const float* b = beta.device_f32();
  float* rm = running_mean.device_f32();
  float* rv = running_var.device_f32();
  float* sm = save_mean.device_f32();
  float* si = save_invstd.device_f32();
  const double count = static_cast<double>(v.n * v.hw);
#pragma omp parallel for if (x.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c) {
    double s = 0, ss = 0;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) s += row[j];
    }
    double mean = s / count;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) {
        double d = row[j] - mean;
        ss += d * d;
      }
    }
    double var = ss / count;  // biased, used to normalise
    float invstd = static_cast<float>(1.0 / std::sqrt(var + eps));
    sm[c] = static_cast<float>(mean);
    si[c] = invstd;
    // Running variance is unbiased, as in PyTorch.
    double unbiased = count > 1 ? ss / (count - 1) : var;
    rm[c] = (1.f - momentum) * rm[c] + momentum * static_cast<float>(mean);
    rv[c] = (1.f - momentum) * rv[c] + momentum * static_cast<float>(unbiased);
    float a = g[c] * invstd;
    float off = b[c] - static_cast<float>(mean) * a;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      float* out = py + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) out[j] = row[j] * a + off;
    }
  }
}

void CpuEngine::batchnorm_forward_infer(const Tensor& x, int64_t channels, const Tensor& gamma, const Tensor& beta,
                                        float eps, const Tensor& running_mean, const Tensor& running_var, Tensor& y) {
  NchwView v = nchw(x, channels);
  const float* px = x.device_f32();
  float* py = y.device_f32();
  const float* g = gamma.device_f32();
  const float* b = beta.device_f32();
  const float* rm = running_mean.device_f32();
  const float* rv = running_var.device_f32();
#pragma omp parallel for if (x.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c) {
    float a = g[c] / std::sqrt(rv[c] + eps);
    float off = b[c] - rm[c] * a;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      float* out = py + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) out[j] = row[j] * a + off;
    }
  }
}

// With xhat = (x - mean) * invstd and M = N*HW:
//   dbeta = sum dy, dgamma = sum dy*xhat,
//   dx = gamma*invstd/M * (M*dy - dbeta - xhat*dgamma).
void CpuEngine::batchnorm_backward(const Tensor& x, const Tensor& dy, int64_t channels, const Tensor& gamma,
                                   const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                                   Tensor& dbeta) {
  NchwView v = nchw(x, channels);
  const float* px = x.device_f32();
  const float* pdy = dy.device_f32();
  float* pdx = dx.device_f32();
  const float* g = gamma.device_f32();
  const float* sm = save_mean.device_f32();
  const float* si = save_invstd.device_f32();
  float* dg = dgamma.device_f32();
  float* db = dbeta.device_f32();
  const double count = static_cast<double>(v.n * v.hw);
#pragma omp parallel for if (x.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c) {
    double sdy = 0, sdyx = 0;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      const float* drow = pdy + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) {
        sdy += drow[j];
        sdyx += drow[j] * (row[j] - sm[c]);
      }
    }
    float invstd = si[c];
    float sum_dy_xhat = static_cast<float>(sdyx) * invstd;
    dg[c] += sum_dy_xhat;
    db[c] += static_cast<float>(sdy);
    float k = g[c] * invstd / static_cast<float>(count);
    float mean_dy = static_cast<float>(sdy);
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      const float* drow = pdy + (i * v.c + c) * v.hw;
      float* out = pdx + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) {
        float xhat = (row[j] - sm[c]) * invstd;
        out[j] = k * (static_cast<float>(count) * drow[j] - mean_dy - xhat * sum_dy_xhat);
      }
    }
  }
}

void CpuEngine::channel_sums(const Tensor& x, int64_t channels, Tensor& sum, Tensor& sumsq) {
  NchwView v = nchw(x, channels);
  const float* px = x.device_f32();
  float* ps = sum.device_f32();
  float* pq = sumsq.device_f32();
#pragma omp parallel for if (x.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c) {
    double s = 0, q = 0;
    for (int64_t i = 0; i < v.n; ++i) {
      const float* row = px + (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) s += row[j], q += static_cast<double>(row[j]) * row[j];
    }
    ps[c] = static_cast<float>(s);
    pq[c] = static_cast<float>(q);
  }
}

void CpuEngine::channel_dot(const Tensor& a, const Tensor& b, int64_t channels, Tensor& out) {
  NchwView v = nchw(a, channels);
  DT_CHECK(a.numel() == b.numel(), "channel_dot of " << a.str() << " and " << b.str());
  const float* pa = a.device_f32();
  const float* pb = b.device_f32();
  float* po = out.device_f32();
#pragma omp parallel for if (a.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c) {
    double s = 0;
    for (int64_t i = 0; i < v.n; ++i) {
      int64_t base = (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) s += static_cast<double>(pa[base + j]) * pb[base + j];
    }
    po[c] = static_cast<float>(s);
  }
}

void CpuEngine::channel_affine(const Tensor& x, int64_t channels, const Tensor& scale, const Tensor& shift, Tensor& y) {
  NchwView v = nchw(x, channels);
  const float* px = x.device_f32();
  const float* a = scale.device_f32();
  const float* b = shift.device_f32();
  float* py = y.device_f32();
#pragma omp parallel for if (x.numel() > (1 << 15))
  for (int64_t c = 0; c < v.c; ++c)
    for (int64_t i = 0; i < v.n; ++i) {
      int64_t base = (i * v.c + c) * v.hw;
      for (int64_t j = 0; j < v.hw; ++j) py[base + j] = px[base + j] * a[c] + b[c];
    }
}

// Rows per slice of a row-wise norm (layernorm, rmsnorm): about 32K elements.
static int64_t norm_grain(int64_t d) { return (1 << 15) / d; }

// A row-wise norm's backward over m rows of d features. run(first, rows, dx, params) runs the
// kernel on rows [first, first + rows), writing dx and/or accumulating the parameter gradients.
// On one thread (or few rows) one pass does both; otherwise the parameter gradients, which sum
// over all rows, run on one thread, so their order is fixed, and dx by slices.
template <typename Run>
static void norm_backward_rows(int64_t m, int64_t d, Run run) {
  const int64_t grain = norm_grain(d);
  if (m <= grain || omp_get_max_threads() == 1) return run(0, m, true, true);
  run(0, m, false, true);
  for_slices(m, grain, 1, [&](int64_t i, int64_t rows) { run(i, rows, true, false); });
}

void CpuEngine::layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& mean,
                                  Tensor& rstd, Tensor& y) {
  int64_t d = gamma.numel();
  DT_CHECK(d > 0 && x.size(-1) == d, "layernorm over " << d << " features of " << x.str());
  int64_t m = x.numel() / d;
  DT_CHECK(y.numel() == x.numel() && mean.numel() == m && rstd.numel() == m,
           "layernorm of " << x.str() << " into " << y.str() << ", mean " << mean.str() << ", rstd " << rstd.str());
  const float* px = x.device_f32();
  float* py = y.device_f32();
  const float* g = gamma.device_f32();
  const float* b = beta.device_f32();
  float* pm = mean.device_f32();
  float* pr = rstd.device_f32();
  auto kernel = simd::active().layernorm_forward;
  for_slices(m, norm_grain(d), 1,
             [&](int64_t i, int64_t rows) { kernel(px + i * d, g, b, eps, pm + i, pr + i, py + i * d, rows, d); });
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma (simd.cpp).
void CpuEngine::layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                                   const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  int64_t d = gamma.numel();
  int64_t m = x.numel() / d;
  DT_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dgamma.numel() == d && dbeta.numel() == d,
           "layernorm_backward of " << x.str() << " with dy " << dy.str() << " into " << dx.str());
  const float* px = x.device_f32();
  const float* pdy = dy.device_f32();
  float* pdx = dx.device_f32();
  const float* g = gamma.device_f32();
  const float* pm = mean.device_f32();
  const float* pr = rstd.device_f32();
  float* dg = dgamma.device_f32();
  float* db = dbeta.device_f32();
  auto kernel = simd::active().layernorm_backward;
  norm_backward_rows(m, d, [&](int64_t i, int64_t rows, bool with_dx, bool with_params) {
    kernel(px + i * d, pdy + i * d, g, pm + i, pr + i, with_dx ? pdx + i * d : nullptr, with_params ? dg : nullptr,
           with_params ? db : nullptr, rows, d);
  });
}

void CpuEngine::rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& rstd, Tensor& y) {
  const int64_t d = gamma.numel();
  DT_CHECK(d > 0 && x.size(-1) == d, "rmsnorm over " << d << " features of " << x.str());
  const int64_t m = x.numel() / d;
  DT_CHECK(y.numel() == x.numel() && rstd.numel() == m,
           "rmsnorm of " << x.str() << " into " << y.str() << ", rstd " << rstd.str());
  const float* px = x.device_f32();
  const float* g = gamma.device_f32();
  float* py = y.device_f32();
  float* pr = rstd.device_f32();
  auto kernel = simd::active().rmsnorm_forward;
  for_slices(m, norm_grain(d), 1,
             [&](int64_t i, int64_t rows) { kernel(px + i * d, g, eps, pr + i, py + i * d, rows, d); });
}

// dx = rstd * (dy * gamma - x * rstd^2 * mean(dy * gamma * x)) (simd.cpp).
void CpuEngine::rmsnorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& rstd, Tensor& dx,
                                 Tensor& dgamma) {
  const int64_t d = gamma.numel();
  const int64_t m = x.numel() / d;
  DT_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dgamma.numel() == d && rstd.numel() == m,
           "rmsnorm_backward of " << x.str() << " with dy " << dy.str() << " into " << dx.str());
  const float* px = x.device_f32();
  const float* pdy = dy.device_f32();
  const float* g = gamma.device_f32();
  const float* pr = rstd.device_f32();
  float* pdx = dx.device_f32();
  float* dg = dgamma.device_f32();
  auto kernel = simd::active().rmsnorm_backward;
  norm_backward_rows(m, d, [&](int64_t i, int64_t rows, bool with_dx, bool with_params) {
    kernel(px + i * d, pdy + i * d, g, pr + i, with_dx ? pdx + i * d : nullptr, with_params ? dg : nullptr, rows, d);
  });
}

}  // namespace dtrain::cpu

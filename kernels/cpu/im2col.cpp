#include "im2col.h"

#include <oneapi/dnnl/dnnl.h>

#include <cstring>


namespace dtrain::cpu {

void im2col(const Conv2dGeom& g, const float* x, float* cols) {
  const int64_t p = g.out_h(), q = g.out_w();
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t r = 0; r < g.r; ++r)
      for (int64_t s = 0; s < g.s; ++s) {
        float* row = cols + ((c * g.r + r) * g.s + s) * p * q;
        for (int64_t oh = 0; oh < p; ++oh) {
          int64_t ih = oh * g.stride - g.pad + r;
          float* out = row + oh * q;
          if (ih < 0 || ih >= g.h) {
            std::memset(out, 0, static_cast<size_t>(q) * sizeof(float));
            continue;
          }
          const float* in = x + (c * g.h + ih) * g.w;
          for (int64_t ow = 0; ow < q; ++ow) {
            int64_t iw = ow * g.stride - g.pad + s;
            out[ow] = (iw >= 0 && iw < g.w) ? in[iw] : 0.f;
          }
        }
      }
}

void conv2d_backward_weights_im2col(const Conv2dGeom& g, const float* x, const float* dy, float* dw, float* dbias,
                                    float* cols) {
  const int64_t pq = g.out_h() * g.out_w(), crs = g.c * g.r * g.s;
  for (int64_t n = 0; n < g.n; ++n) {
    im2col(g, x + n * g.c * g.h * g.w, cols);
    const float* dyn = dy + n * g.k * pq;
    // dw [K, CRS] += dy_n [K, PQ] . cols^T [PQ, CRS]
    dnnl_status_t st = dnnl_sgemm('N', 'T', g.k, crs, pq, 1.f, dyn, pq, cols, pq, 1.f, dw, crs);
    DT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st));
    if (dbias)
      for (int64_t k = 0; k < g.k; ++k) {
        const float* row = dyn + k * pq;
        float s = 0.f;
        for (int64_t i = 0; i < pq; ++i) s += row[i];
        dbias[k] += s;
      }
  }
}

}  // namespace dtrain::cpu

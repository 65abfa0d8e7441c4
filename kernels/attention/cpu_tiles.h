// The CPU tile kernels of fused attention (the algorithm: cpu_attention.h), written once over GCC
// vector extensions of DT_ATT_LANES floats and compiled into namespace DT_ATT_NS by each of
// cpu_tiles_generic.cpp (4 lanes), cpu_tiles_avx2.cpp (8) and cpu_tiles_avx512.cpp (16).
// Included by those files only.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_attention.h"

#if !defined(DT_ATT_LANES) || !defined(DT_ATT_NS)
#error "define DT_ATT_LANES and DT_ATT_NS before including cpu_tiles.h"
#endif

namespace dtrain::attention_cpu::DT_ATT_NS {
namespace {

constexpr int W = DT_ATT_LANES;
constexpr int kRows = 4;                 // rows of one micro-kernel
constexpr int kVecs = W == 16 ? 4 : 2;   // W-float vectors per row held in registers
typedef float Vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t Vi __attribute__((vector_size(W * sizeof(int32_t))));
constexpr int64_t BR = kQueryTile, BC = kKeyTile;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline Vf load(const float* p) {
  Vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vf v) { std::memcpy(p, &v, sizeof v); }
inline Vf splat(float x) { return x - Vf{}; }  // x - 0 is x for every x (x + 0 is not for -0)
// v's lanes folded by halves until 4 remain: lane i then combines lanes i, i + 4, i + 8, ...
template <typename Op>
inline Vf fold_to_4(Vf v, Op op) {
#if DT_ATT_LANES == 16
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
#elif DT_ATT_LANES == 8
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
#else
  (void)op;
#endif
  return v;
}
inline float hsum(Vf v) {
  v = fold_to_4(v, [](Vf a, Vf b) { return a + b; });
  return (v[0] + v[1]) + (v[2] + v[3]);
}
inline float hmax(Vf v) {
  v = fold_to_4(v, [](Vf a, Vf b) { return a > b ? a : b; });
  return std::max(std::max(v[0], v[1]), std::max(v[2], v[3]));
}
inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// 2^x for x <= 127 (scores less their running max), 0 below -126 (masked keys: -inf). The integer
// part goes to the exponent (the 1.5 * 2^23 rounding trick), 2^f for |f| <= 1/2 is e^(f ln 2)'s
// Taylor series to degree 7 (relative error under 6e-9 before rounding).
inline Vf exp2v(Vf x) {
  const Vf lo = splat(-126.f), magic = splat(12582912.f);
  const Vf xc = x < lo ? lo : x;
  const Vf t = xc + magic, f = xc - (t - magic);
  Vf p = splat(1.525273380405984e-5f);
  p = p * f + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.618129107628477e-3f;
  p = p * f + 5.550410866482158e-2f;
  p = p * f + 0.2402265069591007f;
  p = p * f + 0.6931471805599453f;
  p = p * f + 1.f;
  const Vi e = (((Vi)t - 0x4B400000) + 127) << 23;
  return x < lo ? splat(0.f) : p * (Vf)e;
}

// c[r][0, N*W) (+)= sum_k a(r, k) b[k][0, N*W) for kRows rows, a(r, k) = a[r * ar + k * ak]: the
// sums held in kRows x N registers, each b row loaded once for the kRows rows.
template <int N>
inline void micro(int64_t kk, const float* a, int64_t ar, int64_t ak, const float* b, int64_t ldb, float* c,
                  int64_t ldc, bool accumulate) {
  Vf s[kRows][N];
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < N; ++n) s[r][n] = accumulate ? load(c + r * ldc + n * W) : Vf{};
  for (int64_t k = 0; k < kk; ++k) {
    Vf bv[N];
    for (int n = 0; n < N; ++n) bv[n] = load(b + k * ldb + n * W);
    for (int r = 0; r < kRows; ++r) {
      const Vf av = splat(a[r * ar + k * ak]);
      for (int n = 0; n < N; ++n) s[r][n] += av * bv[n];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < N; ++n) store(c + r * ldc + n * W, s[r][n]);
}

template <int N>
inline void micro_upto(int left, int64_t kk, const float* a, int64_t ar, int64_t ak, const float* b, int64_t ldb,
                       float* c, int64_t ldc, bool accumulate) {
  if (left == N)
    micro<N>(kk, a, ar, ak, b, ldb, c, ldc, accumulate);
  else if constexpr (N > 1)
    micro_upto<N - 1>(left, kk, a, ar, ak, b, ldb, c, ldc, accumulate);
}

// c [rows, n] (+)= a [rows, kk] b [kk, n], a(r, k) = a[r * ar + k * ak]; rows % kRows == 0, n % W == 0.
void gemm_tile(int64_t rows, int64_t n, int64_t kk, const float* a, int64_t ar, int64_t ak, const float* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < rows; r += kRows)
    for (int64_t j = 0; j < n; j += kVecs * W) {
      const int left = static_cast<int>(std::min<int64_t>(kVecs, (n - j) / W));
      micro_upto<kVecs>(left, kk, a + r * ar, ar, ak, b + j, ldb, c + r * ldc + j, ldc, accumulate);
    }
}

inline float widen(DType t, const void* base, int64_t i) {
  switch (t) {
    case DType::BF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::F16:
      return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

// dst [total, dp] = rows [0, valid) of src (rows of d elements from element `at`), widened to f32;
// the columns past d and the rows past valid are zero.
void pack_rows(DType t, const void* src, int64_t at, int64_t valid, int64_t total, int64_t d, int64_t dp,
               float* dst) {
  for (int64_t r = 0; r < valid; ++r) {
    float* out = dst + r * dp;
    if (t == DType::F32) {
      std::memcpy(out, static_cast<const float*>(src) + at + r * d, sizeof(float) * d);
    } else {
      for (int64_t i = 0; i < d; ++i) out[i] = widen(t, src, at + r * d + i);
    }
    std::fill(out + d, out + dp, 0.f);
  }
  std::fill(dst + valid * dp, dst + total * dp, 0.f);
}

// dst [tiles, dp, BC]: each tile of BC rows of src (`valid` rows of d from element `at`), transposed
// and zero-padded.
void pack_transposed(DType t, const void* src, int64_t at, int64_t valid, int64_t d, int64_t dp, float* dst) {
  const int64_t tiles = (valid + BC - 1) / BC;
  std::fill(dst, dst + tiles * dp * BC, 0.f);
  for (int64_t j = 0; j < valid; ++j) {
    float* col = dst + j / BC * dp * BC + j % BC;
    for (int64_t i = 0; i < d; ++i) col[i * BC] = widen(t, src, at + j * d + i);
  }
}

void pack_kv(const Problem& p, int64_t kv, bool rows) {
  const AttentionShape& s = p.s;
  const int64_t d = s.head_dim, dp = padded(d), at = kv * s.kv_head_stride(), block = p.kv_block();
  pack_transposed(p.dtype, p.k, at, s.kv_len, d, dp, p.k_tiles + kv * block);
  pack_rows(p.dtype, p.v, at, s.kv_len, p.key_tiles() * BC, d, dp, p.v_rows + kv * block);
  if (!rows) return;
  pack_rows(p.dtype, p.k, at, s.kv_len, p.key_tiles() * BC, d, dp, p.k_rows + kv * block);
  pack_transposed(p.dtype, p.v, at, s.kv_len, d, dp, p.v_tiles + kv * block);
}

// One row of a forward tile: scores [BC] (the first `limit` visible) become probabilities relative
// to the new running max m; the running sum l and the output row o [dp] are rescaled to it.
void online_softmax_row(float* row, int64_t limit, float c, float& m, float& l, float* o, int64_t dp) {
  if (limit <= 0) {
    std::fill(row, row + BC, 0.f);
    return;
  }
  for (int64_t j = limit; j < BC; ++j) row[j] = kNegInf;
  Vf mx = splat(kNegInf);
  for (int64_t j = 0; j < BC; j += W) {
    const Vf x = load(row + j) * c;
    store(row + j, x);
    mx = x > mx ? x : mx;
  }
  const float mnew = std::max(m, hmax(mx));
  Vf sum{};
  for (int64_t j = 0; j < BC; j += W) {
    const Vf e = exp2v(load(row + j) - mnew);
    store(row + j, e);
    sum += e;
  }
  const float alpha = m == mnew ? 1.f : std::exp2(m - mnew);  // 0 on the first visible tile (m = -inf)
  l = l * alpha + hsum(sum);
  if (alpha != 1.f)
    for (int64_t i = 0; i < dp; i += W) store(o + i, load(o + i) * alpha);
  m = mnew;
}

// The key/value head (b * KV + h / G) that query head bh (b * H + h) reads.
int64_t kv_head_of(const AttentionShape& s, int64_t bh) { return bh / s.heads * s.kv_heads + bh % s.heads / s.group(); }

void forward_tile(const Problem& p, int64_t bh, int64_t tile, float* scratch) {
  const AttentionShape& s = p.s;
  const int64_t d = s.head_dim, dp = padded(d), tq = s.q_len, tk = s.kv_len;
  const int64_t i0 = tile * BR, valid = std::min(BR, tq - i0), rows = round_up(valid, kRows);
  const int64_t kv = kv_head_of(s, bh);
  float* qt = scratch;      // [BR, dp]
  float* o = qt + BR * dp;  // [BR, dp]
  float* sc = o + BR * dp;  // [BR, BC]
  float* m = sc + BR * BC;  // [BR]
  float* l = m + BR;        // [BR]
  pack_rows(p.dtype, p.q, (bh * tq + i0) * d, valid, rows, d, dp, qt);
  std::fill(o, o + rows * dp, 0.f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.f);
  const float c = s.scale * kLog2e;
  const int64_t end = s.causal ? std::min(tk, s.q_offset + i0 + valid) : tk;
  for (int64_t j0 = 0; j0 < end; j0 += BC) {
    const int64_t keys = std::min(BC, tk - j0);
    const float* kt = p.k_tiles + kv * p.kv_block() + j0 * dp;  // [dp, BC]
    const float* vp = p.v_rows + kv * p.kv_block() + j0 * dp;   // [BC, dp]
    gemm_tile(rows, BC, dp, qt, dp, 1, kt, BC, sc, BC, false);  // s = q k^T
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t limit = s.causal ? std::min(keys, s.q_offset + i0 + i + 1 - j0) : keys;
      online_softmax_row(sc + i * BC, limit, c, m[i], l[i], o + i * dp, dp);
    }
    gemm_tile(rows, dp, BC, sc, BC, 1, vp, dp, o, dp, true);  // o += p v
  }
  for (int64_t i = 0; i < valid; ++i) {
    const float inv = 1.f / l[i];
    float* out = p.out + (bh * tq + i0 + i) * d;
    for (int64_t j = 0; j < d; ++j) out[j] = o[i * dp + j] * inv;
    p.lse[bh * tq + i0 + i] = (m[i] + std::log2(l[i])) * kLn2;
  }
}

// P = exp(scale s - lse) for `rows` rows of a tile (scores in pt, overwritten), 0 where masked.
void recompute_probs(const AttentionShape& s, float* pt, int64_t rows, int64_t i0, int64_t j0, int64_t keys,
                     const float* lse2, float c) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = pt + i * BC;
    const int64_t limit = s.causal ? std::min(keys, s.q_offset + i0 + i + 1 - j0) : keys;
    const float shift = lse2[i0 + i];
    for (int64_t j = 0; j < BC; j += W) store(row + j, exp2v(load(row + j) * c - shift));
    std::fill(row + std::max<int64_t>(limit, 0), row + BC, 0.f);
  }
}

void backward_head(const Problem& p, int64_t bh, float* scratch) {
  const AttentionShape& s = p.s;
  const int64_t d = s.head_dim, dp = padded(d), tq = s.q_len, tk = s.kv_len;
  const int64_t tqp = round_up(tq, BR), tqr = round_up(tq, kRows);
  const int64_t kv = kv_head_of(s, bh);
  float* qp = scratch;          // [tqp, dp]
  float* dop = qp + tqp * dp;   // [tqp, dp]
  float* dqa = dop + tqp * dp;  // [tqp, dp]
  float* di = dqa + tqp * dp;   // [tqp]: rowsum(dO o O)
  float* lse2 = di + tqp;       // [tqp]: lse * log2 e
  float* pt = lse2 + tqp;       // [BR, BC]
  float* ds = pt + BR * BC;     // [BR, BC]
  float* dka = ds + BR * BC;    // [BC, dp]
  float* dva = dka + BC * dp;   // [BC, dp]
  pack_rows(p.dtype, p.q, bh * tq * d, tq, tqp, d, dp, qp);
  pack_rows(DType::F32, p.dout, bh * tq * d, tq, tqp, d, dp, dop);
  std::fill(dqa, dqa + tqp * dp, 0.f);
  for (int64_t i = 0; i < tqp; ++i) {
    float sum = 0;
    if (i < tq)
      for (int64_t j = 0; j < d; ++j) sum += p.dout[(bh * tq + i) * d + j] * p.o[(bh * tq + i) * d + j];
    di[i] = sum;
    lse2[i] = i < tq ? p.lse_in[bh * tq + i] * kLog2e : 0.f;
  }
  const float c = s.scale * kLog2e;
  float* dk_rows = p.dk + (p.per_head ? bh : kv) * tk * d;
  float* dv_rows = p.dv + (p.per_head ? bh : kv) * tk * d;
  for (int64_t j0 = 0; j0 < tk; j0 += BC) {
    const int64_t keys = std::min(BC, tk - j0), at = kv * p.kv_block() + j0 * dp;
    const float *kp = p.k_rows + at, *kt = p.k_tiles + at;  // [BC, dp], [dp, BC]
    const float *vt = p.v_tiles + at;                       // [dp, BC]
    std::fill(dka, dka + BC * dp, 0.f);
    std::fill(dva, dva + BC * dp, 0.f);
    // Under causal masking queries before position j0 see none of these keys.
    const int64_t first = s.causal ? std::max<int64_t>(0, j0 - s.q_offset) / kRows * kRows : 0;
    for (int64_t i0 = first; i0 < tq; i0 += BR) {
      const int64_t rows = std::min(BR, tqr - i0);
      gemm_tile(rows, BC, dp, qp + i0 * dp, dp, 1, kt, BC, pt, BC, false);  // s = q k^T
      recompute_probs(s, pt, rows, i0, j0, keys, lse2, c);
      gemm_tile(BC, dp, rows, pt, 1, BC, dop + i0 * dp, dp, dva, dp, true);  // dv += p^T do
      gemm_tile(rows, BC, dp, dop + i0 * dp, dp, 1, vt, BC, ds, BC, false);  // dp = do v^T
      for (int64_t i = 0; i < rows; ++i) {
        const Vf dii = splat(di[i0 + i]);
        for (int64_t j = 0; j < BC; j += W)
          store(ds + i * BC + j, load(pt + i * BC + j) * (load(ds + i * BC + j) - dii) * s.scale);
      }
      gemm_tile(BC, dp, rows, ds, 1, BC, qp + i0 * dp, dp, dka, dp, true);    // dk += ds^T q
      gemm_tile(rows, dp, BC, ds, BC, 1, kp, dp, dqa + i0 * dp, dp, true);    // dq += ds k
    }
    for (int64_t j = 0; j < keys; ++j) {
      std::memcpy(dk_rows + (j0 + j) * d, dka + j * dp, sizeof(float) * d);
      std::memcpy(dv_rows + (j0 + j) * d, dva + j * dp, sizeof(float) * d);
    }
  }
  for (int64_t i = 0; i < tq; ++i) std::memcpy(p.dq + (bh * tq + i) * d, dqa + i * dp, sizeof(float) * d);
}

}  // namespace

const TileKernels& tiles() {
  static const TileKernels k{.name = DT_ATT_NAME, .pack_kv = pack_kv, .forward_tile = forward_tile, .backward_head = backward_head};
  return k;
}

}  // namespace dtrain::attention_cpu::DT_ATT_NS

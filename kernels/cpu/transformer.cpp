// CpuEngine: the transformer pieces of the contract (axis permutation for attention heads, the
// causal softmax with its scale fused, embedding gather and scatter-add, vocabulary-parallel
// cross-entropy pieces). OpenMP loops; these are
// also the reference the CUDA kernels of kernels/cuda/transformer.cu are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../attention/cpu_attention.h"
#include "cpu_engine.h"
#include "simd.h"

namespace dtrain::cpu {

namespace {

constexpr int64_t kGrain = 1 << 14;

void check_f32_numel(const Tensor& t, int64_t numel, const char* what) {
  DT_CHECK(
      t.defined() && t.dtype() == DType::F32 && cpu_addressable(t) && t.numel() == numel,
      what << " must be an f32 CPU tensor of " << numel << " elements, got " << (t.defined() ? t.str() : "undefined"));
}

void check_ids(const Tensor& ids, const char* op) {
  DT_CHECK(ids.defined() && ids.dtype() == DType::I32 && cpu_addressable(ids),
           op << ": ids must be an i32 CPU tensor, got " << (ids.defined() ? ids.str() : "undefined"));
}

}  // namespace

void CpuEngine::permute_0213(const Tensor& x, int64_t a, int64_t b, int64_t c, int64_t d, Tensor& y) {
  int64_t n = a * b * c * d;
  check_f32_numel(x, n, "permute_0213 input");
  check_f32_numel(y, n, "permute_0213 output");
  const float* px = x.device_f32();
  float* py = y.device_f32();
  // One contiguous run of d floats per (i, j, k): x[i,j,k,:] -> y[i,k,j,:].
#pragma omp parallel for collapse(2) if (n > kGrain)
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j)
      for (int64_t k = 0; k < c; ++k)
        std::memcpy(py + ((i * c + k) * b + j) * d, px + ((i * b + j) * c + k) * d, sizeof(float) * d);
}

FusedAttention* CpuEngine::fused_attention() {
  static const std::unique_ptr<FusedAttention> fused = attention_cpu::cpu_fused_attention(attention_cpu::active_tiles());
  return fused.get();
}

void CpuEngine::attention_softmax_forward(const Tensor& scores, int64_t t, float scale, bool causal, Tensor& probs) {
  DT_CHECK(t > 0 && scores.numel() % (t * t) == 0,
           "causal_softmax: " << scores.str() << " is not [N, " << t << ", " << t << "]");
  check_f32_numel(probs, scores.numel(), "causal_softmax probs");
  check_f32_numel(scores, scores.numel(), "causal_softmax scores");
  const int64_t rows = scores.numel() / t;
  const float* ps = scores.device_f32();
  float* pp = probs.device_f32();
  auto kernel = simd::active().attention_softmax_forward;
  for_slices(rows, kGrain / t, 1,
             [&](int64_t r, int64_t n) { kernel(ps + r * t, pp + r * t, r, n, t, scale, causal); });
}

void CpuEngine::attention_softmax_backward(const Tensor& probs, const Tensor& dprobs, int64_t t, float scale,
                                           bool causal, Tensor& dscores) {
  DT_CHECK(t > 0 && probs.numel() % (t * t) == 0,
           "causal_softmax_backward: " << probs.str() << " is not [N, " << t << ", " << t << "]");
  check_f32_numel(probs, probs.numel(), "causal_softmax_backward probs");
  check_f32_numel(dprobs, probs.numel(), "causal_softmax_backward dprobs");
  check_f32_numel(dscores, probs.numel(), "causal_softmax_backward dscores");
  const int64_t rows = probs.numel() / t;
  const float* pp = probs.device_f32();
  const float* pd = dprobs.device_f32();
  float* pg = dscores.device_f32();
  auto kernel = simd::active().attention_softmax_backward;
  for_slices(rows, kGrain / t, 1,
             [&](int64_t r, int64_t n) { kernel(pp + r * t, pd + r * t, pg + r * t, r, n, t, scale, causal); });
}

void CpuEngine::rotary(const Tensor& x, int64_t t, const Tensor& table, int64_t pos0, bool inverse, Tensor& y) {
  DT_CHECK(table.dim() == 2 && table.size(1) % 2 == 0 && t > 0 && pos0 >= 0 && pos0 + t <= table.size(0),
           "rotary: positions [" << pos0 << ", " << pos0 + t << ") of the table " << table.str());
  const int64_t d = table.size(1), half = d / 2;
  DT_CHECK(x.numel() % (t * d) == 0, "rotary: " << x.str() << " is not [N, " << t << ", " << d << "]");
  check_f32_numel(x, x.numel(), "rotary input");
  check_f32_numel(y, x.numel(), "rotary output");
  check_f32_numel(table, table.numel(), "rotary table");
  const int64_t rows = x.numel() / d;
  const float* px = x.device_f32();
  const float* pt = table.device_f32();
  float* py = y.device_f32();
  const fn::RotatePair rotate{inverse};
  for_slices(rows, kGrain / d, 1, [&](int64_t first, int64_t n) {
    for (int64_t r = first; r < first + n; ++r) {
      const float* cs = pt + (pos0 + r % t) * d;
      const float* in = px + r * d;
      float* out = py + r * d;
      for (int64_t i = 0; i < half; ++i) rotate(in[i], in[i + half], cs[i], cs[i + half], out[i], out[i + half]);
    }
  });
}

void CpuEngine::swiglu_forward(const Tensor& gu, Tensor& y) {
  DT_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "swiglu needs [M, 2F], got " << gu.str());
  const int64_t f = gu.size(-1) / 2, m = gu.numel() / (2 * f);
  check_f32_numel(gu, gu.numel(), "swiglu input");
  check_f32_numel(y, m * f, "swiglu output");
  const float* pg = gu.device_f32();
  float* py = y.device_f32();
  const auto kernel = simd::active().swiglu_forward;
  for_slices(m, kGrain / f + 1, 1, [&](int64_t first, int64_t n) { kernel(pg + first * 2 * f, py + first * f, n, f); });
}

void CpuEngine::swiglu_backward(const Tensor& gu, const Tensor& dy, Tensor& dgu) {
  DT_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "swiglu_backward needs [M, 2F], got " << gu.str());
  const int64_t f = gu.size(-1) / 2, m = gu.numel() / (2 * f);
  check_f32_numel(gu, gu.numel(), "swiglu_backward input");
  check_f32_numel(dy, m * f, "swiglu_backward dy");
  check_f32_numel(dgu, gu.numel(), "swiglu_backward dgu");
  const float* pg = gu.device_f32();
  const float* pd = dy.device_f32();
  float* po = dgu.device_f32();
  const auto kernel = simd::active().swiglu_backward;
  for_slices(m, kGrain / f + 1, 1,
             [&](int64_t first, int64_t n) { kernel(pg + first * 2 * f, pd + first * f, po + first * 2 * f, n, f); });
}

void CpuEngine::row_max(const Tensor& x, Tensor& out) {
  DT_CHECK(x.dim() == 2, "row_max needs [M, N], got " << x.str());
  const int64_t m = x.size(0), n = x.size(1);
  check_f32_numel(x, m * n, "row_max input");
  check_f32_numel(out, m, "row_max output");
  const float* px = x.device_f32();
  float* po = out.device_f32();
#pragma omp parallel for if (m * n > kGrain)
  for (int64_t i = 0; i < m; ++i) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, px[i * n + j]);
    po[i] = mx;
  }
}

void CpuEngine::softmax_rows(const Tensor& x, float scale, Tensor& y) {
  DT_CHECK(x.dim() == 2, "softmax_rows needs x [M, N], got " << x.str());
  const int64_t m = x.size(0), n = x.size(1);
  check_f32_numel(x, m * n, "softmax_rows input");
  check_f32_numel(y, m * n, "softmax_rows output");
  const float* px = x.device_f32();
  float* py = y.device_f32();
#pragma omp parallel for if (m * n > kGrain)
  for (int64_t i = 0; i < m; ++i) {
    const float* row = px + i * n;
    float* out = py + i * n;
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(scale) * row[j]);
    for (int64_t j = 0; j < n; ++j) sum += std::exp(static_cast<double>(scale) * row[j] - mx);
    for (int64_t j = 0; j < n; ++j)
      out[j] = static_cast<float>(std::exp(static_cast<double>(scale) * row[j] - mx) / sum);
  }
}

void CpuEngine::vocab_xent_partials(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                    Tensor& sumexp, Tensor& target) {
  DT_CHECK(logits.dim() == 2, "vocab_xent_partials needs logits [M, Vs], got " << logits.str());
  const int64_t m = logits.size(0), n = logits.size(1);
  check_ids(labels, "vocab_xent_partials");
  DT_CHECK(labels.numel() == m, "vocab_xent_partials: " << labels.str() << " labels for " << logits.str());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&rowmax, &sumexp, &target})
    check_f32_numel(*t, m, "vocab_xent_partials row vector");
  const float* px = logits.device_f32();
  const int32_t* py = labels.device_data<int32_t>();
  const float* pm = rowmax.device_f32();
  float* ps = sumexp.device_f32();
  float* pt = target.device_f32();
#pragma omp parallel for if (m * n > kGrain)
  for (int64_t i = 0; i < m; ++i) {
    const float* row = px + i * n;
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(row[j] - pm[i]);
    ps[i] = static_cast<float>(sum);
    int64_t col = py[i] - offset;
    pt[i] = col >= 0 && col < n ? row[col] : 0.f;
  }
}

void CpuEngine::vocab_xent_loss_accumulate(const Tensor& rowmax, const Tensor& sumexp, const Tensor& target,
                                           const Tensor& labels, Tensor& stats) {
  const int64_t m = rowmax.numel();
  check_ids(labels, "vocab_xent_loss_accumulate");
  DT_CHECK(labels.numel() == m, "vocab_xent_loss_accumulate: " << labels.str() << " labels for " << m << " rows");
  const int32_t* py = labels.device_data<int32_t>();
  check_f32_numel(sumexp, m, "vocab_xent_loss_accumulate sumexp");
  check_f32_numel(target, m, "vocab_xent_loss_accumulate target");
  check_f32_numel(stats, kXentStatsFloats, "vocab_xent_loss_accumulate stats");
  const float *pm = rowmax.device_f32(), *ps = sumexp.device_f32(), *pt = target.device_f32();
  double loss = 0;
  uint64_t hits = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (py[i] == kIgnoreLabel) continue;
    loss += std::log(static_cast<double>(ps[i])) + pm[i] - pt[i];
    hits += pt[i] >= pm[i];  // the target's logit is the row's maximum
  }
  XentStats st;
  std::memcpy(&st, stats.device_raw(), sizeof st);
  st.loss_sum += loss;
  st.hits += hits;
  std::memcpy(stats.device_raw(), &st, sizeof st);
}

void CpuEngine::vocab_xent_backward(const Tensor& logits, const Tensor& labels, int64_t offset, const Tensor& rowmax,
                                    const Tensor& sumexp, float scale, Tensor& dlogits) {
  DT_CHECK(logits.dim() == 2, "vocab_xent_backward needs logits [M, Vs], got " << logits.str());
  const int64_t m = logits.size(0), n = logits.size(1);
  check_ids(labels, "vocab_xent_backward");
  check_f32_numel(dlogits, m * n, "vocab_xent_backward output");
  const float* px = logits.device_f32();
  const int32_t* py = labels.device_data<int32_t>();
  const float* pm = rowmax.device_f32();
  const float* ps = sumexp.device_f32();
  float* pd = dlogits.device_f32();
#pragma omp parallel for if (m * n > kGrain)
  for (int64_t i = 0; i < m; ++i) {
    const float inv = 1.f / ps[i];
    const int64_t col = static_cast<int64_t>(py[i]) - offset;
    const float k = py[i] == kIgnoreLabel ? 0.f : scale;  // no loss on this target
    for (int64_t j = 0; j < n; ++j)
      pd[i * n + j] = k * (std::exp(px[i * n + j] - pm[i]) * inv - (j == col ? 1.f : 0.f));
  }
}

void CpuEngine::embedding_forward(const Tensor& ids, const Tensor& table, int64_t offset, Tensor& y) {
  check_ids(ids, "embedding_forward");
  DT_CHECK(table.dim() == 2, "embedding table must be [V, C], got " << table.str());
  int64_t n = ids.numel(), v = table.size(0), c = table.size(1);
  check_f32_numel(table, v * c, "embedding table");
  check_f32_numel(y, n * c, "embedding output");
  const int32_t* pi = ids.device_data<int32_t>();
  const float* pt = table.device_f32();
  float* py = y.device_f32();
#pragma omp parallel for if (n * c > kGrain)
  for (int64_t r = 0; r < n; ++r) {
    int64_t row = pi[r] - offset;
    if (row >= 0 && row < v)
      std::memcpy(py + r * c, pt + row * c, sizeof(float) * c);
    else
      std::memset(py + r * c, 0, sizeof(float) * c);
  }
}

void CpuEngine::embedding_backward(const Tensor& ids, const Tensor& dy, int64_t offset, Tensor& dtable) {
  check_ids(ids, "embedding_backward");
  DT_CHECK(dtable.dim() == 2, "embedding gradient must be [V, C], got " << dtable.str());
  int64_t n = ids.numel(), v = dtable.size(0), c = dtable.size(1);
  check_f32_numel(dtable, v * c, "embedding gradient");
  check_f32_numel(dy, n * c, "embedding dy");
  const int32_t* pi = ids.device_data<int32_t>();
  const float* pd = dy.device_f32();
  float* pt = dtable.device_f32();
  // Threads own columns, so rows that repeat an id never race (and the sum order is fixed).
#pragma omp parallel for if (n * c > kGrain)
  for (int64_t col = 0; col < c; ++col)
    for (int64_t r = 0; r < n; ++r) {
      int64_t row = pi[r] - offset;
      if (row >= 0 && row < v) pt[row * c + col] += pd[r * c + col];
    }
}

}  // namespace dtrain::cpu

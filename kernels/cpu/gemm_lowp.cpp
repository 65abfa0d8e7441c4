// Low-precision GEMM on the CPU: bf16 operands through a oneDNN matmul primitive (AVX512-BF16
// brgemm kernels on these processors, about twice the fp32 rate), f32 accumulation and output.
// f32 operands under MathPrecision::BF16 are rounded to bf16 into per-thread scratch first; the
// rounding costs O(MK + KN) against the O(MNK) multiply.
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include <cstring>
#include <sstream>
#include <vector>

#include "cpu_engine.h"

namespace dtrain::cpu {

namespace {

void f32_to_bf16_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// VCVTNE2PS2BF16 rounds to nearest even like float_to_bf16 (it flushes f32 subnormals to zero,
// values below 1.2e-38 that do not matter for training).
__attribute__((target("avx512f,avx512bf16"))) void f32_to_bf16_avx512(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 lo = _mm512_loadu_ps(src + i);
    __m512 hi = _mm512_loadu_ps(src + i + 16);
    __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);  // lo fills the lower 16 lanes
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), reinterpret_cast<__m512i&>(r));
  }
  f32_to_bf16_scalar(src + i, dst + i, n - i);
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Reused scratch, one per thread: a steady-state step allocates nothing here.
template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// The AVX2 and F16C forms below give the scalar functions' bits for every non-NaN input (NaN stays
// NaN); tested against them in test_cpu_bf16.cpp.
__attribute__((target("avx2"))) inline __m256i bf16_rounded_bits_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), hi);
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);  // as float_to_bf16
  return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i a = _mm256_srli_epi32(bf16_rounded_bits_avx2(_mm256_loadu_ps(src + i)), 16);
    __m256i b = _mm256_srli_epi32(bf16_rounded_bits_avx2(_mm256_loadu_ps(src + i + 8)), 16);
    // packus works within 128-bit lanes: a0 b0 a1 b1 -> reorder the 64-bit quarters to a0 a1 b0 b1.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  f32_to_bf16_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx2"))) void round_to_bf16_avx2(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(bf16_rounded_bits_avx2(_mm256_loadu_ps(src + i))));
  for (; i < n; ++i) dst[i] = bf16_to_float(float_to_bf16(src[i]));
}

void round_to_bf16_scalar(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(float_to_bf16(src[i]));
}

constexpr int kHalfRounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kHalfRounding));
  for (; i < n; ++i) dst[i] = float_to_f16(src[i]);
}

__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_float(src[i]);
}

__attribute__((target("avx,f16c"))) void round_to_f16_f16c(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i), kHalfRounding)));
  for (; i < n; ++i) dst[i] = f16_to_float(float_to_f16(src[i]));
}

void f32_to_f16_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}
void f16_to_f32_scalar(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
}
void round_to_f16_scalar(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(float_to_f16(src[i]));
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
bool has_f16c() {
  // CPUID leaf 1, ECX bit 29: clang before 16 does not know __builtin_cpu_supports("f16c").
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return yes;
}

// Runs convert over chunks of 64 Ki elements, one OpenMP thread per chunk.
template <typename Src, typename Dst>
void chunked(void (*convert)(const Src*, Dst*, int64_t), const Src* src, Dst* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    convert(src + b, dst + b, std::min(kChunk, n - b));
  }
}

}  // namespace

void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  chunked(has_avx512_bf16() ? f32_to_bf16_avx512 : has_avx2() ? f32_to_bf16_avx2 : f32_to_bf16_scalar, src, dst, n);
}

void round_to_bf16(const float* src, float* dst, int64_t n) {
  chunked(has_avx2() ? round_to_bf16_avx2 : round_to_bf16_scalar, src, dst, n);
}

void f32_to_f16(const float* src, uint16_t* dst, int64_t n) {
  chunked(has_f16c() ? f32_to_f16_f16c : f32_to_f16_scalar, src, dst, n);
}

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  chunked(has_f16c() ? f16_to_f32_f16c : f16_to_f32_scalar, src, dst, n);
}

void round_to_f16(const float* src, float* dst, int64_t n) {
  chunked(has_f16c() ? round_to_f16_f16c : round_to_f16_scalar, src, dst, n);
}

std::string CpuEngine::precision_note() const {
  if (math_ == MathPrecision::BF16 && !has_avx512_bf16())
    return "bf16 is emulated: this processor has no AVX512-BF16, so operands are rounded to bf16 and multiplied "
           "in fp32 (bf16 numerics, no speed-up)";
  if (math_ == MathPrecision::F16)
    return "fp16 operands are rounded to half and multiplied in fp32 (no fast fp16 on CPUs)";
  return "";
}

std::string MatmulShape::key() const {
  std::ostringstream key;
  key << static_cast<int>(operands) << ',' << batch << ',' << ta << tb << ',' << m << ',' << n << ',' << k << ','
      << (batch > 1 ? sa : 0) << ',' << (batch > 1 ? sb : 0) << ',' << (batch > 1 ? sc : 0) << ',' << alpha << ','
      << beta;  // strides matter only between GEMMs of a batch
  return key.str();
}

std::shared_ptr<MatmulPrims> CpuEngine::matmul_prims(const MatmulShape& s) {
  return matmul_cache_.get(s, [this](const MatmulShape& s) -> std::shared_ptr<MatmulPrims> {
    auto p = std::make_shared<MatmulPrims>();
    // Row-major operands; a transposed operand is the same buffer read with swapped strides. A
    // batch adds a leading dimension whose stride is the distance between consecutive GEMMs.
    const memory::dims a_str = s.ta ? memory::dims{1, s.m} : memory::dims{s.k, 1};
    const memory::dims b_str = s.tb ? memory::dims{1, s.k} : memory::dims{s.n, 1};
    const memory::dims c_str{s.n, 1};
    if (s.batch == 1) {
      p->a_md = memory::desc({s.m, s.k}, s.operands, a_str);
      p->b_md = memory::desc({s.k, s.n}, s.operands, b_str);
      p->c_md = memory::desc({s.m, s.n}, dt::f32, c_str);
    } else {
      p->a_md = memory::desc({s.batch, s.m, s.k}, s.operands, {s.sa, a_str[0], a_str[1]});
      p->b_md = memory::desc({s.batch, s.k, s.n}, s.operands, {s.sb, b_str[0], b_str[1]});
      p->c_md = memory::desc({s.batch, s.m, s.n}, dt::f32, {s.sc, c_str[0], c_str[1]});
    }
    dnnl::primitive_attr attr;
    if (s.alpha != 1.f) attr.set_output_scales(0, {s.alpha});
    if (s.beta != 0.f) {
      dnnl::post_ops po;
      po.append_sum(s.beta);
      attr.set_post_ops(po);
    }
    try {
      dnnl::matmul::desc d(p->a_md, p->b_md, p->c_md);
      p->prim = dnnl::matmul(dnnl::matmul::primitive_desc(d, attr, eng_));
    } catch (const dnnl::error&) {
      return nullptr;  // no implementation for these strides: the caller loops over the batch
    }
    return p;
  });
}

bool CpuEngine::gemm_batched_f32_matmul(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                                        const float* a, int64_t sa, const float* b, int64_t sb, float beta, float* c,
                                        int64_t sc) {
  std::shared_ptr<MatmulPrims> p = matmul_prims({dt::f32, batch, ta, tb, m, n, k, sa, sb, sc, alpha, beta});
  if (!p) return false;
  memory ma(p->a_md, eng_, const_cast<float*>(a));
  memory mb(p->b_md, eng_, const_cast<float*>(b));
  memory mc(p->c_md, eng_, c);
  p->prim.execute(strm_, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  strm_.wait();
  return true;
}

void CpuEngine::gemm_lowp(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                          const Tensor& a, int64_t sa, const Tensor& b, int64_t sb, float beta, Tensor& c, int64_t sc) {
  DT_CHECK(cpu_addressable(a) && cpu_addressable(b) && cpu_addressable(c) && c.dtype() == DType::F32,
           "gemm: C must be an f32 CPU tensor, got " << c.str());
  // The multiply's type: a low-precision operand's, else the math precision's; f32 operands are
  // rounded to it.
  const DType low = a.dtype() != DType::F32       ? a.dtype()
                    : b.dtype() != DType::F32     ? b.dtype()
                    : math_ == MathPrecision::F16 ? DType::F16
                                                  : DType::BF16;
  auto fits = [low](const Tensor& t) { return t.dtype() == DType::F32 || t.dtype() == low; };
  DT_CHECK((low == DType::BF16 || low == DType::F16) && fits(a) && fits(b),
           "gemm: A and B must be f32, bf16 or f16 (one low precision at most), got " << a.str() << " and " << b.str());
  const int64_t span_a = (batch - 1) * sa + m * k, span_b = (batch - 1) * sb + k * n;
  DT_CHECK(batch >= 1 && a.numel() >= span_a && b.numel() >= span_b && c.numel() >= (batch - 1) * sc + m * n,
           "gemm " << batch << "x(" << m << "x" << n << "x" << k << "): operands too small (" << a.str() << ", "
                   << b.str() << ", " << c.str() << ")");
  thread_local std::vector<uint16_t> a16, b16;
  thread_local std::vector<float> a32, b32;

  // bf16 runs as a oneDNN bf16 matmul where the processor has one (AVX512-BF16 or AMX). Elsewhere
  // (an AVX2-only processor), and for f16 (no fast fp16 on any of these CPUs), the operands are
  // rounded to the low precision, widened back to f32 and multiplied by sgemm: the same products
  // (a product of two bf16 or f16 values is exact in f32), the same f32 accumulation.
  const bool half = low == DType::F16;
  std::shared_ptr<MatmulPrims> p;
  int64_t per_call = batch;
  if (!half) {
    // The whole batch as one primitive (attention's per-head products); per GEMM when oneDNN has no
    // batched implementation for the strides.
    p = matmul_prims({dt::bf16, batch, ta, tb, m, n, k, sa, sb, sc, alpha, beta});
    if (!p) {
      per_call = 1;
      p = matmul_prims({dt::bf16, 1, ta, tb, m, n, k, sa, sb, sc, alpha, beta});
    }
  }
  if (!p) {
    auto widen = [half](const Tensor& t, int64_t span, std::vector<float>& out) {
      float* o = scratch(out, span);
      if (t.dtype() == DType::F16) {
        f16_to_f32(t.device_data<uint16_t>(), o, span);
      } else if (t.dtype() == DType::BF16) {
        const uint16_t* s = t.device_data<uint16_t>();
#pragma omp parallel for if (span > (1 << 15))
        for (int64_t i = 0; i < span; ++i) o[i] = bf16_to_float(s[i]);
      } else if (half) {
        round_to_f16(t.device_f32(), o, span);
      } else {
        round_to_bf16(t.device_f32(), o, span);
      }
      return o;
    };
    const float* pa = widen(a, span_a, a32);
    const float* pb = widen(b, span_b, b32);
    for (int64_t i = 0; i < batch; ++i) {
      dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, pa + i * sa, ta ? m : k,
                                    pb + i * sb, tb ? k : n, beta, c.device_f32() + i * sc, n);
      DT_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st));
    }
    return;
  }

  // bf16 operands as they are (a weight's working copy), f32 ones rounded into scratch.
  auto bf16_of = [](const Tensor& t, int64_t span, std::vector<uint16_t>& out) -> const uint16_t* {
    if (t.dtype() == DType::BF16) return t.device_data<uint16_t>();
    uint16_t* o = scratch(out, span);
    f32_to_bf16(t.device_f32(), o, span);
    return o;
  };
  const uint16_t* pa = bf16_of(a, span_a, a16);
  const uint16_t* pb = bf16_of(b, span_b, b16);
  for (int64_t i = 0; i < batch; i += per_call) {
    memory ma(p->a_md, eng_, const_cast<uint16_t*>(pa + i * sa));
    memory mb(p->b_md, eng_, const_cast<uint16_t*>(pb + i * sb));
    memory mc(p->c_md, eng_, c.device_f32() + i * sc);
    p->prim.execute(strm_, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  }
  strm_.wait();
}

}  // namespace dtrain::cpu

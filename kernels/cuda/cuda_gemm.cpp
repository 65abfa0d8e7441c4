// GEMM on the CUDA engine through cuBLASLt, on tensor cores for TF32/BF16/FP16 operands with f32
// accumulation and an f32 result. cuBLASLt is column-major and dtrain row-major, so the row-major
// C[M,N] = op(A)[M,K] op(B)[K,N] is computed as the column-major C^T[N,M] = op(B)^T op(A)^T: the
// same buffers, operands swapped, no data moved.
#include <cstdint>
#include <sstream>

#include "cuda_common.h"
#include "cuda_engine.h"
#include "plans.h"

namespace dtrain::cuda {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// The largest power of two (<= 256) dividing the address: cuBLASLt assumes 256-byte aligned
// operands unless told otherwise, and a view (slice0) may be less aligned.
uint32_t alignment(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al /= 2;
  return al;
}

}  // namespace

GemmPlan& CudaEngine::gemm_plan(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t batch, int64_t sa,
                                int64_t sb, int64_t sc, DType in, bool tf32, const void* pa, const void* pb,
                                const void* pc) {
  uint32_t al_a = alignment(pa), al_b = alignment(pb), al_c = alignment(pc);
  std::ostringstream key;
  key << ta << tb << ',' << m << ',' << n << ',' << k << ',' << batch << ',' << sa << ',' << sb << ',' << sc << ','
      << static_cast<int>(in) << tf32 << ',' << al_a << ',' << al_b << ',' << al_c;
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = gemm_plans_[key.str()];
  if (slot) return *slot;
  auto p = std::make_unique<GemmPlan>();
  cublasComputeType_t compute = (in == DType::F32 && tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  DT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F));
  // cuBLASLt's A is dtrain's B and the reverse (see the top of the file).
  cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  DT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  DT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  // Stored column-major shapes: dtrain's B is [K,N] row-major = N x K column-major (or [N,K] when
  // transposed = K x N); dtrain's A likewise; C is N x M with leading dimension N.
  DT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, cuda_type(in), tb ? k : n, tb ? n : k, tb ? k : n));
  DT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, cuda_type(in), ta ? m : k, ta ? k : m, ta ? m : k));
  DT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, n, m, n));
  if (batch > 1) {
    auto set_batch = [batch](cublasLtMatrixLayout_t l, int64_t stride) {
      int32_t count = static_cast<int32_t>(batch);
      DT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      DT_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    };
    set_batch(p->a, sb);
    set_batch(p->b, sa);
    set_batch(p->c, sc);
  }
  cublasLtMatmulPreference_t pref = nullptr;
  DT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kGemmWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b, sizeof al_b);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof al_a);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  DT_CUBLAS_CHECK(st);
  DT_CHECK(found > 0, "cuBLASLt has no algorithm for gemm " << m << "x" << n << "x" << k << " (batch " << batch << ", "
                                                            << dtype_name(in) << ")");
  p->algo = result.algo;
  p->workspace = result.workspaceSize;
  slot = std::move(p);
  return *slot;
}

void CudaEngine::gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a, const Tensor& b,
                      float beta, Tensor& c) {
  gemm_batched(1, ta, tb, m, n, k, alpha, a, m * k, b, k * n, beta, c, m * n);
}

void CudaEngine::gemm_batched(int64_t batch, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                              const Tensor& a, int64_t sa, const Tensor& b, int64_t sb, float beta, Tensor& c,
                              int64_t sc) {
  DT_CHECK(a.device() == device() && b.device() == device() && c.device() == device() && c.dtype() == DType::F32,
           "gemm on " << device().str() << ": A " << a.str() << ", B " << b.str() << ", C (f32) " << c.str());
  // The multiply's type: a low-precision operand's (a weight's working copy), else the math
  // precision's; f32 operands are rounded to it.
  DType in = a.dtype() != DType::F32        ? a.dtype()
             : b.dtype() != DType::F32      ? b.dtype()
             : math_ == MathPrecision::BF16 ? DType::BF16
             : math_ == MathPrecision::F16  ? DType::F16
                                            : DType::F32;
  auto fits = [in](const Tensor& t) { return t.dtype() == DType::F32 || t.dtype() == in; };
  DT_CHECK((in == DType::F32 || in == DType::BF16 || in == DType::F16) && fits(a) && fits(b),
           "gemm: A and B must be f32, bf16 or f16 (one low precision at most), got " << a.str() << " and " << b.str());
  const int64_t span_a = (batch - 1) * sa + m * k, span_b = (batch - 1) * sb + k * n;
  DT_CHECK(batch >= 1 && a.numel() >= span_a && b.numel() >= span_b && c.numel() >= (batch - 1) * sc + m * n,
           "gemm " << batch << "x(" << m << "x" << n << "x" << k << "): operands too small");
  if (m == 0 || n == 0) return;
  bind();
  // f32 operands of a low-precision multiply: rounded copies (scratch from the caching allocator, so
  // no cudaMalloc after the first step).
  Tensor a_lp, b_lp;
  const void* pa = a.device_raw();
  const void* pb = b.device_raw();
  if (in != DType::F32 && a.dtype() == DType::F32) {
    a_lp = lowp_copy(a.numel() == span_a ? a : a.reshape({-1}).slice0(0, span_a), in);
    pa = a_lp.device_raw();
  }
  if (in != DType::F32 && b.dtype() == DType::F32) {
    b_lp = lowp_copy(b.numel() == span_b ? b : b.reshape({-1}).slice0(0, span_b), in);
    pb = b_lp.device_raw();
  }
  GemmPlan& p = gemm_plan(ta, tb, m, n, k, batch, sa, sb, sc, in, math_ == MathPrecision::TF32, pa, pb, c.device_raw());
  void* ws = workspace(p.workspace);
  DT_CUBLAS_CHECK(cublasLtMatmul(lt_, p.op, &alpha, pb, p.a, pa, p.b, &beta, c.device_raw(), p.c, c.device_raw(), p.c,
                                 &p.algo, ws, p.workspace, compute_));
}

}  // namespace dtrain::cuda

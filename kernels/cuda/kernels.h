#pragma once
// Launchers of the engine's own CUDA kernels (elementwise.cu, rowwise.cu, optim_kernels.cu). Plain
// pointers and a stream: the .cpp host code calls these, only the .cu files see kernel syntax.
// All launches are asynchronous on `s`; scalar results land in device memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "dtrain/kernels/engine.h"

namespace dtrain::cuda::k {

// ---- elementwise.cu (n elements each)
void unary_forward(Unary op, const float* x, float* y, int64_t n, cudaStream_t s);
void unary_backward(Unary op, const float* x, const float* dy, float* dx, int64_t n, cudaStream_t s);
void mul(const float* a, const float* b, float* y, int64_t n, cudaStream_t s);
void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s);
void axpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t s);
void scale(float* y, float alpha, int64_t n, cudaStream_t s);
void fill(float* y, float value, int64_t n, cudaStream_t s);
void dropout_mask(float* mask, float p, uint64_t seed, int64_t n, cudaStream_t s);
// f32 <-> bf16/f16 (the 16-bit types as raw uint16_t, round to nearest even).
void cast(const void* src, DType from, void* dst, DType to, int64_t n, cudaStream_t s);
// dst = src rounded to the nearest bf16, kept in f32 (cast to bf16 and back, in one kernel).
void round_to_bf16(const float* src, float* dst, int64_t n, cudaStream_t s);
// y[M,N] += bias[N]; dbias[N] += column sums of dy[M,N].
void add_row_bias(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t s);
void row_bias_grad(const float* dy, float* dbias, int64_t m, int64_t n, cudaStream_t s);
// *out (zeroed by the caller) += sum of x^2 in f64.
void sum_squares(const float* x, int64_t n, double* out, cudaStream_t s);
// x *= inv_scale; *found_inf = 1 when an element is inf or NaN after scaling.
void unscale_and_check(float* x, float inv_scale, int64_t n, float* found_inf, cudaStream_t s);
void check_finite(const float* x, int64_t n, float* found_inf, cudaStream_t s);  // sets *found_inf = 1 on inf/NaN

// ---- rowwise.cu: softmax cross-entropy over logits [M,C], LayerNorm over x [M,D]
// loss_sum (f64, zeroed by the caller) += per-row losses; correct (zeroed) += argmax hits;
// bad_label (zeroed) = 1 when a label is outside [0, C).
void softmax_xent_forward(const float* logits, const int32_t* labels, float* probs, int64_t m, int64_t c,
                          double* loss_sum, unsigned long long* correct, int* bad_label, cudaStream_t s);
void softmax_xent_backward(const float* probs, const int32_t* labels, float scale, float* dlogits, int64_t m, int64_t c,
                           cudaStream_t s);
// Vocabulary-parallel cross-entropy pieces over a slice [M, N] of the logits (see Engine).
void row_max(const float* x, float* out, int64_t m, int64_t n, cudaStream_t s);
// y = row-wise softmax of scale * x, x and y [m, n].
void softmax_rows(const float* x, float scale, float* y, int64_t m, int64_t n, cudaStream_t s);
// *loss_sum += sum_i log(sumexp[i]) + rowmax[i] - target[i] and *hits += the rows whose target is
// their maximum (m rows).
void vocab_xent_loss(const float* rowmax, const float* sumexp, const float* target, const int32_t* labels, int64_t m,
                     double* loss_sum, unsigned long long* hits, cudaStream_t s);
void vocab_xent_partials(const float* logits, const int32_t* labels, int64_t offset, const float* rowmax, float* sumexp,
                         float* target, int64_t m, int64_t n, cudaStream_t s);
void vocab_xent_backward(const float* logits, const int32_t* labels, int64_t offset, const float* rowmax,
                         const float* sumexp, float scale, float* dlogits, int64_t m, int64_t n, cudaStream_t s);
void layernorm_forward(const float* x, const float* gamma, const float* beta, float eps, float* mean, float* rstd,
                       float* y, int64_t m, int64_t d, cudaStream_t s);
// dx overwritten; dgamma, dbeta accumulated.
void layernorm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t m, int64_t d, cudaStream_t s);

// Per channel c of x [N,C,HW]: with b == nullptr, out1[c] = sum x and (out2 != nullptr) out2[c] =
// sum x^2; with b, out1[c] = sum x*b. f64 accumulation, outputs overwritten.
void channel_reduce(const float* x, const float* b, float* out1, float* out2, int64_t n, int64_t c, int64_t hw,
                    cudaStream_t s);
// y [N,C,HW] = x * scale[c] + shift[c]
void channel_affine(const float* x, const float* scale, const float* shift, float* y, int64_t n, int64_t c, int64_t hw,
                    cudaStream_t s);

// ---- transformer.cu: attention and embedding pieces (shapes as in the Engine contract)
// y[i,k,j,:] = x[i,j,k,:] for x [a,b,c,d].
// RMSNorm rows of x [M, D] (rowwise.cu); Llama's rotary pairs and SwiGLU (transformer.cu).
void rmsnorm_forward(const float* x, const float* gamma, float eps, float* rstd, float* y, int64_t m, int64_t d,
                     cudaStream_t s);
void rmsnorm_backward(const float* x, const float* dy, const float* gamma, const float* rstd, float* dx, float* dgamma,
                      int64_t m, int64_t d, cudaStream_t s);
void rotary(const float* x, const float* table, float* y, int64_t rows, int64_t t, int64_t d, int64_t pos0,
            bool inverse, cudaStream_t s);
void swiglu_forward(const float* gu, float* y, int64_t m, int64_t f, cudaStream_t s);
void swiglu_backward(const float* gu, const float* dy, float* dgu, int64_t m, int64_t f, cudaStream_t s);
void permute_0213(const float* x, float* y, int64_t a, int64_t b, int64_t c, int64_t d, cudaStream_t s);
// probs/scores [rows = N*T, T]; row r is query position r % T.
void attention_softmax_forward(const float* scores, float* probs, int64_t rows, int64_t t, float scale, bool causal,
                               cudaStream_t s);
void attention_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t t,
                                float scale, bool causal, cudaStream_t s);
// table [v,c] holds vocabulary rows [offset, offset+v); ids [n]; y/dy [n,c].
void embedding_forward(const int32_t* ids, const float* table, float* y, int64_t n, int64_t v, int64_t c,
                       int64_t offset, cudaStream_t s);
void embedding_backward(const int32_t* ids, const float* dy, float* dtable, int64_t n, int64_t v, int64_t c,
                        int64_t offset, cudaStream_t s);

// ---- compress.cu: top-k sparsification (CUB's stable radix sort)
// Scratch bytes topk_abs needs for n elements and k kept (CUB's temporary storage).
size_t topk_scratch_bytes(int64_t n, int64_t k);
// idx[0..k) = the indices of the k largest |x|, ties to the lower index, in ascending order.
// keys [2n] u32, order [2n] i32 and scratch (topk_scratch_bytes) are device work areas.
void topk_abs(const float* x, int64_t n, int64_t k, int32_t* idx, uint32_t* keys, int32_t* order, void* scratch,
              size_t scratch_bytes, cudaStream_t s);
// vals[j] = x[idx[j]] (vals may be null), then x[idx[j]] = 0.
void gather_and_clear(float* x, const int32_t* idx, float* vals, int64_t k, cudaStream_t s);
// y[idx[j]] += vals[j], indices distinct.
void scatter_add(const int32_t* idx, const float* vals, float* y, int64_t k, cudaStream_t s);
// The other encodings of Engine (engine.h documents them; the payloads' first 4 bytes are the f32
// scale or norm, written by a one-block f64 reduction, so every run gives the same bits).
void sign_encode(float* x, int64_t n, uint8_t* payload, cudaStream_t s);
void sign_decode_add(const uint8_t* payload, int64_t n, float* y, cudaStream_t s);
void qsgd_encode(const float* x, int64_t n, int levels, uint64_t seed, uint8_t* payload, cudaStream_t s);
void qsgd_decode_add(const uint8_t* payload, int64_t n, int levels, float* y, cudaStream_t s);
void orthonormalize_columns(float* m, int64_t rows, int64_t cols, cudaStream_t s);

// ---- optim_kernels.cu (the functors of dtrain/kernels/functors.h)
void sgd_update(float* p, const float* g, float* buf, int64_t n, float lr, float momentum, float dampening,
                float weight_decay, bool nesterov, cudaStream_t s);
void adam_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2, float eps,
                 float weight_decay, bool decoupled, float bias1, float bias2, cudaStream_t s);

}  // namespace dtrain::cuda::k

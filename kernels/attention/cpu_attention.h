#pragma once
// The CPU's fused attention, private to kernels/attention/: the problem one call solves, and the
// tile kernels that solve one task of it, built from one source (cpu_tiles.h) three times:
// portable (cpu_tiles_generic.cpp), AVX2 + FMA and AVX-512 (the only files compiled with those
// instruction sets). cpu.cpp checks the tensors, splits the work into tasks across OpenMP threads
// and picks the widest table the processor runs.
//
// The algorithm is FlashAttention-2's. Forward, one task per (head, tile of kQueryTile queries):
// the queries' scores against each tile of kKeyTile keys, an online softmax (running max and sum
// in f32, exp2 of scores pre-multiplied by scale * log2 e), the output rescaled and accumulated;
// then out = acc / sum and lse = max + log(sum). Under causal masking the key tiles past the
// queries' last position are never visited. Backward, one task per query head: for each key tile,
// for each query tile that sees it, P = exp(scale s - lse) recomputed, dV += P^T dO, dP = dO V^T,
// dS = P (dP - rowsum(dO o O)) scale, dK += dS^T Q, dQ += dS K; a head's dQ is its own, and with
// grouped-query attention each head writes its dK, dV apart (summed over the group afterwards),
// so no two tasks write one element.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "dtrain/core/dtype.h"
#include "dtrain/kernels/attention.h"

namespace dtrain::attention_cpu {

inline constexpr int64_t kQueryTile = 64, kKeyTile = 64;
// Head widths are padded to a multiple of 16 floats inside the tiles (one AVX-512 register).
inline constexpr int64_t kPad = 16;
inline int64_t padded(int64_t d) { return (d + kPad - 1) / kPad * kPad; }
inline int64_t query_tiles(const AttentionShape& s) { return (s.q_len + kQueryTile - 1) / kQueryTile; }

struct Problem {
  AttentionShape s;
  DType dtype = DType::F32;            // of q, k, v
  const void *q = nullptr, *k = nullptr, *v = nullptr;  // q [B, H, Tq, D]; k, v [B, KV, stride]
  float *out = nullptr, *lse = nullptr;                  // forward: [B, H, Tq, D], [B, H, Tq]
  const float *o = nullptr, *lse_in = nullptr, *dout = nullptr;  // backward's inputs
  float* dq = nullptr;                                           // [B, H, Tq, D]
  // dK, dV of query head bh go to rows [bh * Tk, (bh + 1) * Tk) of [B*H, Tk, D] when per_head (a
  // group's partial sums), else to its key/value head's rows of [B*KV, Tk, D].
  float *dk = nullptr, *dv = nullptr;
  bool per_head = false;
  // k and v packed once per call by pack_kv, kv_block() floats per key/value head each: their rows
  // padded to [key tiles * kKeyTile, dp] (zero rows and columns past the data) and their transposes
  // tile by tile, [key tiles, dp, kKeyTile]. The forward reads k_tiles and v_rows only.
  float *k_rows = nullptr, *k_tiles = nullptr, *v_rows = nullptr, *v_tiles = nullptr;
  int64_t key_tiles() const { return (s.kv_len + kKeyTile - 1) / kKeyTile; }
  int64_t kv_block() const { return key_tiles() * kKeyTile * padded(s.head_dim); }
};

// Floats of scratch one thread needs for a forward task and for a backward task.
size_t forward_scratch(const AttentionShape& s);
size_t backward_scratch(const AttentionShape& s);

struct TileKernels {
  const char* name;
  // Packs key/value head `kv` (b * KV + its head) into p's k_rows, k_tiles, v_rows, v_tiles
  // (the rows only where `rows`: the backward's).
  void (*pack_kv)(const Problem& p, int64_t kv, bool rows);
  // Query tile `tile` of head bh (b * H + h): out and lse of those rows.
  void (*forward_tile)(const Problem& p, int64_t bh, int64_t tile, float* scratch);
  // Query head bh: its dq rows and its dk, dv (see Problem).
  void (*backward_head)(const Problem& p, int64_t bh, float* scratch);
};

namespace generic {
const TileKernels& tiles();
}
namespace avx2 {
const TileKernels& tiles();
}
namespace avx512 {
const TileKernels& tiles();
}

const TileKernels& generic_tiles();
const TileKernels* avx2_tiles();    // null without AVX2 and FMA
const TileKernels* avx512_tiles();  // null without AVX-512 F/BW/VL/DQ
const TileKernels& active_tiles();  // the widest of them, decided once

// The CPU's fused attention with a given table (the engine's runs active_tiles(); the tests run each).
std::unique_ptr<FusedAttention> cpu_fused_attention(const TileKernels& tiles);

}  // namespace dtrain::attention_cpu

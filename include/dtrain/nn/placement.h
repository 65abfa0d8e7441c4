#pragma once
// Where a parameter lies in the one-rank model: its tensor-parallel part, set by whoever cuts it
// (the tp layers, a vocabulary shard), and its shape while a data-parallel layout frees its value
// (ZeRO-3). Shapes of the whole tensors, gathers, loads, clipping and checkpoint pieces read it.
#include <utility>
#include <vector>

#include "dtrain/core/tensor.h"

namespace dtrain::nn {

// Where one tp rank's part of a parameter lies in the one-rank tensor, both seen as matrices of
// rows (the first dimension) by columns (the rest): runs of its rows at rows of the whole, and its
// columns at the whole's [first_column, first_column + columns). Of the tp ranks holding the same
// rows (a replicated tensor, a replicated key/value block) the first one `writes` them into a
// checkpoint's shard parts.
struct TpPart {
  struct Rows {
    int64_t local, whole, count;
    bool writes;
  };
  Shape local, whole;
  int64_t first_column = 0, columns = 0, whole_columns = 0;
  std::vector<Rows> rows;  // in local order
  // The whole tensor, held alike by every tp rank; `writes` on one of them.
  static TpPart replicated(const Shape& shape, bool writes);
  // Rows [first, first + count) of a whole tensor of shape `whole` (a vocabulary's slice).
  static TpPart row_range(const Shape& whole, int64_t first, int64_t count);
};

// `count` elements in a row, at flat index `local` of a rank's tp part and `whole` of the whole.
struct ElementRun {
  int64_t local, whole, count;
};
// The part's elements [from, from + count) as runs of the whole tensor (with `written_only`, those
// this rank writes), in local order, neighbours merged.
std::vector<ElementRun> whole_runs(const TpPart& part, int64_t from, int64_t count, bool written_only);
// The whole tensor's elements [from, from + count) that the part holds, in whole order.
std::vector<ElementRun> part_runs(const TpPart& part, int64_t from, int64_t count);
// The part's elements [from, from + count) that this rank writes, as ranges [first, last) of the
// part (the elements a norm over the tp ranks counts here).
std::vector<std::pair<int64_t, int64_t>> written_elements(const TpPart& part, int64_t from, int64_t count);

struct Placement {
  // Split over the tp group: every tp rank's part, by tp rank, and this rank's. Empty: every tp
  // rank holds the whole tensor.
  std::vector<TpPart> tp;
  int tp_rank = 0;
  // This rank's shape while the value is freed between passes (ZeRO-3); empty: the value's.
  Shape freed_shape;
  bool split() const { return !tp.empty(); }
  const TpPart& own() const { return tp.at(static_cast<size_t>(tp_rank)); }
};

struct Parameter;
// This rank's shape of `p` (its value's, or the one kept while the value is freed), the one-rank
// model's, and where this rank's part lies in it (`tp_rank`: this rank's place in the tp group; a
// tensor not split is the whole, which tp rank 0 writes).
Shape local_shape(const Parameter& p);
Shape whole_shape(const Parameter& p);
TpPart tp_part(const Parameter& p, int tp_rank);

// The placement of a tensor cut into `parts` (one per tp rank, each naming the whole's shape),
// this rank's part being `parts[rank]`.
Placement split_placement(std::vector<TpPart> parts, int rank);
// This rank's part of `whole` (on the host) as a new tensor; `whole` itself when nothing is split.
Tensor own_part(const Placement& placement, const Tensor& whole);
// The whole tensor from every tp rank's part, `parts` [tp ranks, part elements] on the host, in
// rank order (an allgather's result).
Tensor join_parts(const Placement& placement, const Tensor& parts);

}  // namespace dtrain::nn

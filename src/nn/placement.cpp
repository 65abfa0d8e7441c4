// Where a parameter's tp part lies in the one-rank tensor (placement.h): its elements as runs of
// the whole tensor's and back, a part cut from a whole tensor and the whole joined from the parts.
#include "dtrain/nn/placement.h"

#include <algorithm>
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/nn/module.h"

namespace dtrain::nn {


namespace {

// `runs` sorted by `key` (local or whole), neighbours in both layouts merged into one.
template <class Key>
std::vector<ElementRun> merged(std::vector<ElementRun> runs, Key key) {
  std::sort(runs.begin(), runs.end(), [&](const ElementRun& a, const ElementRun& b) { return key(a) < key(b); });
  std::vector<ElementRun> out;
  for (const ElementRun& r : runs) {
    if (!out.empty() && out.back().local + out.back().count == r.local &&
        out.back().whole + out.back().count == r.whole)
      out.back().count += r.count;
    else
      out.push_back(r);
  }
  return out;
}

}  // namespace

TpPart TpPart::replicated(const Shape& shape, bool writes) {
  TpPart p;
  p.local = p.whole = shape;
  const int64_t rows = shape.empty() ? 1 : shape[0], n = shape_numel(shape);
  p.columns = p.whole_columns = rows > 0 ? n / rows : 0;
  p.rows = {{0, 0, rows, writes}};
  return p;
}

TpPart TpPart::row_range(const Shape& whole, int64_t first, int64_t count) {
  Shape local = whole;
  local[0] = count;
  TpPart p = replicated(local, true);
  p.whole = whole;
  p.rows = {{0, first, count, true}};
  return p;
}

std::vector<ElementRun> whole_runs(const TpPart& part, int64_t from, int64_t count, bool written_only) {
  std::vector<ElementRun> runs;
  const int64_t cols = part.columns;
  if (cols == 0) return runs;
  for (const TpPart::Rows& r : part.rows) {
    if (written_only && !r.writes) continue;
    const int64_t lo = std::max(from, r.local * cols), hi = std::min(from + count, (r.local + r.count) * cols);
    for (int64_t i = lo; i < hi;) {
      const int64_t row = i / cols, col = i % cols, n = std::min(hi - i, cols - col);
      runs.push_back({i, (r.whole + row - r.local) * part.whole_columns + part.first_column + col, n});
      i += n;
    }
  }
  return merged(std::move(runs), [](const ElementRun& e) { return e.local; });
}

std::vector<ElementRun> part_runs(const TpPart& part, int64_t from, int64_t count) {
  std::vector<ElementRun> runs;
  const int64_t wc = part.whole_columns;
  if (wc == 0) return runs;
  for (const TpPart::Rows& r : part.rows) {
    const int64_t first = std::max(r.whole, from / wc),
                  last = std::min(r.whole + r.count, (from + count + wc - 1) / wc);
    for (int64_t w = first; w < last; ++w) {
      const int64_t begin = w * wc + part.first_column;  // this part's columns of whole row w
      const int64_t lo = std::max(from, begin), hi = std::min(from + count, begin + part.columns);
      if (lo < hi) runs.push_back({(r.local + w - r.whole) * part.columns + lo - begin, lo, hi - lo});
    }
  }
  return merged(std::move(runs), [](const ElementRun& e) { return e.whole; });
}

std::vector<std::pair<int64_t, int64_t>> written_elements(const TpPart& part, int64_t from, int64_t count) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const TpPart::Rows& r : part.rows) {
    if (!r.writes) continue;
    const int64_t lo = std::max(from, r.local * part.columns);
    const int64_t hi = std::min(from + count, (r.local + r.count) * part.columns);
    if (lo >= hi) continue;
    if (!out.empty() && out.back().second == lo)
      out.back().second = hi;
    else
      out.emplace_back(lo, hi);
  }
  return out;
}


Shape local_shape(const Parameter& p) {
  return p.placement.freed_shape.empty() ? p.value.shape() : p.placement.freed_shape;
}

Shape whole_shape(const Parameter& p) { return p.placement.split() ? p.placement.own().whole : local_shape(p); }

TpPart tp_part(const Parameter& p, int tp_rank) {
  return p.placement.split() ? p.placement.own() : TpPart::replicated(local_shape(p), tp_rank == 0);
}

Placement split_placement(std::vector<TpPart> parts, int rank) {
  DT_CHECK(rank >= 0 && static_cast<size_t>(rank) < parts.size(), "placement: rank " << rank << " of " << parts.size());
  Placement p;
  p.tp = std::move(parts);
  p.tp_rank = rank;
  return p;
}

namespace {

// Copies the runs from `from` (flat, at each run's `source` index) to `to` (at its `target`).
template <class Source, class Target>
void copy_runs(const std::vector<ElementRun>& runs, const Tensor& from, int64_t from_offset, Tensor& to,
               Source source, Target target) {
  const size_t es = dtype_size(from.dtype());
  const auto* src = static_cast<const char*>(from.raw());
  auto* dst = static_cast<char*>(to.raw());
  for (const ElementRun& r : runs)
    std::memcpy(dst + static_cast<size_t>(target(r)) * es, src + static_cast<size_t>(from_offset + source(r)) * es,
                static_cast<size_t>(r.count) * es);
}

}  // namespace

Tensor own_part(const Placement& placement, const Tensor& whole) {
  if (!placement.split()) return whole;
  const TpPart& part = placement.own();
  DT_CHECK(whole.device().is_cpu() && whole.shape() == part.whole,
           "placement: cannot cut " << whole.str() << " into a part of " << shape_str(part.whole));
  Tensor out = Tensor::empty(part.local, whole.dtype());
  copy_runs(part_runs(part, 0, whole.numel()), whole, 0, out, [](const ElementRun& r) { return r.whole; },
            [](const ElementRun& r) { return r.local; });
  return out;
}

Tensor join_parts(const Placement& placement, const Tensor& parts) {
  DT_CHECK(placement.split() && parts.device().is_cpu(), "placement: join_parts of an unsplit tensor");
  const int64_t n = shape_numel(placement.own().local);
  DT_CHECK(parts.numel() == n * static_cast<int64_t>(placement.tp.size()),
           "placement: " << placement.tp.size() << " parts of " << n << " elements, given " << parts.str());
  Tensor whole = Tensor::empty(placement.own().whole, parts.dtype());
  for (size_t r = 0; r < placement.tp.size(); ++r)  // replicated rows are written once per copy, alike
    copy_runs(whole_runs(placement.tp[r], 0, n, false), parts, static_cast<int64_t>(r) * n, whole,
              [](const ElementRun& e) { return e.local; }, [](const ElementRun& e) { return e.whole; });
  return whole;
}

}  // namespace dtrain::nn

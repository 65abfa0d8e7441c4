// Where a rank's tp part of a parameter lies in the one-rank tensor (tensor_parallel.h): its
// elements as runs of the whole tensor's and back, for checkpoint pieces that no rank gathers.
#include <algorithm>

#include "dtrain/parallel/tensor_parallel.h"

namespace dtrain::parallel {

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

}  // namespace dtrain::parallel

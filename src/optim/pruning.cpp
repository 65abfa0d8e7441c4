#include "dtrain/optim/pruning.h"

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::optim {

namespace {

Tensor ones_like(const Tensor& t) {
  Tensor m = zeros_on(t.shape(), t.device());
  engine_for(t.device()).fill(m, 1.f);
  return m;
}

// The k-th smallest of `v` (k < v.size()): values at or below it are pruned.
float kth_smallest(std::vector<float> v, size_t k) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

// Zeroes the `count` entries of `score` with the smallest values (ties: the lower index first), so
// exactly `count` are pruned whatever the ties.
std::vector<uint8_t> smallest(const std::vector<float>& score, size_t count) {
  std::vector<size_t> order(score.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return score[a] < score[b]; });
  std::vector<uint8_t> pruned(score.size(), 0);
  for (size_t i = 0; i < count && i < order.size(); ++i) pruned[order[i]] = 1;
  return pruned;
}

}  // namespace

MagnitudePruner::MagnitudePruner(std::vector<nn::Parameter*> weights, std::vector<nn::Parameter*> biases,
                                 PruneOptions o)
    : weights_(std::move(weights)), biases_(std::move(biases)), o_(o) {
  DT_INPUT_CHECK(o.sparsity >= 0.f && o.sparsity < 1.f, "option --prune-sparsity must be in [0, 1), got " << o.sparsity);
  DT_INPUT_CHECK(o.start >= 0 && o.every >= 1, "options --prune-start must be >= 0 and --prune-every >= 1");
  DT_INPUT_CHECK(!weights_.empty(), "option --prune-sparsity: the model has no weight to prune");
  biases_.resize(weights_.size(), nullptr);
  for (size_t i = 0; i < weights_.size(); ++i) {
    const Tensor& w = weights_[i]->value;
    masks_.push_back(ones_like(w));
    bias_masks_.push_back(biases_[i] ? ones_like(biases_[i]->value) : Tensor{});
  }
}

float MagnitudePruner::target(int64_t step) const {
  if (step < o_.start) return 0.f;
  if (o_.end <= o_.start || step >= o_.end) return o_.sparsity;
  const double left = 1.0 - static_cast<double>(step - o_.start) / static_cast<double>(o_.end - o_.start);
  return static_cast<float>(o_.sparsity * (1.0 - left * left * left));
}

bool MagnitudePruner::after_step(int64_t step) {
  const bool update = step >= o_.start && (step <= o_.end || !active_) &&
                      ((step - o_.start) % o_.every == 0 || step == o_.end || !active_);
  if (update && target(step) > 0.f) recompute(target(step));
  if (active_) apply();
  return update;
}

void MagnitudePruner::recompute(float sparsity) {
  if (o_.structured)
    structured(sparsity);
  else
    unstructured(sparsity);
  active_ = true;
}

// Global: one threshold over every |w|; per layer: each layer loses the same fraction.
void MagnitudePruner::unstructured(float sparsity) {
  std::vector<Tensor> host;
  for (nn::Parameter* p : weights_) host.push_back(host_copy(p->value));
  auto mask_below = [&](size_t i, float threshold, int64_t& budget) {
    Tensor m = Tensor::empty(host[i].shape());
    const float* w = host[i].f32();
    for (int64_t j = 0; j < m.numel(); ++j) {
      const bool prune = std::abs(w[j]) < threshold || (std::abs(w[j]) == threshold && budget > 0);
      if (std::abs(w[j]) == threshold && budget > 0) --budget;
      m.f32()[j] = prune ? 0.f : 1.f;
    }
    copy_any(m, masks_[i]);
  };
  auto prune_count = [&](int64_t n) { return static_cast<int64_t>(std::floor(static_cast<double>(sparsity) * n)); };
  if (o_.global) {
    std::vector<float> all;
    for (const Tensor& h : host)
      for (int64_t j = 0; j < h.numel(); ++j) all.push_back(std::abs(h.f32()[j]));
    const int64_t k = prune_count(static_cast<int64_t>(all.size()));
    if (k == 0) return;
    const float threshold = kth_smallest(all, static_cast<size_t>(k - 1));
    int64_t below = 0;
    for (float a : all) below += a < threshold;
    int64_t ties = k - below;  // how many of the values equal to the threshold go too
    for (size_t i = 0; i < host.size(); ++i) mask_below(i, threshold, ties);
    return;
  }
  for (size_t i = 0; i < host.size(); ++i) {
    std::vector<float> a(static_cast<size_t>(host[i].numel()));
    for (size_t j = 0; j < a.size(); ++j) a[j] = std::abs(host[i].f32()[j]);
    std::vector<uint8_t> pruned = smallest(a, static_cast<size_t>(prune_count(host[i].numel())));
    Tensor m = Tensor::empty(host[i].shape());
    for (size_t j = 0; j < a.size(); ++j) m.f32()[j] = pruned[j] ? 0.f : 1.f;
    copy_any(m, masks_[i]);
  }
}

// Each layer loses the same fraction of its output channels (rows of [out, ...]): the smallest L2
// norms, with their biases.
void MagnitudePruner::structured(float sparsity) {
  for (size_t i = 0; i < weights_.size(); ++i) {
    const Tensor w = host_copy(weights_[i]->value);
    const int64_t rows = w.size(0), per_row = w.numel() / rows;
    std::vector<float> norm(static_cast<size_t>(rows), 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < per_row; ++j) norm[static_cast<size_t>(r)] += w.f32()[r * per_row + j] * w.f32()[r * per_row + j];
    const auto count = static_cast<size_t>(std::floor(static_cast<double>(sparsity) * static_cast<double>(rows)));
    std::vector<uint8_t> pruned = smallest(norm, count);
    Tensor m = Tensor::empty(w.shape());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < per_row; ++j) m.f32()[r * per_row + j] = pruned[static_cast<size_t>(r)] ? 0.f : 1.f;
    copy_any(m, masks_[i]);
    if (!biases_[i]) continue;
    Tensor bm = Tensor::empty({rows});
    for (int64_t r = 0; r < rows; ++r) bm.f32()[r] = pruned[static_cast<size_t>(r)] ? 0.f : 1.f;
    copy_any(bm, bias_masks_[i]);
  }
}

void MagnitudePruner::apply() {
  for (size_t i = 0; i < weights_.size(); ++i) {
    Tensor& w = weights_[i]->value;
    engine_for(w.device()).mul(w, masks_[i], w);
    if (biases_[i] && o_.structured) engine_for(biases_[i]->value.device()).mul(biases_[i]->value, bias_masks_[i], biases_[i]->value);
  }
}

double MagnitudePruner::sparsity() const {
  double zeros = 0, total = 0;
  for (const Tensor& m : masks_) {
    const Tensor h = host_copy(m);
    for (int64_t j = 0; j < h.numel(); ++j) zeros += h.f32()[j] == 0.f;
    total += static_cast<double>(h.numel());
  }
  return total > 0 ? zeros / total : 0;
}

std::map<std::string, Tensor> MagnitudePruner::masks() const {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < weights_.size(); ++i) {
    out[weights_[i]->name] = host_copy(masks_[i]);
    if (biases_[i] && o_.structured) out[biases_[i]->name] = host_copy(bias_masks_[i]);
  }
  return out;
}

void MagnitudePruner::load_masks(const std::map<std::string, Tensor>& masks) {
  auto load = [&](const nn::Parameter* p, Tensor& dst) {
    auto it = masks.find(p->name);
    DT_INPUT_CHECK(it != masks.end(), "no pruning mask for " << p->name);
    DT_INPUT_CHECK(it->second.numel() == dst.numel() && it->second.dtype() == dst.dtype(),
                   "the pruning mask of " << p->name << " is " << it->second.str() << ", not " << dst.str());
    copy_any(it->second.reshape(dst.shape()), dst);
  };
  for (size_t i = 0; i < weights_.size(); ++i) {
    load(weights_[i], masks_[i]);
    if (biases_[i] && o_.structured) load(biases_[i], bias_masks_[i]);
  }
  active_ = true;
}

}  // namespace dtrain::optim

// What the tasks share: micro-batches cut from a step's data, and the step's data staged on the
// model's device.
#include "dtrain/train/task.h"

namespace dtrain::train {

Tensor micro_rows(const std::vector<Tensor>& chunks, int k, int parts) {
  if (static_cast<int>(chunks.size()) == parts) return chunks[static_cast<size_t>(k)];
  DT_CHECK(chunks.size() == 1, "micro_rows: " << chunks.size() << " chunks for " << parts << " micro-batches");
  const int64_t rows = chunks[0].size(0) / parts;
  return chunks[0].slice0(k * rows, (k + 1) * rows);
}

void StagedSteps::put(int64_t step, const std::vector<std::pair<Tensor, Tensor>>& chunks, Device device) {
  Set& set = sets_[step & 1];
  set.inputs.resize(chunks.size());
  set.labels.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    stage_async(chunks[i].first, device, set.inputs[i]);
    stage_async(chunks[i].second, device, set.labels[i]);
  }
  set.step = step;
}

void StagedSteps::take(int64_t step, std::vector<Tensor>& inputs, std::vector<Tensor>& labels) {
  Set& set = sets_[step & 1];
  DT_CHECK(set.step == step, "StagedSteps: step " << step << " was not put");
  inputs.clear();
  labels.clear();
  for (size_t i = 0; i < set.inputs.size(); ++i) {
    inputs.push_back(take_staged(set.inputs[i]));
    labels.push_back(take_staged(set.labels[i]));
  }
  set.step = -1;
}

}  // namespace dtrain::train

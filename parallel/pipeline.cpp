#include "dtrain/parallel/pipeline.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <optional>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::parallel {

PipelineSchedule pipeline_schedule_from_name(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::GPipe;
  if (name == "1f1b") return PipelineSchedule::OneFOneB;
  DT_INPUT_CHECK(false, "--schedule " << name << " is not one of gpipe, 1f1b");
  return PipelineSchedule::OneFOneB;
}

const char* pipeline_schedule_name(PipelineSchedule s) { return s == PipelineSchedule::GPipe ? "gpipe" : "1f1b"; }

std::vector<PipelineOp> pipeline_ops(PipelineSchedule s, int stage, int stages, int m) {
  std::vector<PipelineOp> ops;
  if (s == PipelineSchedule::GPipe) {
    for (int i = 0; i < m; ++i) ops.push_back({true, i});
    for (int i = 0; i < m; ++i) ops.push_back({false, i});
    return ops;
  }
  const int warmup = std::min(stages - stage - 1, m);
  for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
  for (int i = 0; i < m - warmup; ++i) {
    ops.push_back({true, warmup + i});
    ops.push_back({false, i});
  }
  for (int i = m - warmup; i < m; ++i) ops.push_back({false, i});
  return ops;
}

double pipeline_ideal_bubble(int stages, int m) { return static_cast<double>(stages - 1) / (m + stages - 1); }

std::vector<int> balance_stages(const std::vector<double>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  DT_INPUT_CHECK(stages >= 1 && stages <= n, "cannot cut " << n << " layers into " << stages << " pipeline stages");
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  // best[s][i]: the smallest largest-stage cost of the first i layers in s stages.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int i = s; i <= n; ++i)
      for (int j = s - 1; j < i; ++j) {
        double c = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (c < best[s][i]) {
          best[s][i] = c;
          cut[s][i] = j;
        }
      }
  std::vector<int> starts(stages + 1);
  starts[stages] = n;
  for (int s = stages, i = n; s >= 1; --s) {
    i = cut[s][i];
    starts[s - 1] = i;
  }
  return starts;
}

namespace {
// One count of --pp-split, surrounding spaces allowed: a whole number or nothing.
std::optional<int> split_count(const std::string& item) {
  const size_t first = item.find_first_not_of(' '), last = item.find_last_not_of(' ');
  if (first == std::string::npos) return std::nullopt;
  int n = 0;
  const char* end = item.data() + last + 1;
  auto [ptr, ec] = std::from_chars(item.data() + first, end, n);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return n;
}
}  // namespace

std::vector<int> parse_pp_split(const std::string& text, int stages, int layers) {
  std::vector<int> starts{0};
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::optional<int> n = split_count(item);
    DT_INPUT_CHECK(n, "--pp-split " << text << ": '" << item << "' is not a layer count");
    DT_INPUT_CHECK(*n >= 1, "--pp-split " << text << ": every stage needs at least one layer, got " << *n);
    DT_INPUT_CHECK(*n <= layers,
                   "--pp-split " << text << ": " << *n << " layers in one stage, the model has " << layers);
    starts.push_back(starts.back() + *n);
  }
  // getline drops an empty last item ("2,4,"): it must not pass for "2,4".
  DT_INPUT_CHECK(!text.empty() && text.back() != ',', "--pp-split " << text << ": an empty layer count");
  DT_INPUT_CHECK(static_cast<int>(starts.size()) == stages + 1 && starts.back() == layers,
                 "--pp-split " << text << " must give " << stages << " layer counts adding up to the " << layers
                               << " layers of the model");
  return starts;
}

PipelineStage::PipelineStage(nn::Module& module, comm::Communicator& pp, PipelineSchedule schedule, int micro_batches)
    : module_(module),
      pp_(pp),
      schedule_(schedule),
      stage_(pp.rank()),
      stages_(pp.size()),
      micro_batches_(micro_batches),
      device_(nn::device_of(module)) {
  DT_INPUT_CHECK(micro_batches >= 1, "--micro-batches must be positive, got " << micro_batches);
  stash_.resize(micro_batches);
  act_in_.resize(micro_batches);
  dout_.resize(micro_batches);
  act_sends_.resize(micro_batches);
}

void PipelineStage::wait(std::shared_ptr<comm::Work>& w) {
  if (w) w->wait();
  w.reset();
}

Tensor PipelineStage::recv_from(int peer, Tensor& buf, int tag) {
  double t0 = now_s();
  pp_.recv(buf, peer, tag)->wait();
  stats_.recv_wait_s += now_s() - t0;
  return buf;
}

void PipelineStage::send_to(const Tensor& t, int peer, int tag, std::shared_ptr<comm::Work>& slot) {
  wait(slot);
  slot = pp_.send(t, peer, tag);
  stats_.bytes_sent += static_cast<int64_t>(t.nbytes());
}

namespace {
// Receive and gradient buffers live on the stage's device: activations travel device to device
// (NCCL, or MPI through host staging).
void ensure_shape(Tensor& t, const Shape& s, Device device) {
  if (!t.defined() || t.shape() != s || t.device() != device) t = Tensor::empty(s, DType::F32, device);
}

// What a stage sends must have the shape its neighbour receives into, or both would be garbled.
void check_sent(const Tensor& t, const Shape& expected, int stage, const char* what) {
  DT_CHECK(t.defined() && t.shape() == expected,
           "pipeline stage " << stage << " made " << what << " " << t.str() << ", expected " << shape_str(expected));
}
}  // namespace

void PipelineStage::train_step(const InputFn& input, const LossFn& loss, const StageShapes& shapes,
                               const BeforeBackwardFn& before_backward, const BeforeForwardFn& before_forward) {
  const double t0 = now_s();
  stats_.recv_wait_s = 0;
  stats_.bytes_sent = 0;
  size_t held = 0;  // bytes of activations stashed for micro-batches in flight
  int backwards = 0;
  for (const PipelineOp& op : pipeline_ops(schedule_, stage_, stages_, micro_batches_)) {
    const int mb = op.micro_batch;
    if (op.forward) {
      Tensor x;
      if (first()) {
        x = input(mb);
      } else {
        ensure_shape(act_in_[mb], shapes.in, device_);
        x = recv_from(stage_ - 1, act_in_[mb], 2 * mb);
      }
      wait(grad_send_);       // scratch buffers (the d(input) sent) may be rewritten by a forward too
      if (!spent_.empty()) {  // buffers of a finished micro-batch: the forward reuses them
        module_.restore_activations(std::move(spent_.back()));
        spent_.pop_back();
      }
      if (before_forward) before_forward(mb);
      Tensor y;
      {
        nn::PhaseScope phase(nn::Phase::Forward);
        y = module_.forward(x);
      }
      if (last()) {
        Tensor d = loss(y, mb);
        ensure_shape(dout_[mb], d.shape(), device_);
        engine_for(device_).copy(d, dout_[mb]);
      } else {
        check_sent(y, shapes.out, stage_, "activation");
        send_to(y, stage_ + 1, 2 * mb, act_sends_[mb]);
      }
      stash_[mb] = module_.stash_activations();
      held += nn::Module::stash_bytes(stash_[mb]);
      stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, held);
    } else {
      Tensor dy;
      if (last()) {
        dy = dout_[mb];
      } else {
        ensure_shape(grad_in_, shapes.out, device_);
        dy = recv_from(stage_ + 1, grad_in_, 2 * mb + 1);
      }
      wait(act_sends_[mb]);  // this micro-batch's output buffer is reused after its backward
      wait(grad_send_);      // the d(input) buffer is rewritten by this backward
      held -= nn::Module::stash_bytes(stash_[mb]);
      module_.restore_activations(std::move(stash_[mb]));
      ++backwards;
      if (before_backward) before_backward(mb, backwards == micro_batches_);
      Tensor dx;
      {
        nn::PhaseScope phase(nn::Phase::Backward);
        dx = module_.backward(dy);
      }
      if (!first()) {
        check_sent(dx, shapes.in, stage_, "d(input)");
        send_to(dx, stage_ - 1, 2 * mb + 1, grad_send_);
      }
      spent_.push_back(module_.stash_activations());
    }
  }
  for (auto& w : act_sends_) wait(w);
  wait(grad_send_);
  stats_.step_s = now_s() - t0;
  stats_.bubble = stats_.step_s > 0 ? stats_.recv_wait_s / stats_.step_s : 0;
}

void PipelineStage::forward_only(const InputFn& input, const std::function<void(const Tensor&, int)>& consume,
                                 const StageShapes& shapes, int micro_batches, const BeforeForwardFn& before_forward) {
  std::shared_ptr<comm::Work> pending;
  Tensor in;
  for (int mb = 0; mb < micro_batches; ++mb) {
    Tensor x;
    if (first()) {
      x = input(mb);
    } else {
      ensure_shape(in, shapes.in, device_);
      x = recv_from(stage_ - 1, in, 2 * mb);
    }
    wait(pending);  // the output buffer is rewritten by this forward
    if (before_forward) before_forward(mb);
    Tensor y = module_.forward(x);
    if (last()) {
      consume(y, mb);
    } else {
      check_sent(y, shapes.out, stage_, "activation");
      send_to(y, stage_ + 1, 2 * mb, pending);
    }
  }
  wait(pending);
}

}  // namespace dtrain::parallel

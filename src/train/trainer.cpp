#include "dtrain/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include <zlib.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/comm/forensics.h"
#include "dtrain/comm/nccl.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif
#include "dtrain/core/env.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/loader.h"
#include "dtrain/optim/large_batch.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/signals.h"
#include "dtrain/train/step_support.h"
#include "dtrain/train/trace.h"

namespace fs = std::filesystem;

namespace dtrain::train {

double process_age_s() {
  std::ifstream stat("/proc/self/stat"), up("/proc/uptime");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  double uptime = 0;
  up >> uptime;
  size_t close = s.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 22) return uptime - std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  return 0;
}

// ------------------------------------------------------------------ one step
// `parts_` micro-batches, gradients exchanged on the last one; through the pipeline's schedule when
// the model is cut into stages (the loss is then known on the last stage).
void Trainer::forward_backward(float loss_scale) {
  const int64_t row = static_cast<int64_t>(row_units_.size());
  Tensor stats = rows_.slice0(row, row + 1).reshape({kXentStatsFloats});
  const float grad_scale = loss_scale / static_cast<float>(parts_);  // each loss is a mean over its micro-batch
  auto before_backward = [&](int, bool last) {
    if (!dp_) return;
    dp_->set_step(step_);
    dp_->begin_backward(last);
  };
  nn::Module& model = task_->model();
  if (pipe_) {
    const double t0 = now_s();  // forwards and backwards interleave: counted as forward
    pipe_->train_step([&](int k) { return task_->micro_input(k, parts_); },
                      [&](const Tensor& out, int k) { return task_->micro_loss(out, k, parts_, stats, grad_scale); },
                      task_->stage_shapes(batch_ / parts_), before_backward,
                      [&](int k) { task_->before_forward(k, parts_); });
    bubble_sum_ += pipe_->stats().bubble;
    iv_.fwd += now_s() - t0;
    return;
  }
  for (int k = 0; k < parts_; ++k) {
    const double t0 = now_s();
    task_->before_forward(k, parts_);
    Tensor dout = task_->micro_loss(model.forward(task_->micro_input(k, parts_)), k, parts_, stats, grad_scale);
    test_delay("forward");
    const double t1 = now_s();
    before_backward(k, k + 1 == parts_);
    model.backward(dout);
    test_delay("backward");
    iv_.fwd += t1 - t0;
    iv_.bwd += now_s() - t1;
  }
}

// Global-norm clipping that counts every weight once: ZeRO's pieces and tp parts add their squares
// over the ranks that hold them (each element where a checkpoint writes it), a pipeline's stages theirs.
void Trainer::clip_gradients() {
  const double max_norm = cfg_.clip_grad_norm;
  if (cfg_.tp > 1 || cfg_.pp > 1) {
    parallel::clip_grad_norm_tp(task_->model(), grid_->tp(), max_norm, cfg_.pp > 1 ? &grid_->pp() : nullptr,
                                task_->duplicate(), dp_.get(), opt_->params());
    return;
  }
  const double norm = dp_ ? dp_->grad_norm() : optim::grad_norm(opt_->params());
  if (norm <= max_norm) return;
  const float k = static_cast<float>(max_norm / (norm + 1e-6));
  for (nn::Parameter* p : opt_->params()) engine_for(p->grad.device()).scale(p->grad, k);
}

void Trainer::exchange() {
  if (dp_) {
    const double c0 = dp_->stats().comm_wait_s;
    dp_->finish();
    if (scaler_ || cfg_.clip_grad_norm > 0.f) dp_->settle();  // the host reads the gradients next
    iv_.comm += dp_->stats().comm_wait_s - c0;
  }
  task_->after_exchange(dp_.get());
}

// fp16's agreed verdict, clipping and the optimizer step; returns whether it stepped.
bool Trainer::update(float lr) {
  // fp16: unscale and check for inf/NaN after the exchange; ranks that hold different parameters
  // (ZeRO-1 slices, tp shards, stages) agree on the verdict, so a step is taken everywhere or nowhere.
  const bool different = (dp_ && dp_->zero_stage() > 0) || cfg_.tp > 1 || cfg_.pp > 1;
  const bool take_step = unscale_and_agree(scaler_.get(), opt_->params(), different ? &world_ : nullptr);
  if (take_step && cfg_.clip_grad_norm > 0.f) clip_gradients();
  if (take_step) opt_->step(lr);
  test_delay("optimizer");
  if (dp_) {
    const double c0 = dp_->stats().comm_wait_s;
    if (take_step) dp_->after_step();
    // On a GPU the optimizer step is now queued behind the exchange (an event); the host checks
    // the exchange before anything else can wait for the GPU (evaluation, a checkpoint, the next
    // loss), so a stuck peer times out naming the ranks instead of hanging in a stream sync.
    dp_->settle();
    iv_.comm += dp_->stats().comm_wait_s - c0;
  }
  // Pruning masks after every step (every replica holds the same weights, so the same masks);
  // ZeRO-1's slice then starts the next update from the masked weights.
  if (pruner_) {
    pruner_->after_step(step_ + 1);
    if (dp_) dp_->reload_shard();
  }
  return take_step;
}

bool Trainer::step_once(double& wait_s) {
  ChromeTrace& trace = *trace_;
  const Interval before = iv_;
  const double t0 = now_s();
  try {
    if (!task_->load_step(step_, wait_s)) return false;
  } catch (const InputError& e) {
    // Each rank reads its own samples (in the store: the rows it holds for every rank), so a shard
    // that breaks mid-run may fail one rank only, while the others wait for it in a collective:
    // that rank stops the job, naming itself and the file.
    if (world_.size() > 1) comm::Runtime::abort(kExitBadInput, "rank " + std::to_string(rank_) + ": " + e.what());
    throw;
  }
  test_delay("data");
  const double tc = now_s();
  trace.span("data wait", t0, tc, step_);
  const int64_t mallocs0 = gpu_malloc_count(device_);
  comm::set_step_phase(step_ + 1, false);  // tags this step's collectives for the desync check
  const float lr = sched_->lr(step_) * lr_scale_;
  for (nn::Parameter* p : task_->model().parameters())
    if (!p->frozen) engine_for(p->grad.device()).fill(p->grad, 0.f);
  nn::update_working_copies(task_->model().parameters(), engine_for(device_).math_precision());  // masters changed
  forward_backward(scaler_ ? scaler_->scale() : 1.f);
  const double tw = now_s();
  trace.span("forward+backward", tc, tw, step_);
  exchange();
  const double to = now_s();
  trace.span("communication wait", tw, to, step_);
  update(lr);
  const double t1 = now_s();
  trace.span("optimizer", to, t1, step_);
  trace.end_step();
  iv_.opt += t1 - to;
  row_units_.push_back(task_->step_units());
  ++step_;
  comm::set_step_phase(step_, true);  // what follows the step: reads, logs, checks, checkpoints
  // A batch size's first two steps make its buffers (an epoch's short last batch is a new size);
  // the steps after them should find everything in the allocator's cache.
  if (++steps_per_batch_units_[task_->step_units()] > 2) step_mallocs_ += gpu_malloc_count(device_) - mallocs0;
  if (step_ == start_step_ + 1) {
    result_.first_step_at_s = process_age_s();
    run_t0_ = t1;
    run_eval0_s_ = eval_total_s_;
    run_cpu0_ = process_cpu_s();
  } else {
    run_units_ += task_->step_units() * grid_->dp_size();
  }
  ema_step_s_ = ema_step_s_ == 0 ? (t1 - t0) : 0.9 * ema_step_s_ + 0.1 * (t1 - t0);
  iv_.wait += wait_s;
  ++iv_.steps;
  const double data_s = tc - t0;  // reading and staging the step's data, waits included
  split_[0] += data_s;
  split_[1] += iv_.fwd - before.fwd;
  split_[2] += iv_.bwd - before.bwd;
  split_[3] += iv_.comm - before.comm;
  split_[4] += iv_.opt - before.opt;
  if (static_cast<int64_t>(row_units_.size()) == rows_.size(0)) read_losses(false);  // the rows ran out
  return true;
}

// ------------------------------------------------------------------ losses, log lines, validation
// Reads the loss rows of the steps since the last read (every rank at the same steps): per-step
// means into the interval, a non-finite loss or an out-of-range label stops every rank naming the
// step. Under a pipeline only the last stage computed losses: the stages add their rows. Before a
// checkpoint the weights about to be saved are checked too (an overflowing update leaves
// non-finite weights before any loss shows it).
void Trainer::read_losses(bool before_save) {
  const int64_t n = static_cast<int64_t>(row_units_.size());
  Tensor host;
  if (n > 0) {
    host = to_host(rows_.slice0(0, n)).clone();
    if (cfg_.pp > 1) grid_->pp().allreduce(host)->wait();
  }
  comm::agree_on_inputs(world_, [&] {
    for (int64_t i = 0; i < n; ++i) {
      const XentStats st = xent_stats(host.slice0(i, i + 1).reshape({kXentStatsFloats}));
      const int64_t at = step_ - n + i + 1;
      DT_INPUT_CHECK(!st.bad_label, task_->bad_label(at, rank_));
      const double loss = st.loss_sum / static_cast<double>(std::max<int64_t>(row_units_[static_cast<size_t>(i)], 1));
      check_finite_loss(loss, at, rank_);
      iv_.loss += loss;
      iv_.hits += static_cast<int64_t>(st.hits);
      iv_.units += row_units_[static_cast<size_t>(i)];
      result_.final_loss = loss;
      result_.step_losses.push_back(loss);
    }
    // Under ZeRO-3 the masters are the optimizer's pieces (each rank checks its own).
    if (before_save)
      check_finite_weights(dp_ && dp_->zero_stage() >= 3 ? opt_->params() : task_->model().parameters(), step_, rank_);
  });
  if (n == 0) return;
  engine_for(device_).fill(rows_, 0.f);
  row_units_.clear();
}

// Loss and accuracy averaged over the ranks, throughput over the interval, globally (the tp ranks
// and stages of a dp group count its samples once).
void Trainer::log_interval(int64_t epoch, int64_t batch_in_epoch, float lr) {
  read_losses(false);
  const int64_t steps = std::max<int64_t>(iv_.steps, 1), world = world_.size();
  Tensor agg = Tensor::from({4}, {static_cast<float>(iv_.loss), static_cast<float>(iv_.hits),
                                  static_cast<float>(iv_.units), static_cast<float>(iv_.wait)});
  if (world > 1) world_.allreduce(agg, comm::ReduceOp::Sum)->wait();
  // The slowest rank's forward+backward per step: on shared cores it sets the pace.
  Tensor slow = Tensor::from({1}, {static_cast<float>((iv_.fwd + iv_.bwd) / steps)});
  if (world > 1) world_.allreduce(slow, comm::ReduceOp::Max)->wait();
  const double now = now_s();
  const double mean_loss = agg.f32()[0] / static_cast<double>(steps * world);
  const double acc = agg.f32()[1] / std::max(1.f, agg.f32()[2]);
  const double ups = agg.f32()[2] / static_cast<double>(cfg_.tp * cfg_.pp) / std::max(now - iv_.t0, 1e-9);
  const double wait = agg.f32()[3] / static_cast<double>(steps * world);
  result_.train_loss = mean_loss;
  const std::string unit = task_->unit();
  if (metrics_) {
    JsonFields f;
    if (has_epochs_) f.push_back({"epoch", epoch + 1});
    const JsonFields rest{{"step", step_},
                          {"loss", mean_loss},
                          {"train_accuracy", acc},
                          {"lr", static_cast<double>(lr)},
                          {unit + "_per_s", ups},
                          {"data_wait_s", wait},
                          {"comm_wait_s", iv_.comm / steps},
                          {"bytes_sent_per_step", dp_ ? (dp_->stats().bytes_sent - iv_.bytes0) / steps : int64_t{0}},
                          {"step_time_s", (now - iv_.t0) / steps},
                          {"loss_scale", static_cast<double>(scaler_ ? scaler_->scale() : 1.f)},
                          {"skipped_steps", scaler_ ? scaler_->skipped_steps() : int64_t{0}},
                          {"forward_s", iv_.fwd / steps},
                          {"backward_s", iv_.bwd / steps},
                          {"optimizer_s", iv_.opt / steps},
                          {"compute_max_s", static_cast<double>(slow.f32()[0])},
                          {"bucket_count", dp_ ? static_cast<int64_t>(dp_->bucket_count()) : int64_t{0}},
                          {"train_time_s", now - train_t0_ - eval_total_s_}};
    f.insert(f.end(), rest.begin(), rest.end());
    if (pruner_) f.push_back({"sparsity", pruner_->sparsity()});
    metrics_->write(f);
  }
  std::string stats = "loss " + fixed(mean_loss, 4) + " acc " + fixed(100 * acc, 1) + "% " + fixed(ups, 0) + " " +
                      unit + "/s wait " + fixed(1e3 * wait, 2) + " ms lr " + fixed(lr, 6);
  if (scaler_)
    stats += " loss scale " + fixed(scaler_->scale(), 0) + " skipped " + std::to_string(scaler_->skipped_steps());
  if (pruner_) stats += " sparsity " + fixed(100 * pruner_->sparsity(), 1) + "%";
  if (progress_->bar()) {
    progress_->update(epoch + 1, epochs_, batch_in_epoch, steps_per_epoch_, stats,
                      ema_step_s_ * static_cast<double>(total_steps_ - step_));
  } else {
    say((has_epochs_ ? "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs_) + " " : std::string()) +
        "step " + std::to_string(step_) + "/" + std::to_string(total_steps_) + " " + stats);
  }
  iv_ = Interval{};
  iv_.bytes0 = dp_ ? dp_->stats().bytes_sent : 0;
  iv_.t0 = now_s();
}

// A validation pass; evaluation time is left out of the training time (time-to-accuracy counts
// training only). `epoch_s` >= 0: the epoch just ended, after so many seconds.
void Trainer::set_step_hook(int64_t every, std::function<void(int64_t)> hook) {
  DT_CHECK(every > 0, "step hook every " << every << " steps");
  hook_every_ = every;
  step_hook_ = std::move(hook);
}

EvalResult Trainer::evaluate() { return task_->validate(pipe_.get()).result; }

std::vector<Tensor*> Trainer::state_tensors() {
  std::vector<Tensor*> out;
  if (dp_)
    out = dp_->parameter_state(task_->model().parameters(), opt_->params());
  else
    for (nn::Parameter* p : task_->model().parameters()) out.push_back(&p->value);
  for (nn::Buffer* b : task_->model().buffers()) out.push_back(&b->value);
  for (const optim::StateTensor& s : opt_->state()) out.push_back(s.value);
  return out;
}

bool Trainer::set_momentum(float m) {
  auto* sgd = dynamic_cast<optim::SGD*>(opt_.get());
  if (!sgd || momentum_ == 0.f) return false;  // none, or top-k's momentum correction holds it
  sgd->set_momentum(m);
  momentum_ = m;
  return true;
}

void Trainer::validate(int64_t epoch, double epoch_s) {
  const double t0 = now_s();
  std::string line = epoch_s >= 0 && has_epochs_
                         ? "epoch " + std::to_string(epoch + 1) + " done in " + fixed(epoch_s, 1) + " s"
                         : std::string();
  if (!task_->validation_due(step_, epoch_s >= 0)) {
    if (!line.empty()) say(line);
    return;
  }
  const double train_time_s = t0 - train_t0_ - eval_total_s_;
  Validation v = task_->validate(pipe_.get());
  const double eval_s = now_s() - t0;
  eval_total_s_ += eval_s;
  result_.last_eval = v.result;
  say(line.empty() ? "step " + std::to_string(step_) + "  " + v.text : line + ": " + v.text);
  last_validation_ = v.fields;
  if (!metrics_) return;
  JsonFields f;
  if (has_epochs_) f.push_back({"epoch", epoch + 1});
  f.push_back({"step", step_});
  f.insert(f.end(), v.fields.begin(), v.fields.end());
  f.insert(f.end(), {{"train_time_s", train_time_s}, {"eval_s", eval_s}, {"wall_s", now_s() - train_t0_}});
  metrics_->write(f);
}

// A signal seen by any rank stops every rank after this same step, behind a checkpoint. Not on an
// epoch's last step, so that its validation and checkpoint happen first.
bool Trainer::preempted(int64_t epoch, int64_t batch_in_epoch, bool saved) {
  if (step_ % cfg_.preempt_check_every != 0 || step_ >= total_steps_ || batch_in_epoch >= steps_per_epoch_ ||
      (result_.preempted_by = agree_on_preemption(&world_)) == 0)
    return false;
  if (!saved) {
    read_losses(true);
    save(epoch, batch_in_epoch, true);
  }
  say("preempted by " + signal_name(result_.preempted_by) + " at step " + std::to_string(step_) +
      (cfg_.checkpoint_dir.empty() ? std::string(": no --checkpoint-dir, nothing saved")
                                   : ": checkpoint written to " + cfg_.checkpoint_dir));
  if (metrics_)
    metrics_->write(
        {{"event", std::string("preempted")}, {"step", step_}, {"signal", signal_name(result_.preempted_by)}});
  return true;
}

// ------------------------------------------------------------------ the loop
TrainResult Trainer::run() {
  ResumePoint at;
  take_checkpoint_folder();
  // A checkpoint part or file one rank cannot read fails every rank alike.
  {
    // --init-from at ZeRO-3: whole parameters, which then give each rank its shard (a resume
    // decides for itself: it may take its pieces alone).
    // The reads are waited for under --checkpoint-timeout: a slow file system is not a lost rank.
    const bool imports = cfg_.resume.empty() && !cfg_.init_from.empty();
    parallel::WholeModel whole(imports ? dp_.get() : nullptr);
    if (!cfg_.resume.empty()) {
      CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
      comm::agree_on_inputs(world_, [&] {
        delay_read_if_asked();
        at = restore(cfg_.resume);
      });
      set_aside_later_line();
    } else if (imports) {  // pretrained weights, then training from step 0
      std::string line;
      CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
      comm::agree_on_inputs(world_, [&] {
        delay_read_if_asked();
        line = task_->init_from(cfg_.init_from);
      });
      say(line);
    }
    if (dp_) dp_->broadcast_state(0);
  }
  PreemptionGuard preemption(parse_signal_list(cfg_.preempt_signals, "preempt-signals"));
  trace_ = std::make_unique<ChromeTrace>(cfg_.trace, rank_, cfg_.trace_steps);
  announce();
  start_step_ = step_;
  // Each step's loss stays on the model's device, a row of rows_, until a log line, a validation,
  // a checkpoint or the end reads the rows since the last read (or they run out), so a GPU step
  // never waits for its loss.
  rows_ = zeros_on({cfg_.log_every > 0 ? std::min<int64_t>(cfg_.log_every, 256) : 64, kXentStatsFloats}, device_);
  task_->model().train();
  train_t0_ = iv_.t0 = now_s();
  iv_.bytes0 = dp_ ? dp_->stats().bytes_sent : 0;
  for (int64_t epoch = at.epoch; epoch < epochs_ && step_ < total_steps_; ++epoch) {
    task_->start_epoch(epoch, at.steps_done);
    int64_t batch_in_epoch = at.steps_done;
    at.steps_done = 0;
    const double epoch_t0 = now_s();
    double wait = 0;
    while (step_ < total_steps_ && step_once(wait)) {
      ++batch_in_epoch;
      const float lr = sched_->lr(step_ - 1) * lr_scale_;
      const bool epoch_end = batch_in_epoch == steps_per_epoch_ || step_ == total_steps_;
      if (cfg_.desync_check_every > 0 && step_ % cfg_.desync_check_every == 0) comm::check_collective_sequences();
      if (step_ == stop_after_) std::raise(SIGSTOP);  // the DTRAIN_TEST_STOP hook: a hung rank
      if ((cfg_.log_every > 0 && step_ % cfg_.log_every == 0) || epoch_end) log_interval(epoch, batch_in_epoch, lr);
      if (!epoch_end && task_->validation_due(step_, false)) validate(epoch, -1);
      if (cfg_.straggler_every > 0 && step_ % cfg_.straggler_every == 0) find_stragglers();
      if (cfg_.check_replicas > 0) {
        flip_bit_if_asked();
        if (step_ % cfg_.check_replicas == 0) check_replicas();
      }
      const bool saved = cfg_.checkpoint_every > 0 && step_ % cfg_.checkpoint_every == 0;
      if (saved) {
        read_losses(true);  // a non-finite loss stops the run before it can replace a checkpoint
        save(epoch, batch_in_epoch);
      }
      if (preempted(epoch, batch_in_epoch, saved)) break;
      if (step_hook_ && step_ % hook_every_ == 0 && step_ < total_steps_) {
        read_losses(false);  // a run that diverged stops here, not after taking another's state
        const double t0 = now_s();
        step_hook_(step_);
        eval_total_s_ += now_s() - t0;  // not training time
      }
    }
    if (result_.preempted_by != 0) break;
    const bool epoch_done = batch_in_epoch >= steps_per_epoch_;
    if (epoch_done || step_ >= total_steps_) {
      validate(epoch, now_s() - epoch_t0);
      if (cfg_.checkpoint_every == 0 || step_ % cfg_.checkpoint_every != 0) {
        read_losses(true);
        save(epoch_done ? epoch + 1 : epoch, epoch_done ? 0 : batch_in_epoch);
      }
    }
  }
  finish();
  owner_.reset();  // the folder is free for the next run (a test's, a trainer group's next member)
  return result_;
}

// Every stage's bubble, activation memory and resident set, printed by rank 0 (world order is
// stage-major under one dp x tp).
void Trainer::report_pipeline() {
  const int64_t steps_run = std::max<int64_t>(step_ - start_step_, 1);
  result_.pp_bubble = bubble_sum_ / static_cast<double>(steps_run);
  result_.pp_ideal_bubble = parallel::pipeline_ideal_bubble(cfg_.pp, parts_);
  result_.pp_peak_activation_bytes = pipe_->stats().peak_activation_bytes;
  constexpr int kF = 4;
  Tensor all = Tensor::zeros({kF * cfg_.pp});
  if (grid_->dp_rank() == 0 && grid_->tp_rank() == 0) {
    float* f = all.f32() + kF * grid_->pp_rank();
    f[0] = static_cast<float>(result_.pp_bubble);
    f[1] = static_cast<float>(static_cast<double>(result_.pp_peak_activation_bytes) / 1048576.0);
    f[2] = static_cast<float>(task_->model().parameter_count());
    f[3] = static_cast<float>(peak_rss_mib());
  }
  world_.allreduce(all)->wait();
  const std::vector<int> starts = task_->stage_starts();
  for (int s = 0; s < cfg_.pp; ++s) {
    const float* f = all.f32() + kF * s;
    say("stage " + std::to_string(s) + ": " + task_->piece() + " [" + std::to_string(starts[s]) + ", " +
        std::to_string(starts[s + 1]) + "), " + fixed(f[2], 0) + " parameters, measured bubble " +
        fixed(100 * f[0], 1) + " % (ideal " + fixed(100 * result_.pp_ideal_bubble, 1) + " %), peak activations " +
        fixed(f[1], 1) + " MiB, peak RSS " + fixed(f[3], 1) + " MiB");
    if (metrics_)
      metrics_->write({{"pp_stage", s},
                       {"bubble", static_cast<double>(f[0])},
                       {"ideal_bubble", result_.pp_ideal_bubble},
                       {"peak_activation_mib", static_cast<double>(f[1])},
                       {"peak_rss_mib", static_cast<double>(f[3])}});
  }
}

void Trainer::finish() {
  finish_pending_checkpoint();
  read_losses(false);  // steps after the last log line (a preempted run): final_loss, checks
  trace_->write(world_);
  if (!cfg_.trace.empty()) say("trace of " + std::to_string(world_.size()) + " rank(s) written to " + cfg_.trace);
  result_.steps = step_;
  if (scaler_) {
    result_.loss_scale = scaler_->scale();
    result_.skipped_steps = scaler_->skipped_steps();
  }
  if (pipe_) report_pipeline();
  if (pruner_) result_.sparsity = pruner_->sparsity();
  // Training throughput: the steps after the first, validation passes left out.
  const double elapsed = now_s() - run_t0_ - (eval_total_s_ - run_eval0_s_), cpu = process_cpu_s() - run_cpu0_;
  result_.units_per_s = elapsed > 0 ? static_cast<double>(run_units_) / elapsed : 0;
  const std::string gpu_memory = gpu_memory_report(device_, step_ - start_step_, step_mallocs_);
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (device_.type == DeviceType::CUDA) {
    const cuda::AllocatorStats st = cuda::allocator_stats(device_.index);
    result_.gpu_peak_allocated_mib = static_cast<double>(st.peak_allocated) / 1048576.0;
    result_.gpu_reserved_mib = static_cast<double>(st.reserved) / 1048576.0;
    result_.gpu_mallocs_after_warmup = step_ - start_step_ > 2 ? step_mallocs_ : -1;
  }
#endif
  if (!gpu_memory.empty()) say("GPU memory (rank 0, cuda:" + std::to_string(device_.index) + "): " + gpu_memory);
  report_memory();
  const std::string unit = task_->unit();
  say("done: " + std::to_string(step_) + " steps, " + fixed(result_.units_per_s, 0) + " " + unit + "/s, first step " +
      fixed(result_.first_step_at_s, 3) + " s after process start, peak RSS " + fixed(peak_rss_mib(), 1) +
      " MiB (rank 0)");
  if (scaler_)
    say("fp16: loss scale " + fixed(result_.loss_scale, 0) + ", " + std::to_string(result_.skipped_steps) + " of " +
        std::to_string(step_) + " steps skipped for inf/NaN gradients");
  if (!metrics_) return;
  JsonFields f{{"summary", std::string("run")},
               {"steps", step_},
               {"model", cfg_.model},
               {unit + "_per_s", result_.units_per_s},
               {"first_step_at_s", result_.first_step_at_s},
               {unit + "_per_cpu_s", cpu > 0 ? static_cast<double>(run_units_) / world_.size() / cpu : 0.0},
               {"final_loss", result_.final_loss},
               {"peak_rss_mib", peak_rss_mib()},
               {"skipped_steps", result_.skipped_steps}};
  if (pruner_) f.push_back({"sparsity", result_.sparsity});
  if (!cfg_.checkpoint_dir.empty()) f.push_back({"checkpoint_stall_s", result_.checkpoint_stall_s});
  f.insert(f.end(), last_validation_.begin(), last_validation_.end());
  const JsonFields task_fields = task_->summary_fields();
  f.insert(f.end(), task_fields.begin(), task_fields.end());
  if (!gpu_memory.empty()) {
    f.push_back({"gpu_peak_allocated_mib", result_.gpu_peak_allocated_mib});
    f.push_back({"gpu_reserved_mib", result_.gpu_reserved_mib});
    f.push_back({"gpu_mallocs_after_warmup", result_.gpu_mallocs_after_warmup});
  }
  metrics_->write(f);
}

}  // namespace dtrain::train

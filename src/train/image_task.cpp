// The image classifier task of the one loop: sharded HDF5 images (or synthetic batches), an
// mlp / simple_cnn / resnet20, softmax cross-entropy, test-set evaluation at each epoch's end.
#include <algorithm>
#include <atomic>
#include <functional>
#include <sstream>
#include <thread>

#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/loader.h"
#include "dtrain/nn/models.h"
#include "dtrain/parallel/pipeline.h"
#include "dtrain/parallel/process_grid.h"
#include "dtrain/parallel/sync_batchnorm.h"
#include "dtrain/train/task.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

namespace {

// How a test set is read: batch rows, and the training set's normalisation (empty: the set's own).
struct EvalData {
  int64_t batch;
  bool normalize;
  std::vector<float> mean, std;
};
// Runs one batch (host inputs and labels) and adds its loss sum and hits into `stats`.
using BatchForward = std::function<void(const Tensor& inputs, const Tensor& labels, Tensor& stats)>;

// The sampler deals rank r of `dp` the global positions r, r + world, ...; positions past the end
// are padding and are not counted. `forward` adds each batch's loss sum and hits into a row on
// `device`, read once at the end (a GPU is not synchronised per batch); under a pipeline only the
// last stage's row has them, and the stages of `pp` add their rows.
EvalResult evaluate_batches(std::shared_ptr<const data::ShardedHdf5Dataset> ds, const EvalData& how, Device device,
                            comm::Communicator* dp, comm::Communicator* pp, const BatchForward& forward) {
  const int rank = dp ? dp->rank() : 0, world = dp ? dp->size() : 1;
  data::LoaderOptions lo;
  lo.batch_size = how.batch;
  lo.shuffle = false;
  lo.normalize = how.normalize;
  lo.mean = how.mean;
  lo.std = how.std;
  lo.rank = rank;
  lo.world = world;
  data::DataLoader loader(ds, lo);
  const int64_t mine = (ds->size() - rank + world - 1) / world;
  Tensor stats = zeros_on({kXentStatsFloats}, device);
  int64_t seen = 0;
  loader.start_epoch(0);
  data::Batch b;
  while (seen < mine && loader.next(b)) {
    const int64_t rows = std::min<int64_t>(b.inputs.size(0), mine - seen);
    forward(b.inputs.slice0(0, rows), b.labels.slice0(0, rows), stats);
    seen += rows;
  }
  Tensor host = to_host(stats).clone();
  if (pp && pp->size() > 1) pp->allreduce(host)->wait();
  // One rank's bad label fails every rank (the others would wait in the allreduce below).
  XentStats st;
  auto read = [&] {
    st = xent_stats(host);
    DT_INPUT_CHECK(!st.bad_label,
                   "a label of the evaluation data on rank " << rank << " is outside the model's classes");
  };
  if (dp && world > 1)
    comm::agree_on_inputs(*dp, read);
  else
    read();
  // Sums in f64 words carried as two f32 tensors would lose counts past 2^24; use i64 + f32.
  Tensor counts = Tensor::empty({2}, DType::I64);
  counts.data<int64_t>()[0] = static_cast<int64_t>(st.hits);
  counts.data<int64_t>()[1] = seen;
  Tensor loss = Tensor::from({1}, {static_cast<float>(st.loss_sum)});
  if (world > 1) {
    dp->allreduce(counts, comm::ReduceOp::Sum)->wait();
    dp->allreduce(loss, comm::ReduceOp::Sum)->wait();
  }
  EvalResult r;
  r.samples = counts.data<int64_t>()[1];
  r.loss = loss.f32()[0] / static_cast<double>(std::max<int64_t>(r.samples, 1));
  r.accuracy = static_cast<double>(counts.data<int64_t>()[0]) / static_cast<double>(std::max<int64_t>(r.samples, 1));
  return r;
}

class ImageTask final : public Task {
 public:
  ~ImageTask() override;
  void setup(const TaskSetup& s) override;
  void connect() override;
  void share_training_set();
  void use_store();
  nn::Module& model() override { return *model_; }
  std::string describe() override {
    return "model " + spec_.name + " (" + std::to_string(parameters_) + " parameters" +
           (cfg_->pp > 1 ? " on rank 0's stage" : "") + "), " +
           (cfg_->synthetic ? std::string("synthetic data")
                            : "data " + cfg_->data + " (" + train_ds_->info().opened + "), " + reading_.text) +
           (cfg_->teacher.empty()
                ? ""
                : ", teacher " +
                      (teacher_
                           ? teacher_spec_.name + " (" + std::to_string(teacher_->parameter_count()) + " parameters) "
                           : std::string()) +
                      "from " + cfg_->teacher + (teacher_ ? "" : " on the last stage") + ", T " +
                      fixed(cfg_->distill_temperature, 1) + " weight " + fixed(cfg_->distill_weight, 2));
  }
  JsonFields summary_fields() const override {  // this rank's reads of the training set
    if (!train_ds_) return {};
    if (filler_.joinable()) filler_.join();  // its reads count once the node's copy is complete
    return {{"data_mode", reading_.mode},
            {"data_bytes_read", train_ds_->bytes_read()},
            {"data_whole_shard_reads", train_ds_->whole_shard_reads()}};
  }
  std::string unit() const override { return "samples"; }
  std::string piece() const override { return "layers"; }
  std::vector<int> stage_starts() const override { return starts_; }
  parallel::StageShapes stage_shapes(int64_t rows) const override {
    const int stage = grid_->pp_rank();
    return {with_rows(boundaries_[static_cast<size_t>(starts_[stage])], rows),
            with_rows(boundaries_[static_cast<size_t>(starts_[stage + 1])], rows)};
  }
  int64_t steps_per_epoch() const override { return batches_per_epoch() / cfg_->accumulate; }
  void start_epoch(int64_t epoch, int64_t steps_done) override {
    if (loader_) loader_->start_epoch(epoch, steps_done * cfg_->accumulate);
    staged_.clear();  // a step read ahead of the last epoch's end is dropped
    ahead_ended_ = false;
    steps_read_ = steps_done;
  }
  std::vector<optim::ParamGroup> param_groups(const std::vector<nn::Parameter*>& params,
                                              float weight_decay) const override {
    return {{params, weight_decay}};
  }
  bool load_step(int64_t step, double& wait_s) override;
  Tensor micro_input(int k, int parts) override { return micro_rows(inputs_, k, parts); }
  // The statistics (loss, hits) stay the hard-label cross-entropy's, so that runs with and without
  // a teacher log the same quantity; the gradient is the distillation loss's.
  Tensor micro_loss(const Tensor& out, int k, int parts, Tensor& stats, float grad_scale) override {
    ce_.accumulate(out, micro_rows(labels_, k, parts), stats);
    if (!teacher_) return ce_.backward(grad_scale);
    const float w = cfg_->distill_weight;
    Tensor grad = ce_.backward(grad_scale * (1.f - w));
    soft_targets_.prepare(out, teacher_->forward(micro_rows(inputs_, k, parts)));
    engine_for(grad.device()).axpy(1.f, soft_targets_.backward(grad_scale * w), grad);
    return grad;
  }
  int64_t step_units() const override { return step_samples_; }
  std::string bad_label(int64_t step, int rank) const override {
    return "a label of the batch of step " + std::to_string(step) + " on rank " + std::to_string(rank) +
           " is outside the model's classes";
  }
  bool validation_due(int64_t, bool epoch_end) const override { return epoch_end && test_ds_ && cfg_->eval_each_epoch; }
  Validation validate(parallel::PipelineStage*) override;
  void write_fields(CheckpointState& s) const override;
  void check_checkpoint(CheckpointState& s) const override;
  ResumePoint resume_point(CheckpointState& s, int64_t step) override;

 private:
  int64_t batches_per_epoch() const {
    return loader_ ? loader_->batches_per_epoch() : std::max<int64_t>(cfg_->steps, 100) * cfg_->accumulate;
  }
  void make_synthetic_batches(int rank);
  void load_teacher();
  // Reads step `step`'s micro-batches from the loader (or the synthetic set) into `staged_`.
  bool read_step(int64_t step);

  static Shape with_rows(Shape s, int64_t rows) {
    s[0] = rows;
    return s;
  }
  EvalResult pipeline_evaluate(parallel::PipelineStage& pipe);

  const TrainConfig* cfg_ = nullptr;
  parallel::ProcessGrid* grid_ = nullptr;
  Device device_ = Device::cpu();
  int64_t batch_ = 0;
  int parts_ = 1;
  std::vector<Shape> boundaries_;      // pp > 1: the activation shape before each layer and after the last
  std::vector<double> layer_seconds_;  // pp > 1 without --pp-split: each layer's time on this rank
  // Where the drawn layers go: SyncBatchNorm made in place of BatchNorm, then ZeRO-3's blocks.
  std::unique_ptr<parallel::SyncBatchNormSink> sync_bn_;
  nn::UnitSink* sink_ = nullptr;
  parallel::ShardedInit* built_ = nullptr;
  std::vector<int> starts_{0, 1};
  std::shared_ptr<data::ShardedHdf5Dataset> train_ds_, test_ds_;
  std::unique_ptr<comm::Communicator> store_comm_;  // the store's all-to-alls (mode store): outlives loader_
  std::unique_ptr<data::DataLoader> loader_;
  std::vector<data::Batch> synthetic_;  // a few fixed random batches, cycled (no data path at all)
  nn::ModelSpec spec_;
  nn::ModulePtr model_;
  int64_t parameters_ = 0;  // this rank's part of the model, counted when it was made
  nn::SoftmaxCrossEntropy ce_;
  nn::ModulePtr teacher_;  // --teacher: forward only, in eval mode, on the last stage's ranks
  nn::ModelSpec teacher_spec_;
  nn::SoftTargetLoss soft_targets_;
  StagedSteps staged_;
  data::DataReading reading_;                          // how the training set is read (--data-mode)
  std::unique_ptr<comm::NodeSharedMemory> node_rows_;  // the training set, one copy per node (node_shared)
  std::atomic<bool> stop_filling_{false};
  mutable std::thread filler_;  // fills this rank's shards of node_rows_ (joined before node_rows_ goes)
  bool ahead_ended_ = false;    // the epoch ran out while reading a step ahead
  int64_t steps_read_ = 0;      // steps of this epoch read from the loader or the synthetic set
  double read_wait_s_ = 0;
  int64_t step_samples_ = 0;
  std::vector<Tensor> inputs_, labels_;  // the loaded step's micro-batches, on the device
};

void ImageTask::setup(const TaskSetup& s) {
  cfg_ = &s.cfg;
  grid_ = &s.grid;
  device_ = s.device;
  batch_ = s.batch;
  Shape input;
  int64_t classes;
  if (s.cfg.synthetic) {
    input = Shape(s.cfg.synthetic_shape.begin(), s.cfg.synthetic_shape.end());
    classes = s.cfg.synthetic_classes;
    DT_INPUT_CHECK(classes >= 2, "option --synthetic-classes must be >= 2");
  } else {
    train_ds_ = std::make_shared<data::ShardedHdf5Dataset>(s.cfg.data);
    input = train_ds_->info().sample_shape;
    classes = train_ds_->info().num_classes;
    reading_ = data::choose_reading(train_ds_->info(), s.cfg.data_mode, s.cfg.data_cache_mb, s.ranks_on_node,
                                    s.grid.dp_size());
    train_ds_->set_options(reading_.dataset);
    if (!s.cfg.test_data.empty()) {
      test_ds_ = std::make_shared<data::ShardedHdf5Dataset>(s.cfg.test_data);
      if (reading_.mode == "stream") test_ds_->set_options(reading_.dataset);  // evaluation walks it in order
      DT_INPUT_CHECK(test_ds_->info().sample_shape == input,
                     "test data '" << s.cfg.test_data << "' has samples of shape "
                                   << shape_str(test_ds_->info().sample_shape) << " but training data '" << s.cfg.data
                                   << "' has " << shape_str(input));
    }
    data::LoaderOptions lo;
    lo.batch_size = batch_;
    lo.shuffle = true;
    lo.drop_last = s.cfg.drop_last;
    lo.seed = s.cfg.seed;
    lo.threads = s.cfg.loader_threads;
    lo.prefetch = s.cfg.prefetch;
    lo.normalize = s.cfg.normalize;
    lo.augment = s.cfg.augment;
    lo.rank = s.grid.dp_rank();
    lo.world = s.grid.dp_size();
    lo.stream_window_shards = reading_.window_shards;
    loader_ = std::make_unique<data::DataLoader>(train_ds_, lo);
  }
  parts_ = s.parts;
  spec_ = nn::ModelSpec{};
  spec_.name = s.cfg.model;
  spec_.input = input;
  spec_.classes = classes;
  spec_.hidden = s.cfg.hidden;
  spec_.dropout = s.cfg.dropout;
  spec_.seed = s.cfg.seed;
  if (!s.cfg.model_file.empty()) {
    spec_.definition = nn::read_model_file(s.cfg.model_file);
    spec_.name = nn::model_definition_name(spec_.definition);
    spec_.definition_source = s.cfg.model_file;
  }
  // No rank draws the whole model: each layer is handed on as it is drawn (converted to
  // SyncBatchNorm, kept in ZeRO-3's blocks), and a pipeline draws its stage only (in connect()).
  built_ = s.built;
  sink_ = s.built;
  if (s.cfg.sync_batchnorm) {
    sync_bn_ = std::make_unique<parallel::SyncBatchNormSink>(s.grid.dp(), sink_);
    sink_ = sync_bn_.get();
  }
  if (s.cfg.pp > 1) {  // the layers' shapes and times, measured one layer at a time
    Shape x = spec_.input;
    x.insert(x.begin(), batch_ / parts_);
    parallel::LayerProbe probe = parallel::probe_layers(spec_, x, device_, s.cfg.pp_split.empty() ? 3 : 0);
    const int layers = static_cast<int>(probe.seconds.size());
    DT_INPUT_CHECK(layers >= s.cfg.pp,
                   "option --pp " << s.cfg.pp << ": model " << spec_.name << " has " << layers << " layers");
    boundaries_ = std::move(probe.boundaries);
    layer_seconds_ = std::move(probe.seconds);
    if (!s.cfg.pp_split.empty()) starts_ = parallel::parse_pp_split(s.cfg.pp_split, s.cfg.pp, layers);
  } else {
    nn::ModelSpec drawn = spec_;
    drawn.sink = sink_;
    model_ = nn::make_model(drawn);
    model_->set_needs_input_grad(false);  // nothing consumes d(input data)
    model_->to(device_);                  // drawn on the host, trained where the engine is
  }
  if (s.cfg.synthetic) make_synthetic_batches(s.grid.dp_rank());
  if (!s.cfg.teacher.empty() && s.grid.pp_rank() == s.cfg.pp - 1) load_teacher();  // beside the logits
  // An optimizer step takes --accumulate micro-batches; a partial group at an epoch's end is dropped.
  DT_INPUT_CHECK(steps_per_epoch() > 0, "option --accumulate " << s.cfg.accumulate << " exceeds the "
                                                               << batches_per_epoch() << " batches of an epoch");
}

// Collective: a pipeline's cut (by the layers' least times over every rank, so every rank cuts
// alike; or --pp-split), then this rank's stage drawn.
void ImageTask::connect() {
  if (cfg_->pp > 1) {
    if (cfg_->pp_split.empty())
      starts_ = parallel::balance_stages(parallel::least_over_ranks(layer_seconds_, grid_->world()), cfg_->pp);
    const int stage = grid_->pp_rank();
    nn::ModelSpec drawn = spec_;
    drawn.sink = sink_;
    model_ = parallel::draw_stage(drawn, starts_[stage], starts_[stage + 1]);
    if (stage == 0) model_->set_needs_input_grad(false);  // nothing consumes d(input data)
    model_->to(device_);
  }
  if (reading_.node_shared) share_training_set();
  if (reading_.mode == "store") use_store();
  parameters_ = built_ && !built_->empty() ? built_->parameter_count() : model_->parameter_count();
}

// The job-wide store: the batches' rows travel between the data-parallel ranks on a communicator of
// their own, so the exchanges run beside the gradients' collectives, not queued behind them.
void ImageTask::use_store() {
  store_comm_ = grid_->dp().split(0, grid_->dp().rank(), grid_->dp().name() + "/data-store");
  comm::Communicator* c = store_comm_.get();
  loader_->use_store([c](const Tensor& send, const std::vector<int64_t>& send_counts, Tensor& recv,
                         const std::vector<int64_t>& recv_counts) -> std::function<void()> {
    std::shared_ptr<comm::Work> w = c->alltoallv(send, send_counts, recv, recv_counts);
    return [w] { w->wait(); };
  });
}

// The node-shared cache: one block of the node's memory for every row, and after it a flag per
// shard. The node's ranks fill it in turn (local rank i reads shards i, i + L, ... whole) on a
// thread of their own while training starts at once: until a shard's flag is up its rows are read
// per request. A shard the filler cannot read stays down, and the rank that needs its rows fails
// on them, naming the file. The flags are C++ atomics in the shared window: lock-free atomics are
// address-free, so the filler's release store and a reader's acquire load order the rows between
// processes as between threads, and no MPI_Win_sync is needed (the window is MPI's unified model).
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the node copy's flags must work across processes");

void ImageTask::share_training_set() {
  const data::DatasetInfo& info = train_ds_->info();
  const int64_t row_bytes = info.sample_bytes();
  const size_t rows_bytes = static_cast<size_t>(info.num_samples * row_bytes);
  const size_t flags_at = (rows_bytes + 63) / 64 * 64;
  node_rows_ = std::make_unique<comm::NodeSharedMemory>(
      grid_->world(), flags_at + info.shards.size() * sizeof(std::atomic<uint32_t>), "data " + cfg_->data);
  comm::Communicator& node = node_rows_->node();
  auto* in_place = reinterpret_cast<std::atomic<uint32_t>*>(node_rows_->data() + flags_at);
  if (node.rank() == 0)
    for (size_t s = 0; s < info.shards.size(); ++s) new (in_place + s) std::atomic<uint32_t>(0);
  node.barrier();
  train_ds_->use_shared_rows(node_rows_->data(), in_place);
  const int ranks = node.size(), me = node.rank();
  filler_ = std::thread([this, &info, in_place, row_bytes, ranks, me] {
    int64_t begin = 0;
    for (size_t s = 0; s < info.shards.size() && !stop_filling_; begin += info.shard_rows[s], ++s) {
      if (static_cast<int>(s % static_cast<size_t>(ranks)) != me) continue;
      try {
        train_ds_->read_whole_shard(s, node_rows_->data() + begin * row_bytes);
        in_place[s].store(1, std::memory_order_release);
      } catch (const std::exception&) {
        // left down: its rows are read per request, where the error reaches the rank that needs them
      }
    }
  });
}

ImageTask::~ImageTask() {
  loader_.reset();  // its workers may still be copying rows from node_rows_
  stop_filling_ = true;
  if (filler_.joinable()) filler_.join();
}

// The teacher of --teacher: any image model of the student's inputs and classes, trained on inputs
// normalised as the student's are.
void ImageTask::load_teacher() {
  const std::string path = resolve_checkpoint(cfg_->teacher, "teacher");
  CheckpointState s = load_checkpoint_set(path);
  ImageCheckpoint teacher = image_model_from_checkpoint(path, s);
  teacher_ = std::move(teacher.model);
  teacher_spec_ = teacher.spec;
  DT_INPUT_CHECK(teacher_spec_.input == spec_.input && teacher_spec_.classes == spec_.classes,
                 "option --teacher: checkpoint '" << path << "' holds a " << teacher_spec_.name << " for inputs "
                                                  << shape_str(teacher_spec_.input) << " and " << teacher_spec_.classes
                                                  << " classes, the student " << spec_.name << " has inputs "
                                                  << shape_str(spec_.input) << " and " << spec_.classes << " classes");
  const bool teacher_normalized = !teacher.mean.empty();
  DT_INPUT_CHECK(cfg_->synthetic || teacher_normalized == cfg_->normalize,
                 "option --teacher: checkpoint '"
                     << path << "' was trained on inputs " << (teacher_normalized ? "" : "not ")
                     << "normalised, the student's are " << (cfg_->normalize ? "" : "not ") << "(option --normalize)");
  teacher_->set_needs_input_grad(false);
  teacher_->to(device_);  // beside the student: its logits meet the student's on the engine
  soft_targets_ = nn::SoftTargetLoss(cfg_->distill_temperature);
}

void ImageTask::make_synthetic_batches(int rank) {
  Rng rng(derive_seed(cfg_->seed, 1000 + static_cast<uint64_t>(rank)));
  Shape xs = spec_.input;
  xs.insert(xs.begin(), batch_);
  for (int i = 0; i < 4; ++i) {
    data::Batch b;
    b.inputs = Tensor::empty(xs);
    for (int64_t j = 0; j < b.inputs.numel(); ++j) b.inputs.f32()[j] = rng.normal();
    b.labels = Tensor::empty({batch_}, DType::I32);
    for (int64_t j = 0; j < batch_; ++j) b.labels.data<int32_t>()[j] = static_cast<int32_t>(rng.below(spec_.classes));
    synthetic_.push_back(std::move(b));
  }
}

bool ImageTask::read_step(int64_t step) {
  std::vector<std::pair<Tensor, Tensor>> chunks;
  read_wait_s_ = 0;
  for (int64_t micro = 0; micro < cfg_->accumulate; ++micro) {
    data::Batch b;
    if (loader_) {
      if (!loader_->next(b)) return false;  // a partial step at the epoch's end is dropped
    } else {
      if (steps_read_ >= steps_per_epoch()) return false;
      b = synthetic_[static_cast<size_t>((step * cfg_->accumulate + micro) % 4)];
    }
    read_wait_s_ += b.wait_s;
    chunks.emplace_back(b.inputs, b.labels);
  }
  staged_.put(step, chunks, device_);
  ++steps_read_;
  return true;
}

bool ImageTask::load_step(int64_t step, double& wait_s) {
  if (!staged_.has(step) && (ahead_ended_ || !read_step(step))) return false;
  wait_s = read_wait_s_;
  staged_.take(step, inputs_, labels_);
  step_samples_ = 0;
  for (const Tensor& l : labels_) step_samples_ += l.size(0);
  // On a GPU with a loader the next step is read and its upload queued now, beside this step's
  // compute (the loader's position for checkpoints counts steps, so a step read ahead and never
  // used changes nothing).
  if (loader_ && !device_.is_cpu()) {
    double wait = read_wait_s_;
    ahead_ended_ = !read_step(step + 1);
    read_wait_s_ = wait;
  }
  return true;
}

Validation ImageTask::validate(parallel::PipelineStage* pipe) {
  EvalResult ev = pipe ? pipeline_evaluate(*pipe)
                       : evaluate_model(*model_, test_ds_, std::max<int64_t>(batch_, 256), cfg_->normalize,
                                        grid_->dp_size() > 1 ? &grid_->dp() : nullptr, train_ds_->info().mean,
                                        train_ds_->info().std);
  Validation v;
  v.result = ev;
  v.text = "test loss " + fixed(ev.loss, 4) + ", test accuracy " + fixed(100 * ev.accuracy, 2) + "% (" +
           std::to_string(ev.samples) + " samples)";
  v.fields = {{"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}, {"test_samples", ev.samples}};
  return v;
}

// The test set through the stages, one micro-batch per test batch: the first stage feeds the
// images, the last adds loss and hits; each dp group takes its share of the test set.
EvalResult ImageTask::pipeline_evaluate(parallel::PipelineStage& pipe) {
  model_->eval();
  nn::update_working_copies(model_->parameters(), engine_for(device_).math_precision());
  EvalData how{batch_ / parts_, cfg_->normalize, train_ds_->info().mean, train_ds_->info().std};
  EvalResult r = evaluate_batches(test_ds_, how, device_, grid_->dp_size() > 1 ? &grid_->dp() : nullptr, &grid_->pp(),
                                  [&](const Tensor& x, const Tensor& y, Tensor& stats) {
                                    pipe.forward_only([&](int) { return x; },
                                                      [&](const Tensor& out, int) { ce_.accumulate(out, y, stats); },
                                                      stage_shapes(x.size(0)), 1);
                                  });
  model_->train();
  return r;
}

void ImageTask::write_fields(CheckpointState& s) const {
  s.strings["model"] = spec_.name;
  s.ints["classes"] = spec_.classes;
  s.int_lists["input_shape"] = std::vector<int64_t>(spec_.input.begin(), spec_.input.end());
  s.int_lists["hidden"] = spec_.hidden;
  s.int_lists["channels"] = spec_.channels;
  if (!spec_.definition.empty()) s.strings["model_definition"] = spec_.definition;
  if (train_ds_) {  // the input normalisation, so `dtrain eval` transforms inputs the same way
    const auto& info = train_ds_->info();
    s.tensors["meta/norm_mean"] = Tensor::from({static_cast<int64_t>(info.mean.size())}, info.mean);
    s.tensors["meta/norm_std"] = Tensor::from({static_cast<int64_t>(info.std.size())}, info.std);
  }
}

void ImageTask::check_checkpoint(CheckpointState& s) const {
  DT_INPUT_CHECK(s.strings["model"] == spec_.name, "it holds model '" << s.strings["model"] << "', not "
                                                                      << (spec_.definition.empty() ? "--model " : "")
                                                                      << spec_.name);
  DT_INPUT_CHECK(s.strings["model_definition"] == spec_.definition,
                 "its model '" << spec_.name << "' was "
                               << (spec_.definition.empty() ? "described by a model file, not the built-in one"
                                                            : "built otherwise than --model-file " +
                                                                  spec_.definition_source + " describes it"));
  std::vector<int64_t> shape = s.int_lists["input_shape"];
  DT_INPUT_CHECK(Shape(shape.begin(), shape.end()) == spec_.input,
                 "it was trained on inputs " << shape_str(Shape(shape.begin(), shape.end())) << " but the data has "
                                             << shape_str(spec_.input));
  auto ch = s.int_lists.find("channels");
  DT_INPUT_CHECK(ch == s.int_lists.end() || spec_.name != "simple_cnn" || ch->second == spec_.channels,
                 "it holds a simple_cnn of channels " << shape_str(ch->second) << " (shrunk by dtrain prune-export), "
                                                      << "training builds " << shape_str(spec_.channels));
}

// Every layout walks the same shuffled order of an epoch, rank r taking every world-th sample, so a
// step of global batch G covers the next G samples of that order whatever the rank count: the
// checkpoint's steps done in the epoch (at its global batch) become this layout's step at the same
// sample, and the log says what is exact and what is not.
ResumePoint ImageTask::resume_point(CheckpointState& s, int64_t) {
  ResumePoint at{s.ints["epoch"], s.ints["batch_in_epoch"], ""};
  const int64_t then_world = s.ints["world_size"], world = grid_->dp_size();
  const int64_t then_global = s.ints["per_rank_batch"] * then_world * s.ints["accumulate"];
  const int64_t global = batch_ * world * cfg_->accumulate;
  if (then_world != world || then_global != global) {
    const int64_t samples = at.steps_done * then_global;
    at.steps_done = samples / global;
    std::string line = "resume: " + std::to_string(then_world) + " -> " + std::to_string(world) +
                       " rank(s), global batch " + std::to_string(then_global) + " -> " + std::to_string(global) + ": ";
    if (then_global == global) {
      line +=
          "every step sees the samples it would have seen (sums in another order: equal within rounding, not "
          "bitwise)";
    } else {
      line += "continues at sample " + std::to_string(at.steps_done * global) + " of the epoch";
      if (samples != at.steps_done * global)
        line += " (" + std::to_string(samples - at.steps_done * global) + " samples seen again)";
      line += "; steps and the learning-rate schedule count the new global batch";
    }
    bool batchnorm = false;
    for (nn::Buffer* b : model_->buffers()) batchnorm |= b->name.find("running_mean") != std::string::npos;
    if (batchnorm && !cfg_->sync_batchnorm) line += "; BatchNorm statistics come from each rank's own batch";
    if (reading_.mode == "stream" && then_world != world)
      line +=
          "; streaming deals each rank a contiguous part of the epoch's order, so the rest of this epoch "
          "repeats or skips samples (exact again from the next epoch)";
    at.note = line;
  }
  if (at.steps_done >= steps_per_epoch()) {
    ++at.epoch;
    at.steps_done = 0;
  }
  return at;
}

}  // namespace

EvalResult evaluate_model(nn::Module& model, std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                          bool normalize, comm::Communicator* comm, const std::vector<float>& mean,
                          const std::vector<float>& std) {
  const Device device = nn::device_of(model);
  nn::SoftmaxCrossEntropy ce;
  StagedTensor inputs, labels;  // the batches on the model's device
  model.eval();
  nn::update_working_copies(model.parameters(), engine_for(device).math_precision());
  EvalResult r =
      evaluate_batches(ds, EvalData{batch, normalize, mean, std}, device, comm, nullptr,
                       [&](const Tensor& x, const Tensor& y, Tensor& stats) {
                         ce.accumulate(model.forward(stage_to(x, device, inputs)), stage_to(y, device, labels), stats);
                       });
  model.train();
  return r;
}

EvalResult evaluate_forward(const HostForward& forward, std::shared_ptr<const data::ShardedHdf5Dataset> ds,
                            int64_t batch, comm::Communicator* comm, const std::vector<float>& mean,
                            const std::vector<float>& std, double* forward_s) {
  nn::SoftmaxCrossEntropy ce;
  double spent = 0;
  EvalResult r = evaluate_batches(ds, EvalData{batch, true, mean, std}, Device::cpu(), comm, nullptr,
                                  [&](const Tensor& x, const Tensor& y, Tensor& stats) {
                                    const double t0 = now_s();
                                    Tensor logits = forward(x);
                                    spent += now_s() - t0;
                                    ce.accumulate(logits, y, stats);
                                  });
  if (forward_s) *forward_s = spent;
  return r;
}

ImageCheckpoint image_model_from_checkpoint(const std::string& path, CheckpointState& s) {
  DT_INPUT_CHECK(s.strings.count("model") && !is_language_model(s.strings["model"]) &&
                     s.int_lists.count("input_shape") && s.ints.count("classes"),
                 "checkpoint '" << path << "' does not hold an image model"
                                << (s.strings.count("model") ? " (it holds a " + s.strings["model"] + ")" : ""));
  ImageCheckpoint c;
  c.spec.name = s.strings["model"];
  c.spec.input = Shape(s.int_lists["input_shape"].begin(), s.int_lists["input_shape"].end());
  c.spec.classes = s.ints["classes"];
  c.spec.hidden = s.int_lists["hidden"];
  if (auto ch = s.int_lists.find("channels"); ch != s.int_lists.end()) c.spec.channels = ch->second;
  if (auto d = s.strings.find("model_definition"); d != s.strings.end()) {
    c.spec.definition = d->second;
    c.spec.definition_source = "checkpoint " + path;
  }
  DT_INPUT_CHECK(!c.spec.name.empty(), "checkpoint '" << path << "' holds no image model");
  // The attributes size the model: every layer is checked, before it allocates, against the
  // parameters the file holds (it must hold them all), not against what the attributes ask for.
  const int64_t held = held_parameters(s);
  c.spec.limits.parameters = held;
  c.spec.limits.parameters_from = "the " + std::to_string(held) + " parameters checkpoint '" + path +
                                  "' holds (attributes model, input_shape, hidden, channels, classes" +
                                  (c.spec.definition.empty() ? ")" : ", model_definition)");
  c.model = nn::make_sequential_model(c.spec);
  for (nn::Parameter* p : c.model->parameters()) {
    auto it = s.tensors.find("param/" + p->name);
    DT_INPUT_CHECK(
        it != s.tensors.end() && it->second.shape() == p->value.shape() && it->second.dtype() == p->value.dtype(),
        "checkpoint '" << path << "' does not hold parameter " << p->name << " as " << dtype_name(p->value.dtype())
                       << shape_str(p->value.shape()));
    p->value.copy_from(it->second);
  }
  for (nn::Buffer* b : c.model->buffers()) {
    auto it = s.tensors.find("buffer/" + b->name);
    DT_INPUT_CHECK(
        it != s.tensors.end() && it->second.shape() == b->value.shape() && it->second.dtype() == b->value.dtype(),
        "checkpoint '" << path << "' does not hold buffer " << b->name << " as " << dtype_name(b->value.dtype())
                       << shape_str(b->value.shape()));
    b->value.copy_from(it->second);
  }
  c.model->eval();
  checkpoint_normalisation(s, c.mean, c.std);
  return c;
}

CheckpointState image_model_checkpoint(const ImageCheckpoint& c) {
  CheckpointState s;
  s.strings["model"] = c.spec.name;
  s.ints["classes"] = c.spec.classes;
  s.int_lists["input_shape"] = std::vector<int64_t>(c.spec.input.begin(), c.spec.input.end());
  s.int_lists["hidden"] = c.spec.hidden;
  s.int_lists["channels"] = c.spec.channels;
  if (!c.spec.definition.empty()) s.strings["model_definition"] = c.spec.definition;
  for (nn::Parameter* p : c.model->parameters()) s.tensors["param/" + p->name] = to_host(p->value).clone();
  for (nn::Buffer* b : c.model->buffers()) s.tensors["buffer/" + b->name] = to_host(b->value).clone();
  if (!c.mean.empty()) {
    s.tensors["meta/norm_mean"] = Tensor::from({static_cast<int64_t>(c.mean.size())}, c.mean);
    s.tensors["meta/norm_std"] = Tensor::from({static_cast<int64_t>(c.std.size())}, c.std);
  }
  return s;
}

void checkpoint_normalisation(const CheckpointState& s, std::vector<float>& mean, std::vector<float>& std) {
  auto m = s.tensors.find("meta/norm_mean"), d = s.tensors.find("meta/norm_std");
  if (m == s.tensors.end() || d == s.tensors.end()) return;
  mean.assign(m->second.f32(), m->second.f32() + m->second.numel());
  std.assign(d->second.f32(), d->second.f32() + d->second.numel());
}

std::unique_ptr<Task> make_image_task() { return std::make_unique<ImageTask>(); }

}  // namespace dtrain::train

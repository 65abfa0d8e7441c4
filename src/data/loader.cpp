#include "dtrain/data/loader.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>
#include <span>

#include "dtrain/core/env.h"
#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"

namespace dtrain::data {

namespace {
constexpr uint64_t kSamplerStream = 0x5a3;
}

// ---- DistributedSampler ----

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world, bool shuffle, uint64_t seed,
                                       bool drop_last, std::vector<int64_t> stream_shards, int64_t window_shards)
    : size_(dataset_size),
      rank_(rank),
      world_(world),
      shuffle_(shuffle),
      seed_(seed),
      stream_shards_(std::move(stream_shards)),
      window_shards_(window_shards) {
  DT_INPUT_CHECK(world >= 1 && rank >= 0 && rank < world, "sampler: rank " << rank << " outside world " << world);
  DT_INPUT_CHECK(dataset_size > 0, "sampler: the dataset is empty");
  DT_CHECK(stream_shards_.empty() ||
               (window_shards_ >= 1 &&
                std::accumulate(stream_shards_.begin(), stream_shards_.end(), int64_t{0}) == dataset_size),
           "sampler: the shards' rows do not add up to the dataset's " << dataset_size << " samples");
  per_rank_ = drop_last ? dataset_size / world : (dataset_size + world - 1) / world;
}

std::vector<int64_t> DistributedSampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(size_));
  std::iota(order.begin(), order.end(), int64_t{0});
  Rng rng(derive_seed(derive_seed(seed_, kSamplerStream), static_cast<uint64_t>(epoch)));
  if (shuffle_ && stream_shards_.empty()) shuffle(order, rng);
  if (shuffle_ && !stream_shards_.empty()) {  // shards in a drawn order, rows shuffled within each window
    std::vector<int64_t> begin(stream_shards_.size() + 1, 0), shards(stream_shards_.size());
    for (size_t s = 0; s < stream_shards_.size(); ++s) begin[s + 1] = begin[s] + stream_shards_[s];
    std::iota(shards.begin(), shards.end(), int64_t{0});
    shuffle(shards, rng);
    size_t at = 0;  // order is rewritten in place: every index once, window by window
    for (size_t w = 0; w < shards.size(); w += static_cast<size_t>(window_shards_)) {
      const size_t window_begin = at;
      for (size_t s = w; s < std::min(shards.size(), w + static_cast<size_t>(window_shards_)); ++s)
        for (int64_t g = begin[shards[s]]; g < begin[shards[s] + 1]; ++g) order[at++] = g;
      std::span<int64_t> window(order.data() + window_begin, at - window_begin);
      shuffle(window, rng);
    }
  }
  const int64_t total = total_size();
  if (total <= size_) {
    order.resize(static_cast<size_t>(total));
  } else {
    for (int64_t i = size_; i < total; ++i) order.push_back(order[(i - size_) % size_]);
  }
  return order;
}

int64_t DistributedSampler::position(int rank, int64_t k) const {
  return stream_shards_.empty() ? k * world_ + rank : rank * per_rank_ + k;
}

std::vector<int64_t> DistributedSampler::rank_indices(int64_t epoch) const {
  std::vector<int64_t> order = epoch_order(epoch);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_rank_));
  for (int64_t k = 0; k < per_rank_; ++k) mine.push_back(order[position(rank_, k)]);
  return mine;
}

// ---- DataLoader ----

DataLoader::DataLoader(std::shared_ptr<const ShardedHdf5Dataset> dataset, const LoaderOptions& opt)
    : dataset_(std::move(dataset)),
      opt_(opt),
      sampler_(dataset_ ? dataset_->size() : 1, opt.rank, opt.world, opt.shuffle, opt.seed, opt.drop_last,
               dataset_ && opt.stream_window_shards > 0 ? dataset_->info().shard_rows : std::vector<int64_t>{},
               std::max<int64_t>(opt.stream_window_shards, 1)) {
  DT_CHECK(dataset_ != nullptr, "DataLoader needs a dataset");
  const DatasetInfo& info = dataset_->info();
  DT_INPUT_CHECK(opt_.batch_size > 0, "batch size must be positive, got " << opt_.batch_size);
  const int64_t n = sampler_.samples_per_rank();
  batches_per_epoch_ = opt_.drop_last ? n / opt_.batch_size : (n + opt_.batch_size - 1) / opt_.batch_size;
  DT_INPUT_CHECK(batches_per_epoch_ > 0, "dataset '" << info.path << "' (" << info.num_samples << " samples) gives "
                                                     << n << " samples per rank over " << opt_.world
                                                     << " ranks: not one batch of " << opt_.batch_size
                                                     << " with drop_last");
  if (opt_.augment.enabled())
    DT_INPUT_CHECK(info.sample_shape.size() == 3, "augmentation needs [C, H, W] samples; dataset '"
                                                      << info.path << "' has " << shape_str(info.sample_shape));
  DT_INPUT_CHECK(opt_.augment.crop_padding >= 0 && opt_.augment.rotate_deg >= 0,
                 "augmentation: crop padding and rotation must be >= 0");

  const std::vector<float>& means = opt_.mean.empty() ? info.mean : opt_.mean;
  const std::vector<float>& stds = opt_.std.empty() ? info.std : opt_.std;
  DT_INPUT_CHECK(static_cast<int64_t>(means.size()) == info.channels() && static_cast<int64_t>(stds.size()) == info.channels(),
                 "normalisation statistics for " << means.size() << " channel(s) do not fit dataset '" << info.path
                                                 << "' with " << info.channels());
  for (int64_t c = 0; c < info.channels(); ++c) {
    const float mean = opt_.normalize ? means[c] : 0.0f;
    const float sd = opt_.normalize ? stds[c] : 1.0f;
    scale_.push_back(1.0f / sd);
    shift_.push_back(-mean / sd);
  }

  int threads = opt_.threads >= 0 ? opt_.threads : static_cast<int>(env::get_long("DTRAIN_LOADER_THREADS"));
  prefetch_ = opt_.prefetch >= 0 ? opt_.prefetch : static_cast<int>(env::get_long("DTRAIN_PREFETCH"));
  DT_INPUT_CHECK(threads >= 0 && threads <= 256, "loader threads must be in 0..256, got " << threads);
  prefetch_ = std::max(prefetch_, 1);
  for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { worker_loop(); });
}

DataLoader::~DataLoader() {
  try {
    finish_exchanges();  // their buffers are in MPI's hands until then
  } catch (const std::exception&) {
    // already failing: the error that ends the run is reported elsewhere
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int64_t DataLoader::position() const {
  std::lock_guard<std::mutex> g(mu_);
  return next_deliver_;
}

void DataLoader::start_epoch(int64_t epoch, int64_t skip_batches) {
  DT_INPUT_CHECK(epoch >= 0, "epoch must be >= 0, got " << epoch);
  DT_INPUT_CHECK(skip_batches >= 0 && skip_batches <= batches_per_epoch_,
                 "cannot skip " << skip_batches << " batches of an epoch of " << batches_per_epoch_);
  auto plan = std::make_shared<Plan>();
  plan->epoch = epoch;
  plan->order = sampler_.rank_indices(epoch);
  if (start_exchange_) plan->all = sampler_.epoch_order(epoch);
  finish_exchanges();  // every rank started the same ones
  {
    std::lock_guard<std::mutex> g(mu_);
    plan_ = std::move(plan);
    epoch_ = epoch;
    next_take_ = next_deliver_ = next_exchange_ = arrived_ = skip_batches;
    ready_.clear();
    exchanges_.clear();
  }
  work_cv_.notify_all();
}

Batch DataLoader::build_batch(int64_t epoch, const std::vector<int64_t>& rank_order, int64_t index) const {
  const DatasetInfo& info = dataset_->info();
  const int64_t begin = index * opt_.batch_size;
  const int64_t count = std::min<int64_t>(opt_.batch_size, static_cast<int64_t>(rank_order.size()) - begin);
  DT_CHECK(count > 0, "batch " << index << " is past the epoch's end");
  const int64_t sample = info.sample_bytes();
  const int64_t channels = info.channels();
  const int64_t plane = sample / channels;

  Batch b;
  b.epoch = epoch;
  b.index = index;
  b.indices.assign(rank_order.begin() + begin, rank_order.begin() + begin + count);
  b.labels = Tensor::empty({count}, DType::I32);
  std::shared_ptr<const std::vector<uint8_t>> rows;
  if (start_exchange_) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = exchanges_.find(index);
    // (A worker still on a restarted epoch's batch may find the new epoch's: its batch is dropped.)
    DT_CHECK(it != exchanges_.end() && it->second.rows && it->second.rows->size() == static_cast<size_t>(count * sample),
             "store: batch " << index << "'s rows have not arrived");
    rows = it->second.rows;
    for (int64_t i = 0; i < count; ++i) b.labels.data<int32_t>()[i] = dataset_->label(b.indices[i]);
  } else {
    auto read = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(count * sample));
    dataset_->read(b.indices, read->data(), b.labels.data<int32_t>());
    rows = std::move(read);
  }
  const std::vector<uint8_t>& raw = *rows;

  Shape shape = {count};
  shape.insert(shape.end(), info.sample_shape.begin(), info.sample_shape.end());
  b.inputs = Tensor::empty(shape, DType::F32);
  float* out = b.inputs.f32();
  const bool augment = opt_.augment.enabled();
  std::vector<float> scratch;
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* src = raw.data() + i * sample;
    float* dst = out + i * sample;
    if (augment) {
      for (int64_t k = 0; k < sample; ++k) dst[k] = static_cast<float>(src[k]) * (1.0f / 255.0f);
      AugmentDraw d = draw_augment(opt_.augment, opt_.seed, epoch, b.indices[i]);
      apply_augment(d, dst, channels, info.sample_shape[1], info.sample_shape[2], scratch);
      for (int64_t c = 0; c < channels; ++c)
        for (int64_t k = c * plane; k < (c + 1) * plane; ++k) dst[k] = dst[k] * scale_[c] + shift_[c];
    } else {
      for (int64_t c = 0; c < channels; ++c) {
        const float a = scale_[c] * (1.0f / 255.0f), s = shift_[c];
        for (int64_t k = c * plane; k < (c + 1) * plane; ++k) dst[k] = static_cast<float>(src[k]) * a + s;
      }
    }
  }
  return b;
}

void DataLoader::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] {
      return stop_ || (plan_ && next_take_ < batches_per_epoch_ && next_take_ < next_deliver_ + prefetch_ &&
                       (!start_exchange_ || next_take_ < arrived_));
    });
    if (stop_) return;
    std::shared_ptr<const Plan> plan = plan_;
    const int64_t index = next_take_++;
    lock.unlock();

    Slot slot;
    try {
      slot.batch = build_batch(plan->epoch, plan->order, index);
    } catch (...) {
      slot.error = std::current_exception();
    }

    lock.lock();
    if (plan != plan_) continue;  // the epoch was restarted meanwhile: drop the stale batch
    ready_.emplace(index, std::move(slot));
    ready_cv_.notify_all();
  }
}

bool DataLoader::next(Batch& out) {
  if (epoch_ < 0) start_epoch(0);
  const double t0 = now_s();
  std::unique_lock<std::mutex> lock(mu_);
  if (next_deliver_ >= batches_per_epoch_) return false;
  if (start_exchange_) exchange_ahead(lock);

  if (workers_.empty()) {  // synchronous: the consumer builds its own batch
    std::shared_ptr<const Plan> plan = plan_;
    const int64_t index = next_deliver_;
    lock.unlock();
    out = build_batch(plan->epoch, plan->order, index);
    lock.lock();
    exchanges_.erase(index);
    ++next_deliver_;
    out.wait_s = now_s() - t0;
    return true;
  }

  ready_cv_.wait(lock, [&] { return ready_.count(next_deliver_) > 0; });
  auto it = ready_.find(next_deliver_);
  // A failed batch stays in place, so calling next() again reports the same error.
  if (it->second.error) std::rethrow_exception(it->second.error);
  out = std::move(it->second.batch);
  ready_.erase(it);
  exchanges_.erase(next_deliver_);
  ++next_deliver_;
  lock.unlock();
  work_cv_.notify_all();  // one more batch may now be taken
  out.wait_s = now_s() - t0;
  return true;
}

// ---- The job-wide store ----

void DataLoader::use_store(StartExchange start) {
  std::lock_guard<std::mutex> g(mu_);
  DT_CHECK(epoch_ < 0, "DataLoader::use_store after the first batch");
  // MPI's counts are ints: the most one rank sends (every rank's whole batch) must fit one.
  const int64_t most = opt_.batch_size * opt_.world * dataset_->info().sample_bytes();
  DT_INPUT_CHECK(most <= INT_MAX, "--data-mode store: a batch of " << opt_.batch_size << " rows of "
                                                                   << dataset_->info().sample_bytes() << " bytes for "
                                                                   << opt_.world << " ranks exceeds 2 GiB per exchange");
  start_exchange_ = std::move(start);
  const std::vector<int64_t>& rows = dataset_->info().shard_rows;
  shard_begin_.assign(1, 0);
  for (int64_t n : rows) shard_begin_.push_back(shard_begin_.back() + n);
}

std::vector<int64_t> DataLoader::batch_samples(const Plan& plan, int rank, int64_t index) const {
  const int64_t begin = index * opt_.batch_size, end = std::min(begin + opt_.batch_size, sampler_.samples_per_rank());
  std::vector<int64_t> samples;
  for (int64_t k = begin; k < end; ++k) samples.push_back(plan.all[sampler_.position(rank, k)]);
  return samples;
}

int DataLoader::holder_of(int64_t sample) const {
  const auto shard = std::upper_bound(shard_begin_.begin(), shard_begin_.end(), sample) - shard_begin_.begin() - 1;
  return store_holder(static_cast<size_t>(shard), opt_.world);
}

// Batch `index`'s all-to-all: to every rank in turn, the rows of its batch this rank holds, in that
// batch's order (read from the shards this rank holds, each cached whole the first time).
DataLoader::Exchange DataLoader::start_exchange(const Plan& plan, int64_t index) const {
  const int64_t row = dataset_->info().sample_bytes();
  std::vector<int64_t> send_counts(static_cast<size_t>(opt_.world), 0), held;
  Exchange x;
  x.recv_counts.assign(static_cast<size_t>(opt_.world), 0);
  for (int r = 0; r < opt_.world; ++r)
    for (int64_t g : batch_samples(plan, r, index)) {
      const int holder = holder_of(g);
      if (holder == opt_.rank) {
        held.push_back(g);
        send_counts[r] += row;
      }
      if (r == opt_.rank) x.recv_counts[holder] += row;
    }
  const int64_t received = std::accumulate(x.recv_counts.begin(), x.recv_counts.end(), int64_t{0});
  x.send = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(held.size()) * row)}, DType::U8);
  x.recv = Tensor::empty({std::max<int64_t>(1, received)}, DType::U8);
  dataset_->read(held, x.send.data<uint8_t>(), nullptr);
  x.wait = start_exchange_(x.send, send_counts, x.recv, x.recv_counts);
  return x;
}

// Waits for batch `index`'s rows and puts them in the batch's order (they arrive grouped by holder).
std::shared_ptr<const std::vector<uint8_t>> DataLoader::arrive(const Plan& plan, int64_t index, Exchange& x) const {
  x.wait();
  const int64_t row = dataset_->info().sample_bytes();
  std::vector<int64_t> at(x.recv_counts.size(), 0);
  for (size_t r = 1; r < at.size(); ++r) at[r] = at[r - 1] + x.recv_counts[r - 1];
  const std::vector<int64_t> samples = batch_samples(plan, opt_.rank, index);
  auto rows = std::make_shared<std::vector<uint8_t>>(samples.size() * static_cast<size_t>(row));
  for (size_t i = 0; i < samples.size(); ++i) {
    int64_t& from = at[static_cast<size_t>(holder_of(samples[i]))];
    std::memcpy(rows->data() + i * static_cast<size_t>(row), x.recv.data<uint8_t>() + from, static_cast<size_t>(row));
    from += row;
  }
  return rows;
}

void DataLoader::exchange_ahead(std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<const Plan> plan = plan_;
  while (next_exchange_ < std::min(batches_per_epoch_, next_deliver_ + kStoreAhead + 1)) {
    const int64_t index = next_exchange_;
    lock.unlock();
    Exchange x = start_exchange(*plan, index);  // may throw (a held shard unreadable): nothing started
    lock.lock();
    exchanges_.emplace(index, std::move(x));
    ++next_exchange_;
  }
  while (arrived_ < std::min(batches_per_epoch_, next_deliver_ + 2)) {
    Exchange& x = exchanges_.at(arrived_);  // only this thread erases entries
    lock.unlock();
    auto rows = arrive(*plan, arrived_, x);
    lock.lock();
    x.rows = std::move(rows);
    ++arrived_;
  }
  work_cv_.notify_all();
}

void DataLoader::finish_exchanges() {
  std::unique_lock<std::mutex> lock(mu_);
  for (auto& [index, x] : exchanges_)
    if (!x.rows && x.wait) {
      auto wait = std::move(x.wait);
      x.wait = nullptr;
      lock.unlock();
      wait();
      lock.lock();
    }
}

}  // namespace dtrain::data

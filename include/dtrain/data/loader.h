#pragma once
// DistributedSampler and DataLoader: each rank's share of an epoch, read and augmented on background
// threads, delivered in a deterministic order.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/data/augment.h"
#include "dtrain/data/dataset.h"

namespace dtrain::data {

// One epoch's order, identical on every rank: a permutation of 0..N-1 drawn from (seed, epoch) (the
// identity when shuffle is off), made divisible by `world` either by dropping its tail (drop_last) or
// by repeating its head (padding), then dealt round-robin: rank r takes positions r, r + world,
// r + 2*world, ... So every rank gets the same count, and without padding every sample is seen
// exactly once per epoch over all ranks; with padding the first (total - N) samples of the epoch's
// order are seen twice.
//
// Streaming order (`stream_shards` given: the rows of each shard, in global index order): the
// shards in an order drawn from (seed, epoch), walked in windows of `window_shards` whose rows are
// shuffled together, and each rank takes a contiguous part of that order (rank r: positions
// r * per_rank ...), so a rank reads its shards whole, one window after another (a shard at the
// border of two ranks' parts is read by both). Without shuffle both orders are the identity.
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int rank, int world, bool shuffle, uint64_t seed, bool drop_last,
                     std::vector<int64_t> stream_shards = {}, int64_t window_shards = 1);

  int64_t samples_per_rank() const { return per_rank_; }
  int64_t total_size() const { return per_rank_ * world_; }  // after dropping or padding
  std::vector<int64_t> epoch_order(int64_t epoch) const;     // all ranks' samples, length total_size()
  std::vector<int64_t> rank_indices(int64_t epoch) const;    // this rank's, length samples_per_rank()
  // Where sample k of `rank`'s share sits in epoch_order().
  int64_t position(int rank, int64_t k) const;

 private:
  int64_t size_;
  int rank_, world_;
  bool shuffle_;
  uint64_t seed_;
  int64_t per_rank_;
  std::vector<int64_t> stream_shards_;  // rows per shard: the streaming order; empty: a global shuffle
  int64_t window_shards_;
};

struct LoaderOptions {
  int64_t batch_size = 64;  // per rank
  bool shuffle = true;
  bool drop_last = false;  // drop the sampler's tail and the last partial batch, instead of padding
  uint64_t seed = 0;
  int threads = -1;       // background threads; < 0: DTRAIN_LOADER_THREADS; 0: build on the caller's thread
  int prefetch = -1;      // batches in flight or ready ahead of the consumer; < 0: DTRAIN_PREFETCH
  bool normalize = true;
  // Per-channel statistics to normalise with (pixel/255 units); empty: the dataset's own. Evaluation
  // passes the training set's, so test inputs are transformed exactly as training inputs were.
  std::vector<float> mean, std;  // (x/255 - mean[c]) / std[c] with the dataset's statistics; else x/255
  AugmentOptions augment;
  int rank = 0;
  int world = 1;
  // Streaming (--data-mode stream): the sampler's shard-window order (see DistributedSampler), for a
  // dataset whose cache evicts; 0: the global shuffle.
  int64_t stream_window_shards = 0;
};

// The job-wide store's all-to-all (DataLoader::use_store): sends send_counts[r] bytes of `send`
// (blocks in rank order) to rank r, receives recv_counts[r] bytes from rank r into `recv` (blocks in
// rank order), and returns what waits for it to finish.
using StartExchange = std::function<std::function<void()>(const Tensor& send, const std::vector<int64_t>& send_counts,
                                                          Tensor& recv, const std::vector<int64_t>& recv_counts)>;

struct Batch {
  Tensor inputs;                 // f32 [B, C, H, W]
  Tensor labels;                 // i32 [B]
  std::vector<int64_t> indices;  // the global sample indices, in batch order
  int64_t epoch = 0;
  int64_t index = 0;  // batch number within the epoch
  double wait_s = 0;  // seconds next() blocked waiting for this batch
};

// Batch i of an epoch is a pure function of (dataset, options, epoch, i): workers take batch numbers
// in order, build them concurrently, and next() hands them out strictly in number order. At most
// `prefetch` batches are taken but not yet handed out. An exception thrown while building batch i
// is rethrown by the next() that would have returned batch i.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const ShardedHdf5Dataset> dataset, const LoaderOptions& opt);
  ~DataLoader();  // stops and joins the workers
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // This rank's share of an epoch (with drop_last a last partial batch of it is also skipped).
  int64_t samples_per_epoch() const { return sampler_.samples_per_rank(); }

  // Begins `epoch` at batch `skip_batches` (to resume exactly where a checkpoint left off). Work
  // in flight for a previous epoch is discarded.
  void start_epoch(int64_t epoch, int64_t skip_batches = 0);
  // The next batch of the current epoch (starting epoch 0 if none was started); false at its end.
  bool next(Batch& out);

  int64_t epoch() const { return epoch_; }
  int64_t position() const;  // the number of the batch next() returns next, for checkpoints
  int threads() const { return static_cast<int>(workers_.size()); }
  int prefetch() const { return prefetch_; }
  const LoaderOptions& options() const { return opt_; }
  const DatasetInfo& info() const { return dataset_->info(); }

  // The job-wide store (--data-mode store): this rank reads only the shards it holds (store_holder
  // over the loader's ranks), and each batch's rows come from their holders through `start`, an
  // all-to-all over the loader's ranks. next() starts batch i + kStoreAhead's exchange and takes
  // batch i + 1's rows (its conversion then overlaps the caller's step), so every rank must call
  // next() and start_epoch() alike, as a data-parallel loop does. The batches are those of the
  // other modes, bit for bit. Call before the first next().
  void use_store(StartExchange start);
  static constexpr int64_t kStoreAhead = 2;

  // Builds batch `index` of `epoch` directly on the caller's thread (what the workers run). In the
  // store, batch `index`'s rows must have arrived.
  Batch build_batch(int64_t epoch, const std::vector<int64_t>& rank_order, int64_t index) const;

 private:
  struct Plan {
    int64_t epoch = 0;
    std::vector<int64_t> order;  // this rank's sample order for the epoch
    std::vector<int64_t> all;    // the store: every rank's (DistributedSampler::epoch_order)
  };
  struct Exchange {  // the store: one batch's rows on their way from their holders
    Tensor send, recv;
    std::vector<int64_t> recv_counts;
    std::function<void()> wait;
    std::shared_ptr<const std::vector<uint8_t>> rows;  // in batch order, once arrived
  };
  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };
  void worker_loop();
  std::vector<int64_t> batch_samples(const Plan& plan, int rank, int64_t index) const;
  int holder_of(int64_t sample) const;
  Exchange start_exchange(const Plan& plan, int64_t index) const;
  std::shared_ptr<const std::vector<uint8_t>> arrive(const Plan& plan, int64_t index, Exchange& x) const;
  void exchange_ahead(std::unique_lock<std::mutex>& lock);  // consumer thread, under mu_
  void finish_exchanges();                                  // consumer thread: waits for those started

  std::shared_ptr<const ShardedHdf5Dataset> dataset_;
  LoaderOptions opt_;
  DistributedSampler sampler_;
  int64_t batches_per_epoch_ = 0;
  int prefetch_ = 1;
  std::vector<float> scale_, shift_;  // per channel: normalised = x * scale + shift, x in pixel/255 units

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for a batch number to take
  std::condition_variable ready_cv_;  // the consumer waits for the batch it needs
  std::shared_ptr<const Plan> plan_;  // current epoch; workers keep their own reference
  int64_t epoch_ = -1;
  int64_t next_take_ = 0;     // next batch number a worker takes
  int64_t next_deliver_ = 0;  // next batch number next() returns
  std::map<int64_t, Slot> ready_;
  bool stop_ = false;
  StartExchange start_exchange_;            // set: the store
  std::vector<int64_t> shard_begin_;        // the store: each shard's first global index
  std::map<int64_t, Exchange> exchanges_;   // the store: batches started and not yet handed out
  int64_t next_exchange_ = 0, arrived_ = 0;  // the store: next batch to start; batches < arrived_ have rows
  std::vector<std::thread> workers_;
};

}  // namespace dtrain::data

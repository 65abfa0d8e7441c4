// DistributedSampler coverage, DataLoader determinism and resume, augmentation.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

#include "data_test_util.h"
#include "dtrain/data/loader.h"

namespace dtrain::data {
namespace {

using testing::TempDir;

TEST(Sampler, ExactCoverageEveryWorld) {
  for (int64_t n : {1, 2, 10, 11, 13, 100}) {
    for (int world : {1, 2, 3}) {
      for (bool drop_last : {false, true}) {
        std::map<int64_t, int> seen;
        int64_t per_rank = -1;
        std::vector<int64_t> order;
        for (int rank = 0; rank < world; ++rank) {
          DistributedSampler s(n, rank, world, /*shuffle=*/true, /*seed=*/7, drop_last);
          if (rank == 0) order = s.epoch_order(3);
          EXPECT_EQ(s.epoch_order(3), order) << "ranks must agree on the epoch's order";
          std::vector<int64_t> mine = s.rank_indices(3);
          if (per_rank < 0) per_rank = static_cast<int64_t>(mine.size());
          EXPECT_EQ(static_cast<int64_t>(mine.size()), per_rank) << "every rank gets the same count";
          for (int64_t i : mine) ++seen[i];
        }
        const std::string where =
            "n=" + std::to_string(n) + " world=" + std::to_string(world) + " drop_last=" + std::to_string(drop_last);
        if (drop_last) {
          EXPECT_EQ(per_rank, n / world) << where;
          for (auto [i, count] : seen) EXPECT_EQ(count, 1) << where << " index " << i;
          EXPECT_EQ(static_cast<int64_t>(seen.size()), n / world * world) << where;
        } else {
          const int64_t total = (n + world - 1) / world * world;
          EXPECT_EQ(per_rank * world, total) << where;
          EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << where << ": every sample at least once";
          // The padding repeats the epoch's order from its start (cyclically when total - n > n).
          for (int64_t k = n; k < total; ++k) EXPECT_EQ(order[k], order[(k - n) % n]) << where;
          for (auto [i, count] : seen) EXPECT_EQ(count, std::count(order.begin(), order.end(), i)) << where;
        }
      }
    }
  }
}

TEST(Sampler, ShuffleDependsOnSeedAndEpoch) {
  DistributedSampler a(50, 0, 1, true, 1, false), b(50, 0, 1, true, 2, false), plain(50, 0, 1, false, 1, false);
  EXPECT_EQ(a.epoch_order(0), a.epoch_order(0));
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  EXPECT_NE(a.epoch_order(0), b.epoch_order(0));
  std::vector<int64_t> identity(50);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(plain.epoch_order(5), identity);
  DistributedSampler r1(10, 1, 3, false, 0, false);
  EXPECT_EQ(r1.rank_indices(0), (std::vector<int64_t>{1, 4, 7, 0}));  // round robin, padded with index 0
}

// Streaming order: every sample once per epoch over 1, 2 and 4 ranks; each shard's rows inside one
// window's span of the order; drawn from (seed, epoch); the identity without shuffle.
TEST(Sampler, StreamingOrderCoversEverySampleAndKeepsShardsTogether) {
  const std::vector<int64_t> shards = {100, 37, 100, 63, 20, 80};  // 400 samples
  for (int world : {1, 2, 4}) {
    for (int64_t window : {1, 2, 6}) {
      std::vector<int> seen(400, 0);
      for (int rank = 0; rank < world; ++rank) {
        DistributedSampler s(400, rank, world, true, 9, false, shards, window);
        for (int64_t i : s.rank_indices(2)) ++seen[static_cast<size_t>(i)];
        // A rank's part is a contiguous slice of the one order.
        const std::vector<int64_t> order = s.epoch_order(2), mine = s.rank_indices(2);
        EXPECT_TRUE(std::equal(mine.begin(), mine.end(), order.begin() + rank * (400 / world)));
      }
      for (int count : seen) ASSERT_EQ(count, 1) << "world " << world << " window " << window;
    }
  }
  DistributedSampler s(400, 0, 1, true, 9, false, shards, 2);
  const std::vector<int64_t> order = s.epoch_order(0);
  int64_t begin = 0;
  for (int64_t rows : shards) {  // shard k's rows lie within two shards' span (its window) of the order
    std::vector<int64_t> at;
    for (size_t p = 0; p < order.size(); ++p)
      if (order[p] >= begin && order[p] < begin + rows) at.push_back(static_cast<int64_t>(p));
    EXPECT_LT(at.back() - at.front(), 200) << "shard of " << rows << " rows starting at " << begin;
    begin += rows;
  }
  EXPECT_EQ(order, s.epoch_order(0));
  EXPECT_NE(order, s.epoch_order(1));
  EXPECT_NE(order, DistributedSampler(400, 0, 1, true, 10, false, shards, 2).epoch_order(0));
  std::vector<int64_t> identity(400);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(DistributedSampler(400, 0, 1, false, 9, false, shards, 2).epoch_order(3), identity);
}

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_ = testing::synthetic_set(kN, 3, 8, 6, 4);
    ShardWriterOptions opt;
    opt.shard_size = 40;
    write_shards(set_, tmp_ / "d", opt);
    DatasetOptions dopt;
    dopt.cache_bytes = 0;  // exercise hyperslab reads from the workers
    ds_ = std::make_shared<ShardedHdf5Dataset>(tmp_ / "d", dopt);
  }

  std::vector<Batch> epoch(LoaderOptions opt, int64_t e, int64_t skip = 0) {
    DataLoader loader(ds_, opt);
    loader.start_epoch(e, skip);
    std::vector<Batch> out;
    Batch b;
    while (loader.next(b)) out.push_back(b);
    EXPECT_FALSE(loader.next(b));
    return out;
  }

  static void expect_same(const std::vector<Batch>& x, const std::vector<Batch>& y) {
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(x[i].index, y[i].index);
      EXPECT_EQ(x[i].indices, y[i].indices);
      ASSERT_EQ(x[i].inputs.shape(), y[i].inputs.shape());
      EXPECT_EQ(0, std::memcmp(x[i].inputs.raw(), y[i].inputs.raw(), x[i].inputs.nbytes())) << "batch " << i;
      EXPECT_EQ(0, std::memcmp(x[i].labels.raw(), y[i].labels.raw(), x[i].labels.nbytes())) << "batch " << i;
    }
  }

  static constexpr int64_t kN = 103;
  static constexpr int64_t kSample = 3 * 8 * 6;
  TempDir tmp_;
  ImageSet set_;
  std::shared_ptr<ShardedHdf5Dataset> ds_;
};

TEST_F(LoaderTest, SameBatchesWithAnyThreadCount) {
  LoaderOptions opt;
  opt.batch_size = 10;
  opt.seed = 42;
  opt.prefetch = 2;
  opt.augment.crop_padding = 2;
  opt.augment.hflip = true;
  opt.augment.rotate_deg = 10;
  opt.threads = 1;
  std::vector<Batch> one = epoch(opt, 1);
  opt.threads = 3;
  std::vector<Batch> three = epoch(opt, 1);
  opt.threads = 0;
  std::vector<Batch> sync = epoch(opt, 1);
  ASSERT_EQ(one.size(), 11u);
  EXPECT_EQ(one.back().inputs.shape(), (Shape{3, 3, 8, 6}));
  expect_same(one, three);
  expect_same(one, sync);
  opt.threads = 2;
  std::vector<Batch> other = epoch(opt, 2);
  EXPECT_NE(one[0].indices, other[0].indices) << "a new epoch must reshuffle";
}

TEST_F(LoaderTest, NormalisedValuesLabelsAndShapes) {
  LoaderOptions opt;
  opt.batch_size = 16;
  opt.shuffle = false;
  opt.threads = 2;
  std::vector<Batch> batches = epoch(opt, 0);
  ASSERT_EQ(batches.size(), 7u);
  const DatasetInfo& info = ds_->info();
  for (const Batch& b : batches) {
    ASSERT_EQ(b.inputs.dtype(), DType::F32);
    ASSERT_EQ(b.labels.dtype(), DType::I32);
    EXPECT_GE(b.wait_s, 0.0);
    for (size_t k = 0; k < b.indices.size(); ++k) {
      const int64_t g = b.indices[k];
      EXPECT_EQ(g, b.index * 16 + static_cast<int64_t>(k));
      EXPECT_EQ(b.labels.data<int32_t>()[k], set_.labels[g]);
      for (int64_t j = 0; j < kSample; j += 17) {
        const int64_t c = j / 48;
        const float want = (set_.inputs[g * kSample + j] / 255.0f - info.mean[c]) / info.std[c];
        EXPECT_NEAR(b.inputs.f32()[k * kSample + j], want, 1e-5);
      }
    }
  }
  opt.normalize = false;
  std::vector<Batch> raw = epoch(opt, 0);
  EXPECT_NEAR(raw[2].inputs.f32()[5], set_.inputs[32 * kSample + 5] / 255.0f, 1e-6);
}

TEST_F(LoaderTest, RanksSplitTheEpochAndAgreeOnBatchCount) {
  for (bool drop_last : {false, true}) {
    std::map<int64_t, int> seen;
    int64_t batches = -1;
    for (int rank = 0; rank < 3; ++rank) {
      LoaderOptions opt;
      opt.batch_size = 8;
      opt.rank = rank;
      opt.world = 3;
      opt.drop_last = drop_last;
      opt.threads = 2;
      DataLoader loader(ds_, opt);
      if (batches < 0) batches = loader.batches_per_epoch();
      EXPECT_EQ(loader.batches_per_epoch(), batches);
      loader.start_epoch(4);
      Batch b;
      int64_t got = 0;
      while (loader.next(b)) {
        ++got;
        for (int64_t g : b.indices) ++seen[g];
        if (drop_last) {
          EXPECT_EQ(b.inputs.size(0), 8);
        }
      }
      EXPECT_EQ(got, batches);
    }
    // 103 samples over 3 ranks: 35 each padded (5 batches of 8), or 34 each dropped (4 full batches).
    EXPECT_EQ(batches, drop_last ? 4 : 5);
    if (!drop_last) {
      EXPECT_EQ(static_cast<int64_t>(seen.size()), kN);
    } else {
      for (auto [g, count] : seen) EXPECT_EQ(count, 1) << g;
    }
  }
}

TEST_F(LoaderTest, ResumeWithSkipMatchesTheUninterruptedEpoch) {
  LoaderOptions opt;
  opt.batch_size = 9;
  opt.threads = 3;
  opt.augment.hflip = true;
  std::vector<Batch> full = epoch(opt, 3);
  std::vector<Batch> resumed = epoch(opt, 3, 4);
  std::vector<Batch> tail(full.begin() + 4, full.end());
  expect_same(tail, resumed);
}

TEST_F(LoaderTest, RestartMidEpochAndEarlyDestruction) {
  LoaderOptions opt;
  opt.batch_size = 5;
  opt.threads = 3;
  opt.prefetch = 4;
  DataLoader loader(ds_, opt);
  Batch b;
  ASSERT_TRUE(loader.next(b));  // implicitly starts epoch 0
  EXPECT_EQ(loader.epoch(), 0);
  ASSERT_TRUE(loader.next(b));
  EXPECT_EQ(loader.position(), 2);
  loader.start_epoch(1);
  ASSERT_TRUE(loader.next(b));
  EXPECT_EQ(b.epoch, 1);
  EXPECT_EQ(b.index, 0);
  const std::vector<int64_t> order = DistributedSampler(kN, 0, 1, true, 0, false).rank_indices(1);
  EXPECT_EQ(b.indices, std::vector<int64_t>(order.begin(), order.begin() + 5));
  // The destructor runs with batches in flight and must not hang.
}

TEST_F(LoaderTest, WorkerErrorIsRethrownAtNext) {
  // A compressed shard truncated after the (uncached) dataset opened it: inflating the missing
  // chunks fails inside the workers' reads.
  ShardWriterOptions wopt;
  wopt.shard_size = 40;
  wopt.chunk_rows = 5;
  wopt.compress_level = 1;
  write_shards(set_, tmp_ / "z", wopt);
  DatasetOptions dopt;
  dopt.cache_bytes = 0;
  auto ds = std::make_shared<ShardedHdf5Dataset>(tmp_ / "z", dopt);
  LoaderOptions opt;
  opt.batch_size = 10;
  opt.shuffle = false;
  opt.threads = 2;
  DataLoader loader(ds, opt);
  const std::string victim = tmp_ / "z/shard-00001.h5";
  fs::resize_file(victim, 4096);
  Batch b;
  ASSERT_TRUE(loader.next(b));  // samples 0..9 come from shard 0
  testing::expect_input_error(
      [&] {
        while (loader.next(b)) {
        }
      },
      {"shard-00001.h5"});
}

// Streaming through an evicting cache of two shards: each epoch reads every shard whole at most
// once (threads 0: one reader, so nothing is evicted early), the loader's batches are the same with
// worker threads, a resumed epoch continues exactly, and the cache stays within its budget.
TEST_F(LoaderTest, StreamingReadsEachShardOncePerEpochAndResumesExactly) {
  DatasetOptions dopt;
  dopt.cache_bytes = 2 * 40 * kSample;  // two of the 40-row shards
  dopt.evict = true;
  auto ds = std::make_shared<ShardedHdf5Dataset>(tmp_ / "d", dopt);
  LoaderOptions opt;
  opt.batch_size = 7;
  opt.seed = 3;
  opt.threads = 0;
  opt.stream_window_shards = 1;
  auto run = [&](std::shared_ptr<ShardedHdf5Dataset> d, int64_t e, int64_t skip) {
    DataLoader loader(d, opt);
    loader.start_epoch(e, skip);
    std::vector<Batch> out;
    Batch b;
    while (loader.next(b)) {
      out.push_back(b);
      EXPECT_LE(d->cached_bytes(), dopt.cache_bytes);
    }
    return out;
  };
  const std::vector<Batch> first = run(ds, 0, 0);
  EXPECT_EQ(ds->whole_shard_reads(), 3);  // 103 rows: shards of 40, 40, 23
  std::set<int64_t> covered;
  for (const Batch& b : first) covered.insert(b.indices.begin(), b.indices.end());
  EXPECT_EQ(covered.size(), static_cast<size_t>(kN));
  const std::vector<Batch> second = run(ds, 1, 0);
  EXPECT_GE(ds->whole_shard_reads(), 4);  // at most once more each (the last epoch's last shards may still be there)
  EXPECT_LE(ds->whole_shard_reads(), 6);
  expect_same(std::vector<Batch>(second.begin() + 5, second.end()), run(ds, 1, 5));
  opt.threads = 3;
  expect_same(second, run(ds, 1, 0));
  // The reads follow the windows: a cache of one shard cannot stream (choose_reading refuses it).
  DatasetInfo info = ds->info();
  testing::expect_input_error([&] { choose_reading(info, "stream", 0, 1, 1); },
                              {"--data-cache-mb 0", "give at least 1"});
  testing::expect_input_error([&] { choose_reading(info, "strem", 64, 1, 1); }, {"--data-mode", "strem"});
  EXPECT_EQ(choose_reading(info, "auto", 64, 2, 2).mode, "cache");
  const DataReading r = choose_reading(info, "stream", 64, 2, 2);
  EXPECT_TRUE(r.dataset.evict);
  EXPECT_EQ(r.window_shards, 3);  // every shard fits 32 MB per rank
  EXPECT_EQ(r.dataset.cache_bytes, int64_t{32} << 20);
  // 4 shards of 100 MiB, a budget of 256 MB per node of 2 ranks: over 2 nodes (4 data ranks) each
  // rank holds one shard in the store; a rank alone on a 384 MB node
  // would hold them all: it streams.
  DatasetInfo big;
  big.path = "big";
  big.shards = {"a", "b", "c", "d"};
  big.shard_rows = {100, 100, 100, 100};
  big.sample_shape = {1, 1024, 1024};
  big.num_samples = 400;
  const DataReading store = choose_reading(big, "auto", 256, 2, 4);
  EXPECT_EQ(store.mode, "store");
  EXPECT_FALSE(store.dataset.evict);
  EXPECT_NE(store.text.find("over 4 rank(s), at most 100.0 MB each"), std::string::npos) << store.text;
  EXPECT_EQ(choose_reading(big, "auto", 384, 1, 1).mode, "stream");
  testing::expect_input_error([&] { choose_reading(big, "store", 256, 2, 2); },
                              {"--data-cache-mb 256", "200.0 MB", "give at least 400"});
}

// An all-to-all among loaders on threads of one process, standing in for the MPI communicator the
// trainer gives the store: each rank's k-th call meets the other ranks' k-th calls.
class ThreadAlltoall {
 public:
  explicit ThreadAlltoall(int world) : world_(world) {}

  StartExchange rank(int r) {
    return [this, r](const Tensor& send, const std::vector<int64_t>& send_counts, Tensor& recv,
                     const std::vector<int64_t>& recv_counts) -> std::function<void()> {
      std::lock_guard<std::mutex> g(mu_);
      const int64_t call = calls_[r]++;
      Call& c = pending_[call];
      c.send.resize(static_cast<size_t>(world_));
      c.send_counts.resize(static_cast<size_t>(world_));
      c.send[r] = send;
      c.send_counts[r] = send_counts;
      ++c.ranks;
      cv_.notify_all();
      return [this, r, call, recv, recv_counts] {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return pending_[call].ranks == world_; });
        const Call& c = pending_[call];
        int64_t at = 0;
        for (int from = 0; from < world_; ++from) {
          const std::vector<int64_t>& counts = c.send_counts[from];
          ASSERT_EQ(counts[r], recv_counts[from]) << "call " << call << ": rank " << from << " sends " << r << " "
                                                  << counts[r] << " bytes, " << recv_counts[from] << " expected";
          const int64_t offset = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
          std::memcpy(static_cast<uint8_t*>(recv.raw()) + at, static_cast<const uint8_t*>(c.send[from].raw()) + offset,
                      static_cast<size_t>(counts[r]));
          at += counts[r];
        }
      };
    };
  }

 private:
  struct Call {
    std::vector<Tensor> send;
    std::vector<std::vector<int64_t>> send_counts;
    int ranks = 0;
  };
  int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, int64_t> calls_;
  std::map<int64_t, Call> pending_;
};

// The store gives each rank the batches the plain loader gives it, bit for bit, over 1, 2 and 4
// ranks, with and without worker threads, across epochs and when resuming mid-epoch; each shard is
// read once, whole, by the rank that holds it, and by no other.
TEST_F(LoaderTest, StoreGivesTheBatchesOfThePlainLoaderAndReadsEachShardOnce) {
  for (int world : {1, 2, 4}) {
    for (int threads : {0, 2}) {
      LoaderOptions opt;
      opt.batch_size = 7;
      opt.seed = 5;
      opt.threads = threads;
      opt.world = world;
      opt.augment.hflip = true;
      ThreadAlltoall alltoall(world);
      std::vector<std::vector<Batch>> got(static_cast<size_t>(world));
      std::vector<int64_t> whole_reads(static_cast<size_t>(world)), bytes(static_cast<size_t>(world));
      std::vector<std::thread> ranks;
      for (int r = 0; r < world; ++r)
        ranks.emplace_back([&, r, opt]() mutable {
          opt.rank = r;
          auto ds = std::make_shared<ShardedHdf5Dataset>(tmp_ / "d");
          DataLoader loader(ds, opt);
          loader.use_store(alltoall.rank(r));
          for (auto [e, skip] : {std::pair<int64_t, int64_t>{0, 0}, {1, 0}, {1, 3}}) {
            loader.start_epoch(e, skip);
            Batch b;
            if (e == 1 && skip == 0) {  // stopped after 2 batches: the resume starts over with the exchanges
              for (int i = 0; i < 2 && loader.next(b); ++i) got[r].push_back(b);
              continue;
            }
            while (loader.next(b)) got[r].push_back(b);
          }
          whole_reads[r] = ds->whole_shard_reads();
          bytes[r] = ds->bytes_read();
        });
      for (std::thread& t : ranks) t.join();
      int64_t shards_read = 0, bytes_read = 0;
      for (int r = 0; r < world; ++r) {
        LoaderOptions plain = opt;
        plain.rank = r;
        std::vector<Batch> want = epoch(plain, 0);
        const std::vector<Batch> second = epoch(plain, 1), resumed = epoch(plain, 1, 3);
        want.insert(want.end(), second.begin(), second.begin() + 2);
        want.insert(want.end(), resumed.begin(), resumed.end());
        SCOPED_TRACE("world " + std::to_string(world) + " rank " + std::to_string(r) + " threads " +
                     std::to_string(threads));
        expect_same(got[r], want);
        int64_t held = 0;
        for (size_t s = 0; s < 3; ++s) held += store_holder(s, world) == r;
        EXPECT_EQ(whole_reads[r], held);
        shards_read += whole_reads[r];
        bytes_read += bytes[r];
      }
      EXPECT_EQ(shards_read, 3);
      EXPECT_EQ(bytes_read, kN * kSample);
    }
  }
}

TEST(Augment, FlipMirrorsEachRow) {
  std::vector<float> img = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};  // [2, 2, 3]
  std::vector<float> scratch;
  AugmentDraw d;
  d.flip = true;
  apply_augment(d, img.data(), 2, 2, 3, scratch);
  EXPECT_EQ(img, (std::vector<float>{3, 2, 1, 6, 5, 4, 9, 8, 7, 12, 11, 10}));
}

TEST(Augment, CropShiftsWithZeroPadding) {
  std::vector<float> img = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // [1, 3, 3]
  std::vector<float> scratch;
  AugmentDraw d;
  d.dy = 1;
  d.dx = -1;
  apply_augment(d, img.data(), 1, 3, 3, scratch);
  EXPECT_EQ(img, (std::vector<float>{0, 4, 5, 0, 7, 8, 0, 0, 0}));
}

TEST(Augment, RotationByZeroIsIdentityAndByNinetyTurnsTheImage) {
  std::vector<float> img(16);
  std::iota(img.begin(), img.end(), 1.0f);
  std::vector<float> scratch, same = img;
  AugmentDraw d;
  d.angle_deg = 0;
  apply_augment(d, same.data(), 1, 4, 4, scratch);
  EXPECT_EQ(same, img);
  std::vector<float> turned = img;
  d.angle_deg = 90;
  apply_augment(d, turned.data(), 1, 4, 4, scratch);
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 4; ++x) {
      // The source of out(y, x) is (cy - (x - cx), cx + (y - cy)) = (3 - x, y) with the centre at (1.5, 1.5).
      EXPECT_NEAR(turned[y * 4 + x], img[(3 - x) * 4 + y], 1e-4) << y << "," << x;
    }
}

TEST(Augment, DrawsDependOnlyOnSeedEpochAndSample) {
  AugmentOptions opt;
  opt.crop_padding = 4;
  opt.hflip = true;
  opt.rotate_deg = 15;
  int flips = 0, moved = 0;
  for (int64_t i = 0; i < 200; ++i) {
    AugmentDraw a = draw_augment(opt, 9, 1, i), b = draw_augment(opt, 9, 1, i);
    EXPECT_EQ(a.dy, b.dy);
    EXPECT_EQ(a.dx, b.dx);
    EXPECT_EQ(a.flip, b.flip);
    EXPECT_EQ(a.angle_deg, b.angle_deg);
    EXPECT_LE(std::abs(a.dy), 4);
    EXPECT_LE(std::abs(a.angle_deg), 15.0f);
    flips += a.flip;
    moved += (a.dy != 0 || a.dx != 0);
  }
  EXPECT_GT(flips, 60);
  EXPECT_LT(flips, 140);
  EXPECT_GT(moved, 150);
  AugmentOptions off;
  AugmentDraw z = draw_augment(off, 9, 1, 3);
  EXPECT_FALSE(z.flip || z.dy || z.dx || z.angle_deg != 0.0f);
}

TEST_F(LoaderTest, LoaderFlipMirrorsExactlyTheDrawnSamples) {
  LoaderOptions plain;
  plain.batch_size = 20;
  plain.threads = 2;
  plain.seed = 5;
  LoaderOptions flip = plain;
  flip.augment.hflip = true;
  std::vector<Batch> a = epoch(plain, 0), b = epoch(flip, 0);
  ASSERT_EQ(a.size(), b.size());
  int flipped = 0, kept = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].indices, b[i].indices);
    for (size_t k = 0; k < a[i].indices.size(); ++k) {
      const bool f = draw_augment(flip.augment, 5, 0, a[i].indices[k]).flip;
      (f ? flipped : kept)++;
      const float* x = a[i].inputs.f32() + k * kSample;
      const float* y = b[i].inputs.f32() + k * kSample;
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t r = 0; r < 8; ++r)
          for (int64_t col = 0; col < 6; ++col) {
            const int64_t src = f ? 5 - col : col;
            ASSERT_NEAR(y[(c * 8 + r) * 6 + col], x[(c * 8 + r) * 6 + src], 1e-5);
          }
    }
  }
  EXPECT_GT(flipped, 20);
  EXPECT_GT(kept, 20);
}

}  // namespace
}  // namespace dtrain::data

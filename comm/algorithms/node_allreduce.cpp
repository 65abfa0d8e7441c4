#include "algorithms/node_allreduce.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <ctime>
#include <exception>
#include <new>

#include "control/phase_deadline.h"
#include "dtrain/comm/mpi_check.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/env.h"
#include "dtrain/core/timer.h"

namespace dtrain::comm::detail {
namespace {

constexpr int64_t kCutAlign = 16;  // floats: parts start on 64-byte lines, so ranks never share one
constexpr size_t kControlBytes = 256;
// MPI_Win_allocate_shared promises no alignment (Open MPI 4.1 starts the segments 8 bytes past a
// line), while Control's alignas(64) and the 64-byte parts need lines: every segment holds one spare
// line and is used from its first line boundary on.
constexpr uintptr_t kLineBytes = 64;
char* line_aligned(char* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + kLineBytes - 1) & ~(kLineBytes - 1));
}
constexpr int64_t kNodeChunkFloats = (int64_t(1) << 20) / 4;  // one node's chunk: 1 MiB of floats
constexpr int64_t kFoldBlock = 1024;  // floats per rank in the fold's scratch (L x 4 KiB, in L1/L2)

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long timeout_ns) {
  timespec ts{0, timeout_ns};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

MPI_Comm split_by_node(MPI_Comm comm) {
  int rank = 0;
  DT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_Comm node = MPI_COMM_NULL;
  DT_MPI_CHECK(MPI_Comm_split(comm, node_color(), rank, &node));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(node, MPI_ERRORS_RETURN));
  return node;
}

// acc[k] = op(acc[k], x[k])
void fold(float* __restrict acc, const float* __restrict x, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      for (int64_t k = 0; k < n; ++k) acc[k] += x[k];
      break;
    case ReduceOp::Max:
      for (int64_t k = 0; k < n; ++k) acc[k] = std::max(acc[k], x[k]);
      break;
    case ReduceOp::Min:
      for (int64_t k = 0; k < n; ++k) acc[k] = std::min(acc[k], x[k]);
      break;
  }
}

// store(k, op(x0[k], x1[k])) (Avg: divided by comm_size); x0 and x1 are local ranks 0's and 1's
// copies, in that order as the pairwise tree has them.
template <class Store>
void fold_pair(const float* x0, const float* x1, int64_t n, ReduceOp op, int comm_size, Store store) {
  const float ranks = static_cast<float>(comm_size);
  switch (op) {
    case ReduceOp::Sum:
      for (int64_t k = 0; k < n; ++k) store(k, x0[k] + x1[k]);
      break;
    case ReduceOp::Avg:
      for (int64_t k = 0; k < n; ++k) store(k, (x0[k] + x1[k]) / ranks);
      break;
    case ReduceOp::Max:
      for (int64_t k = 0; k < n; ++k) store(k, std::max(x0[k], x1[k]));
      break;
    case ReduceOp::Min:
      for (int64_t k = 0; k < n; ++k) store(k, std::min(x0[k], x1[k]));
      break;
  }
}

MPI_Op mpi_float_op(ReduceOp op) { return op == ReduceOp::Max ? MPI_MAX : op == ReduceOp::Min ? MPI_MIN : MPI_SUM; }

}  // namespace

int node_color() {
  const long per_node = env::get_long("DTRAIN_TEST_RANKS_PER_NODE");
  if (per_node <= 0) return Runtime::get().topology().node_index;
  int world_rank = 0;
  DT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  return static_cast<int>(world_rank / per_node);
}

NodeAllreduce::NodeAllreduce(MPI_Comm comm, double timeout_s) : timeout_s_(timeout_s) {
  detail::PhaseDeadline deadline("creating the shared-memory allreduce's node window", timeout_s,
                                 detail::PhaseDeadline::Ending::abort_job);
  int rank = 0;
  DT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  node_comm_ = split_by_node(comm);
  DT_MPI_CHECK(MPI_Comm_rank(node_comm_, &local_rank_));
  DT_MPI_CHECK(MPI_Comm_size(node_comm_, &local_size_));
  DT_MPI_CHECK(MPI_Comm_split(comm, local_rank_, rank, &cross_comm_));
  DT_MPI_CHECK(MPI_Comm_set_errhandler(cross_comm_, MPI_ERRORS_RETURN));
  // Local rank 0 of every node is rank 0 of its cross communicator, whose size is the node count.
  int sizes[2] = {local_size_, -local_size_};
  DT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MAX, comm));
  uniform_ = sizes[0] == -sizes[1];
  if (local_rank_ == 0) DT_MPI_CHECK(MPI_Comm_size(cross_comm_, &node_count_));
  DT_MPI_CHECK(MPI_Bcast(&node_count_, 1, MPI_INT, 0, node_comm_));

  chunk_floats_ = std::max<int64_t>(kCutAlign * local_size_,
                                    static_cast<int64_t>(env::get_double("DTRAIN_SHM_CHUNK_MB") * (1 << 20) / 4));
  chunk_floats_ -= chunk_floats_ % kCutAlign;
  MPI_Aint bytes =
      static_cast<MPI_Aint>(2 * chunk_floats_ * sizeof(float) + kLineBytes) + (local_rank_ == 0 ? kControlBytes : 0);
  void* base = nullptr;
  DT_MPI_CHECK(MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, node_comm_, &base, &window_));
  slots_.resize(local_size_);
  scratch_.resize(static_cast<size_t>(local_size_ * kFoldBlock));
  char* control_base = nullptr;
  for (int p = 0; p < local_size_; ++p) {
    MPI_Aint size = 0;
    int unit = 0;
    char* seg = nullptr;
    DT_MPI_CHECK(MPI_Win_shared_query(window_, p, &size, &unit, &seg));
    seg = line_aligned(seg);
    if (p == 0) {
      control_base = seg;
      seg += kControlBytes;
    }
    slots_[p] = reinterpret_cast<float*>(seg);
  }
  if (local_rank_ == 0) control_ = new (control_base) Control;
  DT_MPI_CHECK(MPI_Barrier(node_comm_));
  control_ = reinterpret_cast<Control*>(control_base);
}

NodeAllreduce::~NodeAllreduce() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // As NodeSharedMemory's: not while an error unwinds this rank alone (the others may never come).
  if (finalized || std::uncaught_exceptions() > 0) return;
  detail::PhaseDeadline deadline("freeing the shared-memory allreduce's node window", timeout_s_,
                                 detail::PhaseDeadline::Ending::abort_job);
  if (window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
  if (cross_comm_ != MPI_COMM_NULL) MPI_Comm_free(&cross_comm_);
  if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
}

void NodeAllreduce::barrier() {
  const uint32_t gen = control_->generation.load(std::memory_order_acquire);
  if (control_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(local_size_)) {
    control_->arrived.store(0, std::memory_order_relaxed);
    control_->generation.fetch_add(1, std::memory_order_seq_cst);
    if (control_->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&control_->generation);
    return;
  }
  // Spin while the others are likely on their way (a few microseconds), then sleep on the futex,
  // so ranks sharing a core with the late one give it the core.
  for (int spin = 0; spin < 4000; ++spin) {
    if (control_->generation.load(std::memory_order_acquire) != gen) return;
    __builtin_ia32_pause();
  }
  WaitClock clock;  // a stop of the whole job (SIGSTOP, scontrol suspend) does not count
  control_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  while (control_->generation.load(std::memory_order_seq_cst) == gen) {
    futex_wait(&control_->generation, gen, 1000000);
    if (timeout_s_ > 0 && clock.waited() > timeout_s_) {
      control_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      DT_CHECK(false, "shared-memory allreduce: the ranks of this node did not all reach its barrier within "
                          << timeout_s_ << " s");
    }
  }
  control_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

int64_t NodeAllreduce::cut(int p, int64_t m) const {
  if (p >= local_size_) return m;
  return std::min(m, (p * m / local_size_) / kCutAlign * kCutAlign);
}

void NodeAllreduce::chunk(float* x, int64_t m, ReduceOp op, bool across_nodes, int comm_size) {
  const int64_t half = static_cast<int64_t>(chunks_run_++ % 2) * chunk_floats_;
  const int me = local_rank_;
  float* mine = slots_[me] + half;
  const int64_t lo = cut(me, m), hi = cut(me + 1, m);
  for (int p = 0; p < local_size_; ++p)
    if (p != me) std::memcpy(mine + cut(p, m), x + cut(p, m), (cut(p + 1, m) - cut(p, m)) * sizeof(float));
  barrier();
  // Part me of slots 0..L-1 (slot me's part is x itself, never copied in), folded as a pairwise
  // tree in local-rank order, ((x0 + x1) + (x2 + x3)) ..., block by block through a scratch of L
  // rows: the same rounding as recursive halving, and no worse than a left fold for many ranks.
  float* part = x + lo;
  const int64_t n = hi - lo;
  if (local_size_ == 2 && !(across_nodes && node_count_ > 1)) {
    // Two ranks, one node: one pass reads both copies and writes the result to x and the slot.
    const float* peer = slots_[1 - me] + half + lo;
    float* __restrict slot = mine + lo;
    fold_pair(me == 0 ? part : peer, me == 0 ? peer : part, n, op, comm_size,
              [part, slot](int64_t k, float v) { slot[k] = part[k] = v; });
  } else {
    fold_parts(part, part, half + lo, n, op);
    if (across_nodes && node_count_ > 1)
      DT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, part, static_cast<int>(n), MPI_FLOAT, mpi_float_op(op), cross_comm_));
    if (op == ReduceOp::Avg)
      for (int64_t k = 0; k < n; ++k) part[k] /= static_cast<float>(comm_size);
    std::memcpy(mine + lo, part, n * sizeof(float));
  }
  barrier();
  for (int p = 0; p < local_size_; ++p)
    if (p != me) std::memcpy(x + cut(p, m), slots_[p] + half + cut(p, m), (cut(p + 1, m) - cut(p, m)) * sizeof(float));
}

// n elements from `at` of every other local rank's slot and this rank's own from `own`, folded into
// `dest` (which may be `own`).
void NodeAllreduce::fold_parts(const float* own, float* dest, int64_t at, int64_t n, ReduceOp op) {
  const int me = local_rank_;
  for (int64_t b = 0; b < n; b += kFoldBlock) {
    const int64_t len = std::min(kFoldBlock, n - b);
    for (int p = 0; p < local_size_; ++p)
      std::memcpy(&scratch_[p * kFoldBlock], (p == me ? own : slots_[p] + at) + b, len * sizeof(float));
    for (int stride = 1; stride < local_size_; stride *= 2)
      for (int p = 0; p + stride < local_size_; p += 2 * stride)
        fold(&scratch_[p * kFoldBlock], &scratch_[(p + stride) * kFoldBlock], len, op);
    std::memcpy(dest + b, scratch_.data(), len * sizeof(float));
  }
}

void NodeAllreduce::allreduce(float* x, int64_t count, ReduceOp op, bool across_nodes, int comm_size) {
  DT_CHECK(across_nodes || node_count_ == 1, "shared-memory allreduce over " << node_count_ << " nodes");
  // Inside one node a chunk's copies stay in the cores' L2 at 1 MiB (64 MiB on 2 ranks: 5.6 GB/s,
  // against 5.1 with 4 MiB chunks, Intel Xeon, 2 MiB of L2 a core); across nodes each chunk is
  // one MPI_Allreduce of its part, and over TCP fewer, larger ones win (10gbit, 64 MiB: 0.31
  // GB/s busBw with 1 MiB chunks, 0.49 with 4 MiB).
  const int64_t step = across_nodes && node_count_ > 1 ? chunk_floats_ : std::min(chunk_floats_, kNodeChunkFloats);
  for (int64_t done = 0; done < count; done += step)
    chunk(x + done, std::min(step, count - done), op, across_nodes, comm_size);
}

// Chunk by chunk along the blocks: s elements of every block a chunk, block p's going to slot
// position p * s of this rank's half.
void NodeAllreduce::reduce_scatter(const float* in, float* out, int64_t block, ReduceOp op, int comm_size) {
  DT_CHECK(node_count_ == 1, "shared-memory reduce-scatter over " << node_count_ << " nodes");
  const int me = local_rank_;
  const int64_t s = std::min(chunk_floats_, kNodeChunkFloats) / local_size_ / kCutAlign * kCutAlign;
  const float ranks = static_cast<float>(comm_size);
  for (int64_t done = 0; done < block; done += s) {
    const int64_t n = std::min(s, block - done);
    float* mine = half_of(me);
    for (int p = 0; p < local_size_; ++p)
      if (p != me) std::memcpy(mine + p * s, in + p * block + done, n * sizeof(float));
    barrier();
    const float* own = in + me * block + done;
    float* __restrict dest = out + done;
    const int64_t at = (half_of(me) - slots_[me]) + me * s;
    if (local_size_ == 2) {
      const float* peer = slots_[1 - me] + at;
      fold_pair(me == 0 ? own : peer, me == 0 ? peer : own, n, op, comm_size,
                [dest](int64_t k, float v) { dest[k] = v; });
    } else {
      fold_parts(own, dest, at, n, op);
      if (op == ReduceOp::Avg)
        for (int64_t k = 0; k < n; ++k) dest[k] /= ranks;
    }
    ++chunks_run_;
  }
}

void NodeAllreduce::allgather(const void* in, void* out, int64_t block_bytes) {
  DT_CHECK(node_count_ == 1, "shared-memory allgather over " << node_count_ << " nodes");
  const int me = local_rank_;
  const int64_t s = std::min(chunk_floats_, kNodeChunkFloats) * static_cast<int64_t>(sizeof(float));
  const char* from = static_cast<const char*>(in);
  char* to = static_cast<char*>(out);
  for (int64_t done = 0; done < block_bytes; done += s) {
    const int64_t n = std::min(s, block_bytes - done);
    std::memcpy(half_of(me), from + done, n);
    barrier();
    for (int p = 0; p < local_size_; ++p)
      if (p != me)
        std::memcpy(to + p * block_bytes + done, half_of(p), n);
      else if (to + p * block_bytes != from)  // in place: already there
        std::memcpy(to + p * block_bytes + done, from + done, n);
    ++chunks_run_;
  }
}

}  // namespace dtrain::comm::detail

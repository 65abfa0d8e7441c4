#pragma once
// Topology-aware allreduce of f32 host buffers for the MPI backend.
//
// The ranks of a communicator are grouped by node (MPI_Comm_split_type SHARED, or the test hook
// DTRAIN_TEST_RANKS_PER_NODE). The ranks of a node share an MPI-3 window (MPI_Win_allocate_shared):
// per local rank two halves of DTRAIN_SHM_CHUNK_MB, used by alternate chunks, and a barrier
// (counter, generation and a futex) in the first bytes of local rank 0's segment.
//
// One chunk of m elements, L local ranks, local rank i owning part i (m / L elements, 64-byte
// aligned cuts):
//   1. copy-in: rank i copies every part but its own into its own slot;
//   2. barrier;
//   3. reduce: rank i folds part i of slots 0..L-1 as a pairwise tree in local-rank order (its own
//      from its buffer), then, across nodes (hier), allreduces it by MPI with the ranks of the same local rank on the
//      other nodes; the result goes to its buffer and to part i of its slot (two ranks on one node:
//      one pass, fold_two);
//   4. barrier;
//   5. copy-out: rank i copies part p of slot p, for every p != i, into its buffer.
// A chunk's copy-in writes the half its predecessor's predecessor read, which every rank finished
// before the last barrier, so two barriers a chunk suffice. Every element is folded once, by one
// rank, so every rank ends with the same bits.
//
// Its two halves run alone too, on one node (what ZeRO's shards exchange): reduce_scatter is steps
// 1-3 with rank i's part its block of the input (one barrier a chunk: a half is written again only
// after the next chunk's barrier, which every rank passes once done reading it), allgather is step
// 5 after each rank copied its own block into its slot.
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "dtrain/comm/communicator.h"

namespace dtrain::comm::detail {

// This rank's node as a split color: its node index, or world rank / DTRAIN_TEST_RANKS_PER_NODE
// where that test hook is set.
int node_color();

class NodeAllreduce {
 public:
  // Collective over `comm`. `timeout_s` bounds a barrier wait (0: none).
  NodeAllreduce(MPI_Comm comm, double timeout_s);
  ~NodeAllreduce();  // frees the window and communicators (collective over the node)
  NodeAllreduce(const NodeAllreduce&) = delete;
  NodeAllreduce& operator=(const NodeAllreduce&) = delete;

  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int node_count() const { return node_count_; }
  // Every node holds as many ranks of the communicator (what the hierarchical algorithm needs).
  bool uniform() const { return uniform_; }

  // In place, over every rank of the communicator: x = op(x of all ranks). `across_nodes` false
  // requires one node. `comm_size` divides an Avg.
  void allreduce(float* x, int64_t count, ReduceOp op, bool across_nodes, int comm_size);
  // One node. `in`: a block of `block` floats per local rank, in local-rank order; `out`: op over
  // the ranks of this rank's block (Avg divided by comm_size).
  void reduce_scatter(const float* in, float* out, int64_t block, ReduceOp op, int comm_size);
  // One node. `out`: every local rank's `block_bytes` bytes of `in`, in local-rank order.
  void allgather(const void* in, void* out, int64_t block_bytes);

 private:
  struct Control {
    alignas(64) std::atomic<uint32_t> arrived{0};
    alignas(64) std::atomic<uint32_t> generation{0};
    std::atomic<uint32_t> sleepers{0};
  };
  void barrier();
  void chunk(float* x, int64_t m, ReduceOp op, bool across_nodes, int comm_size);
  void fold_parts(const float* own, float* dest, int64_t at, int64_t n, ReduceOp op);
  int64_t cut(int p, int64_t m) const;  // first element of part p of a chunk of m
  float* half_of(int p) { return slots_[p] + static_cast<int64_t>(chunks_run_ % 2) * chunk_floats_; }

  MPI_Comm node_comm_ = MPI_COMM_NULL;   // the ranks of this node
  MPI_Comm cross_comm_ = MPI_COMM_NULL;  // the ranks of this local rank on every node
  MPI_Win window_ = MPI_WIN_NULL;
  int local_rank_ = 0, local_size_ = 1, node_count_ = 1;
  bool uniform_ = true;
  double timeout_s_ = 0;
  int64_t chunk_floats_ = 0;    // elements per chunk (one half of a slot)
  std::vector<float*> slots_;   // every local rank's segment: two halves of chunk_floats_
  std::vector<float> scratch_;  // the fold's rows, one per local rank
  Control* control_ = nullptr;
  uint64_t chunks_run_ = 0;  // picks the half: chunk k uses half k % 2
};

}  // namespace dtrain::comm::detail

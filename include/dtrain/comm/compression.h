#pragma once
// Gradient compression as a hook on a flat f32 gradient bucket (as c10d's communication hooks):
// the compressor encodes the bucket, runs the collective its encoding needs through a
// Communicator, and decodes the reduced result back into the bucket. Every rank ends with the
// same bits. All arithmetic runs through the Engine of the bucket's device (a GPU's, the CPU's, or
// the simulated device's), and the state stays there: the same code on every device. Compressors with error feedback
// keep, per bucket, what they did not send (the residual) and add it to the next step's gradient, so that over steps
//   sum of transmitted results + mean residual over ranks == sum of mean gradients.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/tensor.h"

namespace dtrain::comm {

struct CompressionStats {
  int64_t calls = 0;
  int64_t bytes_in = 0;    // f32 bytes of the buckets given to reduce()
  int64_t bytes_sent = 0;  // bytes this rank contributed to the collectives
  int64_t last_bytes_sent = 0;
  double compress_s = 0;    // encoding, error feedback and the compute between collectives
  double decompress_s = 0;  // decoding into the bucket
};

class Compressor {
 public:
  virtual ~Compressor();
  virtual std::string name() const = 0;  // e.g. "topk(0.01)"
  virtual bool has_error_feedback() const { return false; }

  // Reduces `bucket` (flat, f32, on any device) across `comm` through this encoding: op Avg (the mean
  // gradient) or Sum. Asynchronous: the bucket holds the result once the Work completes. The
  // compressor must outlive the Work. `bucket_id` keys the per-bucket state (residual, factors,
  // random stream); a bucket must keep its size.
  // `rows` > 0 says the bucket is one tensor whose natural matrix view is rows x (numel / rows)
  // (a layer's weight as [out, in*kh*kw], as PyTorch's PowerSGD hook reshapes it); 0: a flat bucket.
  std::shared_ptr<Work> reduce(Tensor& bucket, Communicator& comm, ReduceOp op = ReduceOp::Avg, int bucket_id = 0,
                               int64_t rows = 0);

  const CompressionStats& stats() const { return stats_; }
  // The error-feedback residual of a bucket; an undefined Tensor before the first call or when
  // the compressor has none.
  Tensor residual(int bucket_id = 0) const;
  void reset();  // forgets every bucket's state
  // Checkpointing this rank's state (it differs between ranks): every bucket's error-feedback
  // residual, PowerSGD's Q, the top-k momentum and QSGD's random stream, as host tensors named
  // "bucket<id>.residual|factor|velocity|draws" (QSGD's count of draws as i64[1]); and back,
  // replacing all state (moved to the buckets' device on their next reduce). A resumed run then
  // continues error feedback where the checkpointed one stopped.
  std::map<std::string, Tensor> state_tensors() const;
  void load_state_tensors(const std::map<std::string, Tensor>& state);  // InputError on a bad entry

  // What the compressor owns of the training loop, asked instead of its kind:
  // the optimizer step the next reduce belongs to, with the warm-up's length (top-k's sparsity
  // falls from 25 % to its ratio, PowerSGD sends plain allreduces until it ends);
  virtual void on_step(int64_t step, int64_t warmup_steps) { (void)step, (void)warmup_steps; }
  // whether it factorises each tensor alone (its buckets are then one tensor each, with rows);
  virtual bool per_tensor() const { return false; }
  // SGD's momentum moved into the compressor (top-k's momentum correction); InputError elsewhere.
  virtual void set_momentum_correction(float m);

 protected:
  struct BucketState {
    int id = 0;
    int64_t rows = 0;   // the matrix view's rows when the bucket is one tensor (see reduce)
    Tensor residual;    // f32, bucket size
    Tensor factor;      // PowerSGD: Q, warm start
    Tensor velocity;    // top-k with momentum correction: the local momentum u
    int64_t draws = 0;  // QSGD: reduces so far (the seed of the next one's random numbers)
    // One of the tensors above on `device`, moved there when a checkpoint put it on the host.
    static Tensor& on(Tensor& t, Device device);
  };
  virtual std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) = 0;
  BucketState& state(int bucket_id) { return states_[bucket_id]; }

  CompressionStats stats_;

 private:
  std::map<int, BucketState> states_;
};

// The uncompressed baseline: a plain allreduce.
class NoCompressor final : public Compressor {
 public:
  std::string name() const override { return "none"; }

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;
};

// Cast to fp16 or bf16, allreduce (fp32 accumulation), cast back. For Avg the values are divided
// by the rank count before the cast, so the sum cannot overflow fp16.
class HalfCastCompressor final : public Compressor {
 public:
  explicit HalfCastCompressor(DType half);  // DType::F16 or DType::BF16
  std::string name() const override { return half_ == DType::F16 ? "fp16" : "bf16"; }

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;

 private:
  DType half_;
};

// Top-k by magnitude (k = ceil(ratio * n)) with error feedback. Each rank sends k (index, value)
// pairs with one allgather; the result is scattered and summed in rank order.
// With momentum correction m > 0 (Lin et al., Deep Gradient Compression) the compressor keeps the
// momentum itself: u = m u + g, v = v + u, sends the top-k of v and clears both u and v where it
// sent (momentum factor masking). The optimizer must then run without momentum: what it receives
// is already the momentum update. Without it (m = 0) the residual accumulates raw gradients.
class TopKCompressor final : public Compressor {
 public:
  explicit TopKCompressor(double ratio, float momentum_correction = 0.f);
  std::string name() const override;
  double ratio() const { return ratio_; }
  void set_ratio(double ratio);  // for a sparsity warm-up (DGC): start dense, reach the target
  float momentum_correction() const { return momentum_; }
  void set_momentum_correction(float m) override;
  bool has_error_feedback() const override { return true; }
  void on_step(int64_t step, int64_t warmup_steps) override;

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;

 private:
  double ratio_;
  double target_;  // the ratio asked for, where the warm-up ends
  float momentum_ = 0.f;
};

// PowerSGD (Vogels et al. 2019): the bucket as a rows x cols matrix M (plus residual) is
// approximated by P Q^T of rank r: P = M Q, allreduce P, orthonormalise, Q = M^T P, allreduce Q.
// Q is kept as the next step's warm start. Error feedback against the averaged approximation.
// Buckets too small for rank r to save anything ((rows + cols) r >= n) are allreduced as they are.
class PowerSgdCompressor final : public Compressor {
 public:
  explicit PowerSgdCompressor(int rank, uint64_t seed = 0x5eed);
  std::string name() const override;
  bool has_error_feedback() const override { return true; }
  // The matrix shape used for a bucket of n elements: cols = ceil(sqrt(n)), rows = ceil(n / cols).
  // The matrix a bucket of n elements is factorised as: rows x n/rows when the caller gave the
  // tensor's rows, otherwise close to square.
  static std::pair<int64_t, int64_t> matrix_shape(int64_t n, int64_t rows = 0);
  bool per_tensor() const override { return true; }
  void on_step(int64_t step, int64_t warmup_steps) override { dense_ = step < warmup_steps; }

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;

 private:
  int rank_;
  uint64_t seed_;
  bool dense_ = false;  // the warm-up: plain allreduces
};

// 1-bit (sign) with error feedback and a scale: each rank sends sign(x) as bits and
// scale = mean |x|, so that scale * sign(x) keeps x's L1 norm (Karimireddy et al. 2019, EF-SignSGD).
class SignCompressor final : public Compressor {
 public:
  std::string name() const override { return "sign"; }
  bool has_error_feedback() const override { return true; }

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;
};

// QSGD (Alistarh et al. 2017): x_i = ||x|| * sign(x_i) * l_i / s, with l_i the integer level
// below |x_i| s / ||x|| rounded up with probability equal to the remainder (unbiased). Levels
// travel as int8 (s <= 127). The random numbers of a reduce hash (seed, rank, bucket, its count).
class QsgdCompressor final : public Compressor {
 public:
  explicit QsgdCompressor(int levels, uint64_t seed = 0x5eed);
  std::string name() const override;

 protected:
  std::shared_ptr<Work> do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState& state) override;

 private:
  int levels_;
  uint64_t seed_;
};

// "none", "fp16", "bf16", "topk[:ratio]" (0.01), "powersgd[:rank]" (4), "sign", "qsgd[:levels]" (16).
// Throws InputError naming the spec when it is not one of these.
std::unique_ptr<Compressor> make_compressor(const std::string& spec, uint64_t seed = 0x5eed);
const std::vector<std::string>& compressor_kinds();  // the names above, without parameters

}  // namespace dtrain::comm

// The gradient-exchange hooks of grad_hook.h: allreduce, compress, inter-node.
#include <vector>

#include "dtrain/comm/compression.h"
#include "dtrain/parallel/grad_hook.h"

namespace dtrain::parallel {

GradHook::~GradHook() = default;

void GradHook::load_state(const std::map<std::string, Tensor>& state) {
  DT_INPUT_CHECK(state.empty(), "gradient compression state given to a run without --compression");
}

void GradHook::set_momentum_correction(float m) {
  DT_INPUT_CHECK(m == 0.f, "momentum correction belongs to top-k compression, not --compression none");
}

namespace {

// No compression: the bucket's average by the communicator (NCCL's, or MPI's, staged for device memory).
class AllreduceHook final : public GradHook {
 public:
  explicit AllreduceHook(comm::Communicator& dp) : dp_(dp) {}
  std::string name() const override { return "allreduce"; }
  std::shared_ptr<comm::Work> run(Tensor& bucket, int, int64_t) override {
    sent_ += static_cast<int64_t>(bucket.nbytes());
    return dp_.allreduce(bucket, comm::ReduceOp::Avg);
  }
  int64_t bytes_sent() const override { return sent_; }

 private:
  comm::Communicator& dp_;
  int64_t sent_ = 0;
};

// What a hook with a compressor says of itself: the compressor's warm-up, tensor buckets and state.
class CompressorHook : public GradHook {
 public:
  explicit CompressorHook(std::unique_ptr<comm::Compressor> c) : compressor_(std::move(c)) {}
  void on_step(int64_t step, int64_t warmup_steps) override { compressor_->on_step(step, warmup_steps); }
  bool per_tensor() const override { return compressor_->per_tensor(); }
  bool compresses() const override { return true; }
  std::map<std::string, Tensor> state() const override { return compressor_->state_tensors(); }
  void load_state(const std::map<std::string, Tensor>& state) override { compressor_->load_state_tensors(state); }

 protected:
  std::unique_ptr<comm::Compressor> compressor_;
};

// One compressor over every data-parallel rank; the compressor owns the per-bucket state.
class CompressHook final : public CompressorHook {
 public:
  CompressHook(std::unique_ptr<comm::Compressor> c, comm::Communicator& dp) : CompressorHook(std::move(c)), dp_(dp) {}
  std::string name() const override { return compressor_->name(); }
  std::shared_ptr<comm::Work> run(Tensor& bucket, int index, int64_t rows) override {
    return compressor_->reduce(bucket, dp_, comm::ReduceOp::Avg, index, rows);
  }
  void set_momentum_correction(float m) override { compressor_->set_momentum_correction(m); }
  int64_t bytes_sent() const override { return compressor_->stats().bytes_sent; }

 private:
  comm::Communicator& dp_;
};

// --compression-scope inter-node: run() averages the bucket exactly over this node's ranks (from the
// grad-ready hook, overlapping backward); finish_step() then sends each bucket through the
// compressor between the ranks of this local rank on every node. Every local rank holds its node's
// average, so all of them exchange the same compressed messages in parallel.
class InterNodeHook final : public CompressorHook {
 public:
  InterNodeHook(std::unique_ptr<comm::Compressor> c, comm::NodeSplit split)
      : CompressorHook(std::move(c)), node_(std::move(split.node)), cross_(std::move(split.cross)) {}
  std::string name() const override { return compressor_->name() + " between nodes"; }
  std::shared_ptr<comm::Work> run(Tensor& bucket, int index, int64_t rows) override {
    pending_.push_back({bucket, index, rows});
    node_sent_ += static_cast<int64_t>(bucket.nbytes());
    return node_->allreduce(bucket, comm::ReduceOp::Avg);
  }
  void finish_step() override {
    std::vector<std::shared_ptr<comm::Work>> works;
    for (Pending& p : pending_)
      works.push_back(compressor_->reduce(p.bucket, *cross_, comm::ReduceOp::Avg, p.index, p.rows));
    for (auto& w : works) w->wait();
    pending_.clear();
  }
  int64_t bytes_sent() const override { return node_sent_ + compressor_->stats().bytes_sent; }

 private:
  struct Pending {
    Tensor bucket;
    int index;
    int64_t rows;
  };
  std::unique_ptr<comm::Communicator> node_, cross_;
  std::vector<Pending> pending_;
  int64_t node_sent_ = 0;
};

}  // namespace

std::unique_ptr<GradHook> make_grad_hook(const GradHookOptions& o, comm::Communicator& dp) {
  DT_INPUT_CHECK(o.compression_scope == "all" || o.compression_scope == "inter-node",
                 "option --compression-scope must be all or inter-node, got '" << o.compression_scope << "'");
  if (o.compression == "none") return std::make_unique<AllreduceHook>(dp);
  std::unique_ptr<comm::Compressor> compressor;
  try {
    compressor = comm::make_compressor(o.compression, o.seed);
  } catch (const InputError& e) {
    throw InputError(std::string("option --compression: ") + e.what());
  }
  if (o.compression_scope == "all") return std::make_unique<CompressHook>(std::move(compressor), dp);
  comm::NodeSplit split = comm::split_by_node(dp);
  DT_INPUT_CHECK(split.uniform,
                 "option --compression-scope inter-node needs as many data-parallel ranks on every "
                 "node; this job's nodes hold different counts");
  if (split.cross->size() == 1) return std::make_unique<AllreduceHook>(dp);  // one node: nothing crosses a network
  return std::make_unique<InterNodeHook>(std::move(compressor), std::move(split));
}

}  // namespace dtrain::parallel

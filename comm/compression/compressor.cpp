// The Compressor hook, the factory, and the two compressors without state (none, fp16/bf16).
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "compression/staged_work.h"
#include "dtrain/comm/compression.h"
#include "dtrain/kernels/engine.h"

namespace dtrain::comm {

Compressor::~Compressor() = default;

std::shared_ptr<Work> Compressor::reduce(Tensor& bucket, Communicator& comm, ReduceOp op, int bucket_id, int64_t rows) {
  DT_CHECK(bucket.defined() && bucket.dtype() == DType::F32,
           name() << ": a gradient bucket must be a defined f32 tensor, got "
                  << (bucket.defined() ? bucket.str() : std::string("an undefined tensor")));
  DT_CHECK(op == ReduceOp::Avg || op == ReduceOp::Sum,
           name() << ": compressed reduction supports avg and sum, not " << reduce_op_name(op));
  auto [it, fresh] = states_.try_emplace(bucket_id);
  if (fresh) it->second.id = bucket_id;
  BucketState& st = it->second;
  DT_CHECK(rows >= 0 && (rows == 0 || bucket.numel() % rows == 0),
           name() << ": " << rows << " rows do not divide a bucket of " << bucket.numel());
  st.rows = rows;
  DT_CHECK(!st.residual.defined() || st.residual.numel() == bucket.numel(),
           name() << ": bucket " << bucket_id << " changed size from " << st.residual.numel() << " to "
                  << bucket.numel() << " elements");
  int64_t before = stats_.bytes_sent;
  ++stats_.calls;
  stats_.bytes_in += static_cast<int64_t>(bucket.nbytes());
  auto w = do_reduce(bucket, comm, op, st);
  stats_.last_bytes_sent = stats_.bytes_sent - before;
  return w;
}

Tensor Compressor::residual(int bucket_id) const {
  auto it = states_.find(bucket_id);
  return it == states_.end() ? Tensor() : it->second.residual;
}

void Compressor::reset() { states_.clear(); }

void Compressor::set_momentum_correction(float m) {
  DT_INPUT_CHECK(m == 0.f, "momentum correction belongs to top-k compression, not " << name());
}

Tensor& Compressor::BucketState::on(Tensor& t, Device device) {
  if (t.defined() && t.device() != device) {
    Tensor moved = Tensor::empty(t.shape(), t.dtype(), device);
    copy_any(t, moved);
    t = moved;
  }
  return t;
}

std::map<std::string, Tensor> Compressor::state_tensors() const {
  std::map<std::string, Tensor> out;
  for (const auto& [id, st] : states_) {
    const std::string at = "bucket" + std::to_string(id) + ".";
    if (st.residual.defined()) out[at + "residual"] = host_copy(st.residual);
    if (st.factor.defined()) out[at + "factor"] = host_copy(st.factor);
    if (st.velocity.defined()) out[at + "velocity"] = host_copy(st.velocity);
    if (st.draws > 0) {
      Tensor t = Tensor::empty({1}, DType::I64);
      t.data<int64_t>()[0] = st.draws;
      out[at + "draws"] = t;
    }
  }
  return out;
}

void Compressor::load_state_tensors(const std::map<std::string, Tensor>& state) {
  std::map<int, BucketState> loaded;
  for (const auto& [key, t] : state) {
    const size_t dot = key.find('.');
    int id = -1;
    if (key.rfind("bucket", 0) == 0 && dot != std::string::npos && dot > 6) {
      char* end = nullptr;
      const long v = std::strtol(key.c_str() + 6, &end, 10);
      if (end == key.c_str() + dot && v >= 0) id = static_cast<int>(v);
    }
    DT_INPUT_CHECK(id >= 0, name() << ": '" << key << "' is not a compression state entry (bucket<id>.<field>)");
    const std::string field = key.substr(dot + 1);
    BucketState& st = loaded[id];
    st.id = id;
    if (field == "rng") continue;  // a checkpoint from before the draws' count: they restart at 0
    if (field == "draws") {
      DT_INPUT_CHECK(t.dtype() == DType::I64 && t.numel() == 1 && t.device().is_cpu() && t.data<int64_t>()[0] >= 0,
                     name() << ": " << key << " must be one non-negative i64, got " << t.str());
      st.draws = t.data<int64_t>()[0];
      continue;
    }
    DT_INPUT_CHECK(t.dtype() == DType::F32 && t.device().is_cpu(),
                   name() << ": " << key << " must be f32, got " << t.str());
    if (field == "residual")
      st.residual = t.clone();
    else if (field == "factor")
      st.factor = t.clone();
    else if (field == "velocity")
      st.velocity = t.clone();
    else
      DT_INPUT_CHECK(false, name() << ": unknown compression state field in '" << key << "'");
  }
  states_ = std::move(loaded);
}

// ---- none ------------------------------------------------------------------------------------

std::shared_ptr<Work> NoCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState&) {
  stats_.bytes_sent += static_cast<int64_t>(bucket.nbytes());
  return comm.allreduce(bucket, op);
}

// ---- fp16 / bf16 -----------------------------------------------------------------------------

HalfCastCompressor::HalfCastCompressor(DType half) : half_(half) {
  DT_CHECK(half == DType::F16 || half == DType::BF16, "HalfCastCompressor takes f16 or bf16, not " << dtype_name(half));
}

std::shared_ptr<Work> HalfCastCompressor::do_reduce(Tensor& bucket, Communicator& comm, ReduceOp op, BucketState&) {
  Engine& e = engine_for(bucket.device());
  Tensor half = Tensor::empty(bucket.shape(), half_, bucket.device());
  {
    detail::ScopedSeconds t(stats_.compress_s);
    // Avg divides before the cast, so the sum cannot overflow fp16; the bucket is rewritten anyway.
    if (op == ReduceOp::Avg) e.scale(bucket, 1.f / static_cast<float>(comm.size()));
    e.cast(bucket, half);
  }
  stats_.bytes_sent += static_cast<int64_t>(half.nbytes());
  auto w = comm.allreduce(half, ReduceOp::Sum);
  double* dec = &stats_.decompress_s;
  auto finish = [bucket, half, dec]() mutable {
    detail::ScopedSeconds t(*dec);
    engine_for(bucket.device()).cast(half, bucket);
  };
  return std::make_shared<detail::StagedWork>(name() + " " + shape_str(bucket.shape()), w,
                                              std::vector<detail::StagedWork::Stage>{}, finish);
}

// ---- factory ---------------------------------------------------------------------------------

const std::vector<std::string>& compressor_kinds() {
  static const std::vector<std::string> k = {"none", "fp16", "bf16", "topk", "powersgd", "sign", "onebit", "qsgd"};
  return k;
}

std::unique_ptr<Compressor> make_compressor(const std::string& spec, uint64_t seed) {
  std::string kind = spec, arg;
  if (auto p = spec.find(':'); p != std::string::npos) {
    kind = spec.substr(0, p);
    arg = spec.substr(p + 1);
  }
  auto number = [&](double fallback) {
    if (arg.empty()) return fallback;
    char* end = nullptr;
    double v = std::strtod(arg.c_str(), &end);
    DT_INPUT_CHECK(end && *end == '\0', "compressor '" << spec << "': '" << arg << "' is not a number");
    return v;
  };
  if (kind == "none" && arg.empty()) return std::make_unique<NoCompressor>();
  if (kind == "fp16" && arg.empty()) return std::make_unique<HalfCastCompressor>(DType::F16);
  if (kind == "bf16" && arg.empty()) return std::make_unique<HalfCastCompressor>(DType::BF16);
  // 1-bit SGD is the sign compressor (sign bits plus one scale, with error feedback).
  if ((kind == "sign" || kind == "onebit") && arg.empty()) return std::make_unique<SignCompressor>();
  if (kind == "topk") {
    double r = number(0.01);
    DT_INPUT_CHECK(r > 0 && r <= 1, "compressor '" << spec << "': the top-k ratio must be in (0, 1]");
    return std::make_unique<TopKCompressor>(r);
  }
  if (kind == "powersgd") {
    double r = number(4);
    DT_INPUT_CHECK(r >= 1 && r == std::floor(r),
                   "compressor '" << spec << "': the PowerSGD rank must be an integer >= 1");
    return std::make_unique<PowerSgdCompressor>(static_cast<int>(r), seed);
  }
  if (kind == "qsgd") {
    double s = number(16);
    DT_INPUT_CHECK(s >= 1 && s <= 127 && s == std::floor(s),
                   "compressor '" << spec << "': QSGD levels must be an integer in [1, 127]");
    return std::make_unique<QsgdCompressor>(static_cast<int>(s), seed);
  }
  DT_INPUT_CHECK(false, "unknown compressor '" << spec
                                               << "' (expected none, fp16, bf16, topk[:ratio], powersgd[:rank], sign, "
                                                  "qsgd[:levels])");
  __builtin_unreachable();
}

}  // namespace dtrain::comm

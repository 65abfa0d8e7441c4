#pragma once
// Tensor (model) parallelism in the style of Megatron-LM: a linear layer's weight is split over
// the ranks of the tp communicator. Column-parallel splits the outputs (its input is replicated;
// backward allreduces d(input): the conjugate "f" operator, identity forward / allreduce backward);
// row-parallel splits the inputs (its input is the column-parallel output; forward allreduces the
// partial products: the "g" operator, allreduce forward / identity backward). A column-parallel
// layer followed by a row-parallel one (the MLP; attention with heads split) needs one allreduce
// forward and one backward. Every layer initialises the FULL weight from the given RNG exactly as
// nn::Linear does and keeps its shard, so any tp size builds the same model as one rank.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/rng.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/layers.h"
#include "dtrain/parallel/data_parallel.h"

namespace dtrain::parallel {

// Both layers are nn::Linear over this rank's slice (its in_ x out_ are the local sizes), so they
// share its GEMMs, gradient hooks and LoRA adapters and add only the tp communication. Each places
// its parameters (nn::Placement): every tp rank's part of the full layer's tensors.
class TensorParallelLinear : public nn::Linear {
 protected:
  TensorParallelLinear(int64_t in, int64_t out, comm::Communicator& tp) : nn::Linear(in, out), tp_(tp) {}
  comm::Communicator& tp_;
};

class ColumnParallelLinear : public TensorParallelLinear {
 public:
  // Full layer in -> out. The outputs are consecutive `blocks` (q, k and v of a fused projection;
  // gate and up; empty: one block of `out`); this rank holds its 1/tp of every block, so it gets
  // its own heads of q, of k and of v. Weight, bias and LoRA's B are split by output rows; LoRA's A
  // is whole (its gradient summed over tp through the adapters' d(x A^T)).
  // Blocks are split in whole `unit`s of rows (0: any rows); a block of fewer units than tp ranks
  // (key/value heads) is one unit per rank, the ranks of `share` (tp / units of them, grouped by
  // rank / (tp / units)) holding the same unit and summing its gradient.
  ColumnParallelLinear(int64_t in, int64_t out, bool bias, Rng& rng, comm::Communicator& tp,
                       std::vector<int64_t> blocks = {}, int64_t unit = 0,
                       std::shared_ptr<comm::Communicator> share = nullptr);
  Tensor backward(const Tensor& dy) override;  // forward is nn::Linear's: (..., in) -> (..., out / tp)
  std::string kind() const override;

 protected:
  int64_t full_out() const override { return full_out_; }
  // Every block's rows of each rank, written by the first of the ranks sharing a replicated block.
  nn::Placement output_rows(const Shape& full) const override;
  void sum_lora_gradients(Tensor& dt) override;
  void share_gradient(nn::Parameter& p, bool after) override;

 private:
  struct Block {
    int64_t rows, parts;  // in the full layer; the distinct slices (tp, or fewer: replicated)
  };
  int64_t full_out_;
  std::vector<Block> blocks_;
  std::shared_ptr<comm::Communicator> share_;
  std::map<const nn::Parameter*, Tensor> set_aside_;  // share_gradient's accumulated rows
  // Rank r's slice of block k: its first row in the full layer.
  int64_t first_row(size_t k, int64_t start, int r) const;
};

class RowParallelLinear : public TensorParallelLinear {
 public:
  // Full layer in -> out; this rank holds input columns [r * in/tp, (r+1) * in/tp) of the weight
  // and of LoRA's A, and the whole bias (added once, after the allreduce, so its gradient is the
  // same on every tp rank) and LoRA's B.
  RowParallelLinear(int64_t in, int64_t out, bool bias, Rng& rng, comm::Communicator& tp);
  Tensor forward(const Tensor& x) override;  // (..., in / tp) -> (..., out), summed over tp
  std::string kind() const override;         // backward is nn::Linear's: dy is the same on every tp rank

 protected:
  int64_t full_in() const override { return full_in_; }
  nn::Placement input_columns(const Shape& full) const override;
  void sum_lora_activations(Tensor& t) override;

 private:
  int64_t full_in_;
};

// The blocks of `cfg` (GPT-2's or a Llama's) split over `tp`: attention with heads/tp query and
// kv_heads/tp key/value heads per rank (column-parallel fused qkv, row-parallel output projection)
// and the MLP as column-parallel C -> hidden (gate and up for SwiGLU), row-parallel hidden -> C.
// Norms are replicated. Pass to nn::Gpt; the embeddings and the final norm stay replicated (their
// inputs and gradients are equal on every tp rank).
nn::GptBlockFactory tensor_parallel_gpt_blocks(const nn::GptConfig& cfg, comm::Communicator& tp);

// This tp rank's rows of a vocabulary split evenly over `tp` (rank r: rows [r V/tp, (r+1) V/tp)),
// summing over `tp` (pass to nn::Gpt; the vocabulary must divide by the tp size).
nn::GptVocabShard vocab_parallel_shard(int64_t vocab, comm::Communicator& tp);

// Distillation's gradient over student logits split by vocabulary (this rank: the columns
// [offset, offset + N) of `tp`'s equal slices; one rank: the whole rows): d(T^2 mean_rows
// KL(softmax(t/T) || softmax(s/T)))/ds = T (q - p) / rows, times `scale`. The student's q over the
// whole vocabulary from the row maxima and sums of exponentials allreduced over tp; the teacher's
// whole logits on every rank, softened, and this rank's columns of them taken.
class VocabParallelSoftTargets {
 public:
  VocabParallelSoftTargets(comm::Communicator& tp, int64_t offset, float temperature);
  // student [rows, N] (this rank's columns), teacher [rows, N * tp]; the gradient is this rank's.
  // With `targets` (I32 [rows]), a row whose target is -1 (a prompt's or padding's) gets none.
  Tensor gradient(const Tensor& student, const Tensor& teacher, float scale, const Tensor* targets = nullptr);

 private:
  comm::Communicator& tp_;
  int64_t offset_;
  float t_;
  Tensor x_, rowmax_, sumexp_, target_, labels_, p_full_, p_split_, grad_;
};

// Cross-entropy over logits whose vocabulary columns are split over `tp` (this rank: columns
// [vocab_offset, vocab_offset + N)): the row maxima are max-allreduced, the sums of exponentials
// and the target logits sum-allreduced (one allreduce of 2 x rows floats), so no rank ever holds
// the full [rows, V] logits. The gradient is this rank's columns.
class VocabParallelCrossEntropy : public nn::SoftmaxCrossEntropy {
 public:
  VocabParallelCrossEntropy(comm::Communicator& tp, int64_t vocab_offset);
  float forward(const Tensor& logits, const Tensor& labels, int64_t* correct = nullptr) override;
  Tensor backward(float scale = 1.f) override;
  double last_loss_sum() const override { return loss_sum_; }
  // The loss is summed on the host (CPU engine only), so this is forward() adding its loss sum into
  // `stats`; hits stay 0 (not counted).
  void accumulate(const Tensor& logits, const Tensor& labels, Tensor& stats) override;

 private:
  comm::Communicator& tp_;
  int64_t offset_;
  Tensor logits_, labels_, rowmax_, partial_, dlogits_;  // partial_ [2, rows]: sum of exp, target logit
  double loss_sum_ = 0;
};

// Layout changes for any model whose parameters are placed over tp ranks (checkpoints are written
// in the one-rank layout, so they load into any tp size): every parameter as its full one-rank
// tensor (collective over `tp`, required when a parameter is split), and the inverse, which keeps
// this rank's parts.
std::map<std::string, Tensor> gather_full_parameters(nn::Module& model, comm::Communicator* tp = nullptr,
                                                     const std::map<std::string, Tensor>* reuse = nullptr);
void load_full_parameters(nn::Module& model, const std::map<std::string, Tensor>& full);
// The same for any tensor of a parameter's shape and layout (optimizer state): `pick` gives it,
// the maps are keyed by parameter name. Every tensor returned is a new host copy, or, for a
// parameter not split over tp ranks, written into `reuse`'s tensor of its name where that fits
// (host_copy: a checkpoint snapshot arena).
using ParameterTensor = std::function<Tensor&(nn::Parameter&)>;
using NamedTensors = std::map<std::string, Tensor>;
// trained_only: the parameters that are not frozen (their optimizer state; frozen ones have none).
std::map<std::string, Tensor> gather_full(nn::Module& model, comm::Communicator* tp, const ParameterTensor& pick,
                                          const NamedTensors* reuse = nullptr, bool trained_only = false);
void load_full(nn::Module& model, const std::map<std::string, Tensor>& full, const ParameterTensor& pick,
               bool trained_only = false);
// The one-rank shape of every parameter of `model`.
std::map<std::string, Shape> full_parameter_shapes(nn::Module& model);
// Where this rank's part (tp rank `tp_rank`) of every parameter of `model` lies in its one-rank
// tensor, by name.
std::map<std::string, nn::TpPart> tp_parts(nn::Module& model, int tp_rank);

// Global-norm clipping that counts every weight once: each rank adds the squares of the gradient
// elements it would write into a checkpoint (the rows of its tp part it `writes`, nn::tp_part, of
// its pieces where `dp` shards the gradients: DataParallel::gradient_parts), summed over `dp`'s
// shard group, `tp` and `pp`, leaving out `skip` (the last stage's copy of the tied embedding);
// then scales the gradients of `scaled` (the optimizer's parameters). Returns the norm.
double clip_grad_norm_tp(nn::Module& model, comm::Communicator& tp, double max_norm, comm::Communicator* pp,
                         const nn::Parameter* skip, DataParallel* dp, const std::vector<nn::Parameter*>& scaled);

}  // namespace dtrain::parallel

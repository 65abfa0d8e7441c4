#pragma once
// The GPT on token streams (dtrain convert text: bytes or BPE pieces): the language-model task of the one loop
// (train::Trainer with model = gpt), its evaluation, and its checkpoints for `dtrain generate`.
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/comm/communicator.h"
#include "dtrain/data/text.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/config.h"
#include "dtrain/train/step_support.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

// Trains `cfg` (model = gpt) over `world` (null: the runtime's world, initialised if need be): the
// ranks form a dp x tp x pp grid (parallel::ProcessGrid); each dp group draws its own windows, the
// tp ranks and stages of a group the same. Step s draws from a stream seeded by (seed, dp rank, s),
// so a resumed run sees the windows the uninterrupted one would have.
TrainResult train_lm(const TrainConfig& cfg, comm::Communicator* world);

// Mean cross-entropy (nats per token) of `model` over up to `max_batches` (0: all) consecutive
// non-overlapping windows of `tokens`.
double evaluate_lm(nn::Gpt& model, const std::string& val_file, int64_t batch, int64_t seq_len, int64_t max_batches);
// The same on a stream already loaded (data::load_tokens), for callers that evaluate it repeatedly.
// With a `budget` (bytes a rank may fill) a batch that would not fit is evaluated in parts (the
// same loss), and one window that cannot fit is an input error naming the bytes.
double evaluate_lm(nn::Gpt& model, const data::TokenStream& val, int64_t batch, int64_t seq_len, int64_t max_batches,
                   const MemoryBudget& budget = {});
// The windows evaluate_lm scores: every window of the stream (max_batches 0: the last batch holds
// what is left), else the first max_batches * batch of them. A prompt/completion stream's windows
// are its samples, and its loss is over their completion tokens.
int64_t scored_windows(const data::TokenStream& s, int64_t batch, int64_t seq_len, int64_t max_batches);

// Bits per byte of text of a mean loss of `nats_per_token` over the targets of the first `windows`
// consecutive windows of `seq_len` tokens of `s` (as evaluate_lm cuts them): per token for bytes,
// weighted by the bytes each target piece stands for under BPE.
double bits_per_byte(const data::TokenStream& s, double nats_per_token, int64_t windows, int64_t seq_len);

// The tokenizer a GPT checkpoint was trained with ("tokenizer", and "meta/tokenizer_model" for BPE).
data::Tokenizer tokenizer_from_checkpoint(const CheckpointState& s, const std::string& where);

// The shape of `cfg`'s language model (--model gpt or llama) over a vocabulary of `vocab` tokens.
nn::GptConfig lm_shape(const TrainConfig& cfg, int64_t vocab);
// A language model's shape in a checkpoint's attributes ("model", the int lists "gpt" and, for the
// Llama family's choices, "lm_shape" with "rope_base"), and back (InputError naming what is wrong).
void write_lm_shape(const nn::GptConfig& shape, CheckpointState& s);
nn::GptConfig read_lm_shape(const CheckpointState& s);

// The one-rank GPT of a checkpoint set (load_checkpoint_set: every stage's parameters, tp shards
// gathered): the config as the int list "gpt", parameters under "param/".
std::unique_ptr<nn::Gpt> gpt_from_checkpoint(const CheckpointState& s);

}  // namespace dtrain::train

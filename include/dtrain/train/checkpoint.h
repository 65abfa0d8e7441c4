#pragma once
// Checkpoints: one HDF5 file, data only. Written to "<name>.tmp", synced to the disk, renamed, and
// the folder synced, so neither a crash nor a power loss leaves a broken file under the final name
// or loses the rename; every HDF5 write and close is checked. A 64-bit XXH3 over every tensor and
// one over the attributes (step, rank, run id, layout) are checked on load (format
// "dtrain-checkpoint-2"; the CRC-32s of format 1 are checked in files written before it).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/nn/module.h"
#include "dtrain/parallel/data_parallel.h"
#include "dtrain/parallel/tensor_parallel.h"

namespace dtrain::comm {
class Communicator;
}
namespace dtrain::parallel {
class DataParallel;
}

namespace dtrain::train {

struct CheckpointState {
  // "param/<name>", "buffer/<name>" (BatchNorm statistics, dropout RNG states), "optim/<name>"
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> strings;             // model name, optimizer kind, ...
  std::map<std::string, int64_t> ints;                    // step, epoch, batch_in_epoch, world size, ...
  std::map<std::string, std::vector<int64_t>> int_lists;  // input shape, hidden widths
};

// What a written file is, for the manifest of its set: its size on the disk and its tensor checksum
// (the XXH3 stored in it as "tensors_xxh3").
struct SavedFile {
  int64_t bytes = 0;
  uint64_t checksum = 0;
};
SavedFile save_checkpoint(const std::string& path, const CheckpointState& s);
// Throws InputError naming the file when it is missing, not HDF5, truncated or fails its checksum.
CheckpointState load_checkpoint(const std::string& path);
// Only the tensors whose names start with `prefix`, unchecked (the checksum covers every tensor):
// for a file another rank has just verified with load_checkpoint, e.g. a shard part's ranges.
CheckpointState load_checkpoint_tensors_under(const std::string& path, const std::string& prefix);
// A checkpoint set: the main file with every pipeline stage's part merged in (a model cut into
// stages writes ckpt-stepN.h5 for stage 0 and ckpt-stepN.stage<s>.h5 for the others), and every
// rank's ZeRO shard part assembled into whole tensors (a set written under ZeRO-2/3 keeps the
// parameters and optimizer state there, "zero_shard_ranks" parts of them). Throws InputError
// naming a missing part, one of another step, or tensors the shard parts do not cover.
// assemble_shards false: the shard parts are checked against the manifest but left on the disk, for
// for_each_shard_piece (a sharded run takes its pieces from them without whole tensors).
CheckpointState load_checkpoint_set(const std::string& main_file, bool assemble_shards = true);
// The elements of every parameter a loaded checkpoint holds (`param/...`): what a model built from
// its attributes may ask for at most.
int64_t held_parameters(const CheckpointState& s);
// A file is returned as is; for a directory, its newest "ckpt-*.h5". Throws InputError naming
// `option` (the option that gave the path: "resume", "checkpoint") when there is none.
std::string resolve_checkpoint(const std::string& file_or_dir, const std::string& option = "resume");
// The same, every candidate: a file alone, or a directory's main files newest first (a resume takes
// the newest that loads and verifies).
std::vector<std::string> checkpoint_candidates(const std::string& file_or_dir, const std::string& option = "resume");
// Removes the "ckpt-step*.tmp" files a killed write left in `dir` (none is ever renamed into place
// once its writer is gone); returns their names. Call before any rank writes into `dir`.
std::vector<std::string> remove_unfinished_writes(const std::string& dir);

// The checkpoint file set, the same for every model. A checkpoint of step N is
// <dir>/ckpt-step<N, 9 digits>.h5 (the main file); beside it may stand parts that belong to it:
// <main>.rank<r> (rank r's gradient compression state), <main>.shard<r> (rank r's ZeRO shard of
// the parameters and optimizer state) and ckpt-step<N>.stage<s>.h5 (pipeline stage s's
// parameters). Parts are written before the main file, so a main file that exists has all its
// parts.
std::string checkpoint_file(const std::string& dir, int64_t step);
std::string stage_part_file(const std::string& main_file, int64_t stage);
std::string rank_part_file(const std::string& main_file, int rank);
std::string shard_part_file(const std::string& main_file, int rank);

// A ZeRO shard part's tensors: each a 1-D piece of a tensor of the one-rank layout ("param/<name>",
// "optim/<name>.<kind>"), with "range/<key>" (i64: the piece's first element in the flattened
// tensor, its element count, then the whole tensor's dimensions). Each rank of `world` writes its
// own, inside an agreement; `saved` gets its size and checksum for the manifest. Collective.
void write_shard_part(const std::string& main_file, const std::map<std::string, Tensor>& pieces,
                      comm::Communicator& world, int64_t step, int64_t run_id, SavedFile* saved);

// The manifest of a set, in its main file: one row per part (dataset "manifest/parts", int64 [P, 5]:
// kind, rank, stage, bytes, checksum) and attributes "manifest_parts" (P) and "manifest_world_size"
// (the ranks that wrote the set); the set's "run_id" and "step" are the main file's own. The main
// file is written after every part is on the disk, so the parts' sizes and checksums are known.
struct SetPart {
  enum Kind : int64_t { kStage = 1, kRank = 2, kShard = 3 };
  int64_t kind = kStage;
  int64_t rank = 0;       // the world rank that wrote it
  int64_t stage = 0;      // its pipeline stage
  int64_t bytes = 0;      // the file's size
  uint64_t checksum = 0;  // its tensor checksum (SavedFile::checksum)
  // Its file (stage_part_file or rank_part_file) and what it is ("rank 1's compression part",
  // "pipeline stage 2's part").
  std::string file(const std::string& main_file) const;
  std::string what() const;
};
// Every rank's parts (its compression part, its stage's part where it wrote one: null otherwise)
// gathered over `world` (collective; null: one rank).
std::vector<SetPart> gather_set_parts(comm::Communicator* world, int64_t stage, const SavedFile* rank_part,
                                      const SavedFile* stage_part, const SavedFile* shard_part = nullptr);
void add_manifest(CheckpointState& main, const std::vector<SetPart>& parts, int world_size);
// The parts `main` lists (none for a set written before manifests).
std::vector<SetPart> manifest_parts(const CheckpointState& main, const std::string& main_file);
// One listed part against the manifest: present, of the listed size, and its own checksum, run,
// step, rank and stage those of the set (reads its attributes only: its tensors are checked when it
// is loaded). InputError naming the part and the reason otherwise.
void check_set_part(const CheckpointState& main, const std::string& main_file, const SetPart& part);
// Every `stride`-th part from `first` (the ranks of a resume share the checks).
void check_manifest(const CheckpointState& main, const std::string& main_file, int first = 0, int stride = 1);
// Every listed part as the main file's writer sees it, before it writes the main file of a run's
// first set: InputError naming the folder and every rank whose part it cannot see (a folder on each
// node's own disk), so the fault shows at the first checkpoint, not at the first resume.
void check_parts_visible(const CheckpointState& main, const std::string& main_file);
// The shard parts of a ZeRO-2/3 set (`ranks` of them, each checked against `listed`, the manifest)
// assembled into `main`'s whole tensors; their pieces must tile each tensor exactly (checked before
// anything is allocated). load_checkpoint_set calls it.
void assemble_shard_parts(CheckpointState& main, const std::string& main_file, const std::vector<SetPart>& listed,
                          int64_t ranks);
// The files of the same parts, each checked against `listed` (attributes, not tensors).
std::vector<std::string> checked_shard_parts(const CheckpointState& main, const std::string& main_file,
                                             const std::vector<SetPart>& listed, int64_t ranks);
// Reads every `stride`-th shard part of the set from `first` (the ranks of a resume share them), so
// that their tensors pass their checksums and fit their ranges before a set is taken; nothing is
// kept (whether the pieces tile each tensor is known once all are read: for_each_shard_piece).
void verify_shard_parts(const CheckpointState& main, const std::string& main_file, int first, int stride);
// Every piece of the shard parts of the set `main_file` (`main`: its main file) that `wants`
// (null: all), one part in memory at a time: `take(key, from, values)` with key "param/<name>" or
// "optim/<name>.<kind>", `values` elements [from, from + count) of the tensor (each checked against
// its range and the tensor's shape in the others, the shape passed on). The parts' ranges are read
// first (InputError where the pieces of a tensor do not tile it, before any values), then only the
// parts holding a wanted piece, whose count it returns: a rank of a resume in the writers' layout
// reads its own part, not the whole set.
using PieceTaker = parallel::PieceTaker;
using PieceWanted = parallel::PieceWanted;
using PieceSource = parallel::PieceSource;
int for_each_shard_piece(const CheckpointState& main, const std::string& main_file, const PieceTaker& take,
                         const PieceWanted& wants = nullptr);
// The parameter a piece's key names ("param/<name>", "optim/<name>.<kind>", either under "range/"):
// "" for a key naming none (a part read from a file may hold any).
std::string piece_parameter(std::string_view key);
// Under tp: this rank's pieces (ShardedDataParallel::shard_pieces, each a range of its tp part of
// the parameter) as the runs of the one-rank tensor they hold that this rank writes (the first of
// the tp ranks holding the same elements), "runs/<key>" listing them where there are several;
// pieces left without a run are dropped. So a set written under tp is every rank's shard part too.
std::map<std::string, Tensor> pieces_in_whole_tensors(const std::map<std::string, Tensor>& pieces,
                                                      const std::map<std::string, nn::TpPart>& parts);
// The inverse for a load under tp: `source`'s pieces of the one-rank tensors passed on (to
// ShardedDataParallel::load_pieces) as the runs of this rank's parts (`parts`: tp_parts) they hold.
PieceSource pieces_in_tp_parts(const PieceSource& source, const std::map<std::string, nn::TpPart>& parts);

// Keeps the newest `keep` checkpoints up to `just_written` (the main file just written, which is
// never removed): older main files go with all their parts. Files of later steps (another line's,
// which set_aside_later_sets moves away at a resume) are left alone. Parts whose main file was never written (the job died in between)
// are removed too, when they are older than `just_written`.
void prune_checkpoints(const std::string& dir, const std::string& just_written, int keep);

// A run that resumed at `step` continues a line of sets of its own: the sets of `dir` of later steps
// (the line it went back on) are moved, every file of each, its main file first, into
// abandoned_folder(dir, run_id), so no resume, requeue or relaunch of the folder takes them and
// pruning never counts them; `--resume` that folder brings the line back. Returns the main files
// moved, oldest first (none: nothing was later). InputError naming the folder when a move fails.
std::vector<std::string> set_aside_later_sets(const std::string& dir, int64_t step, int64_t run_id);
std::string abandoned_folder(const std::string& dir, int64_t run_id);  // dir/abandoned-<run id>

// Gradient compression state beside a checkpoint: it differs between ranks (error-feedback
// residuals, PowerSGD's Q, top-k momentum, QSGD's streams), so each rank of `world` writes its own
// to rank_part_file(main_file, rank) before the main file is written, inside an agreement (a part
// one rank cannot write fails every rank). Returns whether parts were written (the main file
// records that as "compression_ranks"); nothing without `dp` or without state. Collective.
// Each part carries `run_id` (the main file's too), so a part of another run is never merged.
// `saved` (may be null) gets this rank's part's size and checksum for the manifest.
bool write_compression_parts(const std::string& main_file, const parallel::DataParallel* dp, comm::Communicator* world,
                             int64_t step, const std::string& compression, int64_t run_id = 0,
                             SavedFile* saved = nullptr);
// Whether a resume takes the compression parts of the checkpoint `main`: it kept parts of `world`
// ranks, of the same --compression, `same_layout`, and `dp` compresses. Otherwise `why_not` (may be
// null) gets the line that says why ("" when the checkpoint kept none).
bool uses_compression_parts(const CheckpointState& main, const parallel::DataParallel* dp, int world,
                            const std::string& compression, bool same_layout, std::string* why_not);
// This rank's part of the set, checked: every rank's part present, this one passing its checksums,
// of the set's step and run and of this rank, and as the manifest lists it (InputError naming the
// part otherwise).
CheckpointState load_rank_part(const CheckpointState& main, const std::string& main_file, int rank, int world);
// A part read by load_rank_part (from `part_file`) into `dp` (InputError naming the file when it does
// not fit the buckets).
void put_compression_part(const CheckpointState& part, const std::string& part_file, parallel::DataParallel* dp);
// The three in one: on resume, this rank's part goes back into `dp` when the checkpoint `main` (read from main_file)
// holds parts of `world` ranks of the same --compression and `same_layout`; otherwise error feedback
// restarts from zero and the returned line says so ("" when loaded or when there is nothing to
// say). Every rank checks every part, so a missing part fails all ranks alike (InputError).
std::string load_compression_part(const CheckpointState& main, const std::string& main_file, parallel::DataParallel* dp,
                                  int rank, int world, const std::string& compression, bool same_layout);

// The finite checks before anything is kept: a non-finite training loss (checked where the
// trainers read their losses) or non-finite weights (checked before every checkpoint) throw a
// DivergenceError naming the step, the rank and, for the weights, the first bad parameter.
void check_finite_loss(double loss, int64_t step, int rank);
void check_finite_weights(const std::vector<nn::Parameter*>& params, int64_t step, int rank);

}  // namespace dtrain::train

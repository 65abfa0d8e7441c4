// The one loop's checkpoints: the parameters, buffers and optimizer state of any dp x tp x pp
// layout in the one-rank layout, as one set of files (gathered to each stage's writer, or under
// ZeRO-2/3 every rank's pieces of the one-rank tensors in its shard part); restored into any.
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "dtrain/core/timer.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/provenance.h"
#include "dtrain/train/trainer.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

// The tensors of `snapshot` whose names start with `prefix`, by the rest of their names.
std::map<std::string, Tensor> entries_under(const std::map<std::string, Tensor>& snapshot, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (auto it = snapshot.lower_bound(prefix); it != snapshot.end() && it->first.rfind(prefix, 0) == 0; ++it)
    out[it->first.substr(prefix.size())] = it->second;
  return out;
}

const Tensor* entry(const std::map<std::string, Tensor>& snapshot, const std::string& name) {
  const auto it = snapshot.find(name);
  return it == snapshot.end() ? nullptr : &it->second;
}

// The sets a resume tries, newest first, as world rank 0 lists them: every rank tries the same ones
// in the same order (a folder that is not shared would show each node other files). Collective.
std::vector<std::string> candidates_as_rank0_lists(comm::Communicator& world, const std::string& where) {
  std::string listed;
  comm::agree_on_inputs(world, [&] {
    if (world.rank() != 0) return;
    try {
      for (const std::string& c : checkpoint_candidates(where)) listed += c + "\n";
    } catch (const fs::filesystem_error& e) {  // an error of rank 0 alone: agreed as an input error
      throw InputError("option --resume '" + where + "': " + e.what());
    }
  });
  listed = comm::broadcast_text(world, listed, 0);
  std::vector<std::string> out;
  for (size_t at = 0, end; (end = listed.find('\n', at)) != std::string::npos; at = end + 1)
    out.push_back(listed.substr(at, end - at));
  return out;
}

// Every rank read the set rank 0 read: the same run id and step under the same name (a folder on
// each node's own disk can hold another run's set there). Collective.
void check_every_rank_read_one_set(comm::Communicator& world, const CheckpointState& s, const std::string& file) {
  auto read = [&](const char* key) {  // -1 where absent (the resume's own checks name what is missing)
    const auto it = s.ints.find(key);
    return it == s.ints.end() ? int64_t{-1} : it->second;
  };
  const int64_t my_run = read("run_id"), my_step = read("step");
  comm::agree_on_inputs(world, [&] {
    Tensor zero = Tensor::empty({2}, DType::I64);
    zero.data<int64_t>()[0] = my_run;
    zero.data<int64_t>()[1] = my_step;
    if (world.size() > 1) world.broadcast(zero, 0)->wait();
    const int64_t run = zero.data<int64_t>()[0], step = zero.data<int64_t>()[1];
    DT_INPUT_CHECK(run == my_run && step == my_step,
                   "rank " << world.rank() << " reads another set at '" << file << "' (run " << my_run << ", step "
                           << my_step << ") than rank 0 (run " << run << ", step " << step
                           << "): the checkpoint folder is not one folder that every rank shares");
  });
}

}  // namespace

// The optimizer's state per parameter ("<param>.<kind>") in the one-rank layout, as host copies
// (into `reuse`'s tensors where they fit): ZeRO-1 slices gathered over dp, then tp shards over tp
// (collectives). Without ZeRO-1 the live state is copied once, by gather_full.
std::map<std::string, Tensor> Trainer::optimizer_state_full(const std::map<std::string, Tensor>& reuse) {
  std::map<std::string, Tensor> local;
  if (dp_ && dp_->zero_stage() > 0)
    local = dp_->gather_state(opt_->state());
  else
    for (const optim::StateTensor& st : opt_->state()) local[st.name] = *st.value;
  std::map<std::string, Tensor> out;
  for (const std::string& kind : state_kinds()) {
    auto pick = [&](nn::Parameter& p) -> Tensor& { return local.at(p.name + kind); };
    std::map<std::string, Tensor> old;
    for (nn::Parameter* p : task_->model().parameters())
      if (const Tensor* t = entry(reuse, p->name + kind)) old[p->name] = *t;
    for (auto& [name, t] : parallel::gather_full(task_->model(), &grid_->tp(), pick, &old, true))  // frozen: none
      out[name + kind] = t;
  }
  return out;
}

// The kinds of state the optimizer keeps per parameter (".momentum"; ".exp_avg", ".exp_avg_sq").
std::vector<std::string> Trainer::state_kinds() {
  std::vector<std::string> kinds;
  if (opt_->params().empty()) return kinds;
  const std::string first = opt_->params().front()->name + ".";
  for (const optim::StateTensor& st : opt_->state())
    if (st.name.rfind(first, 0) == 0) kinds.push_back(st.name.substr(first.size() - 1));
  return kinds;
}

// The inverse: this rank's tp shard of every parameter's state, then its ZeRO-1 part of that.
void Trainer::load_optimizer_state(CheckpointState& s) {
  nn::Module& model = task_->model();
  std::map<std::string, Tensor> local;
  for (const std::string& kind : state_kinds()) {
    std::map<std::string, Tensor> full;
    for (nn::Parameter* p : model.parameters()) {
      if (p->frozen) continue;  // no state
      auto it = s.tensors.find("optim/" + p->name + kind);
      DT_INPUT_CHECK(it != s.tensors.end(), "it has no optimizer state " << p->name + kind);
      full[p->name] = it->second;
      local[p->name + kind] = Tensor::zeros(p->value.shape());
    }
    parallel::load_full(
        model, full, [&](nn::Parameter& p) -> Tensor& { return local.at(p.name + kind); }, true);
  }
  if (dp_)
    dp_->load_state(local, opt_->state());
  else
    optim::load_state_by_name(local, opt_->state());
}

// The state of step_ in the one-rank layout (collective: tp and ZeRO-1 gathers), every tensor a
// copy on the host: a background write's snapshot while the loop goes on changing the state.
// Copied into the tensors of `reuse` (the previous snapshot) where they fit, so that the loop's
// stall is the copy alone, not allocation and first-touch page faults.
CheckpointState Trainer::checkpoint_state(int64_t epoch, int64_t batch_in_epoch,
                                          const std::map<std::string, Tensor>& reuse) {
  nn::Module& model = task_->model();
  CheckpointState s;
  if (writes_shards()) {
    s.ints["zero_shard_ranks"] = world_.size();  // the parameters and optimizer state: in the shard parts
  } else {
    const std::map<std::string, Tensor> old_params = entries_under(reuse, "param/");
    for (auto& [name, t] : parallel::gather_full_parameters(model, &grid_->tp(), &old_params))
      s.tensors["param/" + name] = t;
    for (auto& [name, t] : optimizer_state_full(entries_under(reuse, "optim/"))) s.tensors["optim/" + name] = t;
  }
  for (nn::Buffer* b : model.buffers())
    s.tensors["buffer/" + b->name] = host_copy(b->value, entry(reuse, "buffer/" + b->name));
  if (pruner_)
    for (auto& [name, m] : pruner_->masks()) s.tensors["mask/" + name] = host_copy(m, entry(reuse, "mask/" + name));
  task_->write_fields(s);
  s.strings["provenance"] = to_json(provenance_);
  s.strings["optimizer"] = opt_->kind();
  s.strings["compression"] = cfg_.compression;
  s.ints["step"] = step_;
  s.ints["optimizer_steps"] = opt_->steps();  // lags the run's by the steps fp16 skipped
  s.ints["epoch"] = epoch;
  s.ints["batch_in_epoch"] = batch_in_epoch;
  s.ints["world_size"] = grid_->dp_size();
  s.ints["per_rank_batch"] = batch_;
  s.ints["accumulate"] = cfg_.accumulate;
  s.ints["seed"] = static_cast<int64_t>(cfg_.seed);
  s.ints["pp_stage"] = grid_->pp_rank();
  s.ints["pp_stages"] = cfg_.pp;
  s.ints["tp"] = cfg_.tp;
  s.ints["dp"] = grid_->dp_size();
  s.ints["run_id"] = run_id_;  // every part of the set carries it: a part of another run is never merged
  if (!parent_set_.empty()) s.strings["parent"] = parent_set_;
  if (scaler_) {
    s.tensors["meta/loss_scale"] = Tensor::from({1}, {scaler_->scale()});
    s.ints["loss_scale_good_steps"] = scaler_->good_steps();
    s.ints["loss_scale_skipped_steps"] = scaler_->skipped_steps();
  }
  return s;
}

// This rank's pieces for its shard part, without those of a second copy of a parameter (the tied
// embedding's on the last pipeline stage: the first stage's pieces are the same numbers). Under tp
// they are written as runs of the one-rank tensors, each element by one tp rank.
std::map<std::string, Tensor> Trainer::own_pieces() const {
  std::map<std::string, Tensor> pieces = dp_->shard_pieces(opt_->state());
  if (const nn::Parameter* copy = task_->duplicate())
    std::erase_if(pieces, [&](const auto& entry) { return piece_parameter(entry.first) == copy->name; });
  if (cfg_.tp == 1) return pieces;
  return pieces_in_whole_tensors(pieces, parallel::tp_parts(task_->model(), grid_->tp_rank()));
}

// A checkpoint of step_ (collective). Each rank's gradient compression state first; then rank 0 of
// each stage (dp 0, tp 0) writes its part, the other stages first, so stage 0's file, written last,
// says the whole set is there. The agreements double as the barriers that keep every rank behind a
// checkpoint that may fail. With --checkpoint-async (one stage) the loop stalls only while the
// state is gathered and copied; the file is written by a thread and agreed on at the next
// checkpoint or the end, so until then the previous checkpoint stays the newest loadable one.
void Trainer::save(int64_t epoch, int64_t batch_in_epoch, bool wait) {
  if (cfg_.checkpoint_dir.empty()) return;
  const double t0 = now_s();  // the stall counts a wait for the previous background write
  finish_pending_checkpoint();
  CheckpointState s = checkpoint_state(epoch, batch_in_epoch, std::exchange(snapshot_arena_, {}));
  const std::string file = checkpoint_file(cfg_.checkpoint_dir, step_);
  bool parts = false;
  SavedFile rank_part, shard_part;
  {
    CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
    parts = write_compression_parts(file, dp_.get(), &world_, step_, cfg_.compression, run_id_, &rank_part);
    // ZeRO-2/3: each rank writes its own pieces; no rank gathers the model.
    if (writes_shards()) write_shard_part(file, own_pieces(), world_, step_, run_id_, &shard_part);
  }
  s.ints["compression_ranks"] = parts ? world_.size() : 0;  // ranks with a <checkpoint>.rank<r> part
  write_checkpoint_set(file, s, parts ? &rank_part : nullptr, writes_shards() ? &shard_part : nullptr,
                       wait || !cfg_.checkpoint_async || cfg_.pp > 1);
  const double stall = now_s() - t0;
  result_.checkpoint_stall_s += stall;
  if (pending_) {
    pending_->stall_s = stall;
    return;
  }
  result_.checkpoint = file;
  if (!progress_->bar()) say("checkpoint " + file + " (" + fixed(stall, 3) + " s)");
  say_if_slow(file, stall);
}

// A write that took more than half the communication timeout would have ended the job under it.
void Trainer::say_if_slow(const std::string& file, double seconds) {
  const double comm_timeout = world_.timeout();
  if (comm_timeout > 0 && seconds > comm_timeout / 2)
    say("checkpoint " + file + " took " + fixed(seconds, 1) + " s, over half the communication timeout (" +
        fixed(comm_timeout, 0) + " s): the ranks waited under --checkpoint-timeout (" +
        fixed(cfg_.checkpoint_timeout, 0) + " s); a slow file system?");
}

// While the ranks wait for a checkpoint's writers, the world's waits take --checkpoint-timeout
// instead of the communication timeout: a busy parallel file system is not a lost rank.
Trainer::CheckpointWaits::CheckpointWaits(comm::Communicator& world, double timeout_s)
    : world_(world), before_(world.timeout()) {
  world.set_timeout(timeout_s);
}
Trainer::CheckpointWaits::~CheckpointWaits() { world_.set_timeout(before_); }

// Every part is on the disk (written, synced, renamed) before the main file lists it in its manifest
// and is written itself; the older sets are pruned only after that, so until the new set is durable
// the previous one stays whole, also under --keep-checkpoints 1.
void Trainer::write_checkpoint_set(const std::string& file, CheckpointState& s, const SavedFile* rank_part,
                                   const SavedFile* shard_part, bool wait) {
  const bool writer = grid_->dp_rank() == 0 && grid_->tp_rank() == 0, first = grid_->pp_rank() == 0;
  const bool first_set = result_.checkpoint.empty();  // of this run: whether every part is in sight is checked
  {
    CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
    SavedFile stage_part;
    if (wait)  // (a background write has one stage)
      comm::agree_on_inputs(world_, [&] {
        if (writer && !first) stage_part = save_checkpoint(stage_part_file(file, grid_->pp_rank()), s);
      });
    const bool staged = wait && writer && !first;
    add_manifest(s, gather_set_parts(&world_, grid_->pp_rank(), rank_part, staged ? &stage_part : nullptr, shard_part),
                 world_.size());
  }
  if (wait) {
    CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
    comm::agree_on_inputs(world_, [&] {
      if (!writer || !first) return;
      if (first_set) check_parts_visible(s, file);
      save_checkpoint(file, s);
      prune_checkpoints(cfg_.checkpoint_dir, file, cfg_.keep_checkpoints);
    });
    return;
  }
  pending_ = std::make_unique<PendingCheckpoint>();
  pending_->file = file;
  pending_->snapshot = std::move(s);
  if (!writer) return;
  PendingCheckpoint* p = pending_.get();
  p->writer = std::thread([this, p, file, first_set] {
    const double t0 = now_s();
    try {
      if (first_set) check_parts_visible(p->snapshot, file);
      save_checkpoint(file, p->snapshot);
      prune_checkpoints(cfg_.checkpoint_dir, file, cfg_.keep_checkpoints);
    } catch (...) {
      p->error = std::current_exception();
    }
    p->write_s = now_s() - t0;
  });
}

void Trainer::finish_pending_checkpoint() {
  if (!pending_) return;
  std::unique_ptr<PendingCheckpoint> p = std::move(pending_);
  CheckpointWaits waits(world_, cfg_.checkpoint_timeout);
  comm::agree_on_inputs(world_, [&] {
    if (p->writer.joinable()) p->writer.join();
    if (p->error) std::rethrow_exception(p->error);
  });
  snapshot_arena_ = std::move(p->snapshot.tensors);  // the next snapshot is copied into these
  result_.checkpoint = p->file;
  if (!progress_->bar())
    say("checkpoint " + p->file + " (" + fixed(p->stall_s, 3) + " s; written in the background in " +
        fixed(p->write_s, 3) + " s)");
  say_if_slow(p->file, p->write_s);
}

// Whether the checkpoint `s` was written in this run's tp x pp layout (its compression parts fit).
bool Trainer::same_layout(CheckpointState& s) const {
  return s.ints["tp"] == cfg_.tp && s.ints["pp_stages"] == cfg_.pp;
}

// The set of `file` read whole and checked: the main file, every part its manifest lists (present,
// of its size, checksum, run, step, rank and stage), every stage's part and, where this run takes
// them, every rank's compression part present and this rank's (kept in `part`) of the same step and
// run, each passing its checksums. Collective: the ranks agree, so all take the same set or skip it.
CheckpointState Trainer::load_verified_set(const std::string& file, CheckpointState& part) {
  CheckpointState s;
  comm::agree_on_inputs(world_, [&] {
    s = load_checkpoint_set(file, !reads_shards());  // shard parts: read piece by piece when they load
    check_manifest(s, file, rank_, world_.size());   // every part listed, the checks shared among the ranks
    if (reads_shards()) verify_shard_parts(s, file, rank_, world_.size());  // their tensors and ranges, shared
    part = uses_compression_parts(s, dp_.get(), world_.size(), cfg_.compression, same_layout(s), nullptr)
               ? load_rank_part(s, file, rank_, world_.size())
               : CheckpointState{};
  });
  return s;
}

// The parameters, buffers and optimizer state of `s` (the set `file`): under ZeRO-2/3 this rank's
// pieces straight from the shard parts, one part in memory at a time (under tp the runs of its
// parts of the one-rank tensors); else whole tensors (ZeRO-3's units gathered while they load), of
// which each rank keeps its tp shard.
void Trainer::load_model_state(CheckpointState& s, const std::string& file) {
  nn::Module& model = task_->model();
  const bool pieces = reads_shards() && s.ints.count("zero_shard_ranks") && s.ints.at("zero_shard_ranks") > 0;
  {
    parallel::WholeModel whole(pieces ? nullptr : dp_.get());
    if (pieces) {
      PieceSource source = [&](const PieceTaker& take, const PieceWanted& wants) {
        for_each_shard_piece(s, file, take, wants);
      };
      dp_->load_pieces(
          cfg_.tp > 1 ? pieces_in_tp_parts(source, parallel::tp_parts(model, grid_->tp_rank())) : source,
          opt_->state());
    } else {
      std::map<std::string, Tensor> params;
      for (auto& [name, t] : s.tensors)
        if (name.rfind("param/", 0) == 0) params[name.substr(6)] = t;
      parallel::load_full_parameters(model, params);
      load_optimizer_state(s);
    }
  }
  for (nn::Buffer* b : model.buffers()) {
    auto it = s.tensors.find("buffer/" + b->name);
    DT_INPUT_CHECK(
        it != s.tensors.end() && it->second.numel() == b->value.numel() && it->second.dtype() == b->value.dtype(),
        "it has no buffer " << b->name << " of " << b->value.str());
    copy_any(it->second.reshape(b->value.shape()), b->value);
  }
}

// Every rank reads the checkpoint set (any dp x tp x pp layout wrote it) and keeps its part. From a
// folder it takes the newest set that is complete and verifies, naming each newer one it skipped.
ResumePoint Trainer::restore(const std::string& where) {
  std::string file;
  CheckpointState s, part;  // part: this rank's compression part, where the run takes them
  std::vector<std::string> skipped;
  for (const std::string& candidate : candidates_as_rank0_lists(world_, where)) {
    try {
      s = load_verified_set(candidate, part);
      file = candidate;
      break;
    } catch (const InputError& e) {
      skipped.push_back(candidate + ": " + e.what());
    }
  }
  if (file.empty()) {
    std::string why;
    for (const std::string& line : skipped) why += "\n  " + line;
    DT_INPUT_CHECK(false, "option --resume " << where << ": no checkpoint set there is complete and verifies:" << why);
  }
  for (const std::string& line : skipped) say("resume: skipped " + line);
  check_every_rank_read_one_set(world_, s, file);
  ResumePoint at;
  std::string compression_note, changed;
  try {
    task_->check_checkpoint(s);
    DT_INPUT_CHECK(s.strings["optimizer"] == opt_->kind(),
                   "it used optimizer " << s.strings["optimizer"] << ", not --optimizer " << opt_->kind());
    load_model_state(s, file);
    if (pruner_) {  // a checkpoint from before the pruning started has none: the masks stay ones
      std::map<std::string, Tensor> masks;
      for (auto& [name, t] : s.tensors)
        if (name.rfind("mask/", 0) == 0) masks[name.substr(5)] = t;
      if (!masks.empty()) pruner_->load_masks(masks);
    }
    if (const auto scale = s.tensors.find("meta/loss_scale"); scaler_ && scale != s.tensors.end()) {
      DT_INPUT_CHECK(scale->second.numel() == 1 && scale->second.dtype() == DType::F32,
                     "its loss scale is " << scale->second.str() << ", not one f32");
      scaler_->set_state(scale->second.f32()[0], s.ints["loss_scale_good_steps"], s.ints["loss_scale_skipped_steps"]);
    }
    DT_INPUT_CHECK(s.ints.count("step"), "it has no step attribute");
    step_ = s.ints["step"];
    opt_->set_steps(s.ints.count("optimizer_steps") ? s.ints["optimizer_steps"] : step_);
    if (uses_compression_parts(s, dp_.get(), world_.size(), cfg_.compression, same_layout(s), &compression_note))
      put_compression_part(part, rank_part_file(file, rank_), dp_.get());
    at = task_->resume_point(s, step_);
    parent_set_ = fs::path(file).filename().string() + " run " + std::to_string(s.ints["run_id"]);
    changed = resume_changes(s.strings["provenance"], config_ini(cfg_));
  } catch (const InputError& e) {
    DT_INPUT_CHECK(false, "option --resume " << file << ": " << e.what());
  }
  for (const std::string& line : {changed, compression_note, at.note})
    if (!line.empty()) say(line);
  say("resumed from " + file + " at step " + std::to_string(step_) +
      (has_epochs_ ? " (epoch " + std::to_string(at.epoch + 1) + ")" : std::string()));
  return at;
}

// The folder is this run's alone (checkpoint_owner.h); what a killed write left behind is removed
// before anyone writes there again. Collective.
void Trainer::take_checkpoint_folder() {
  if (cfg_.checkpoint_dir.empty()) return;
  comm::agree_on_inputs(world_, [&] {
    if (rank_ != 0) return;
    owner_ = std::make_unique<FolderOwner>(cfg_.checkpoint_dir, run_id_);
    if (!owner_->note().empty()) say(owner_->note());
    const std::vector<std::string> removed = remove_unfinished_writes(cfg_.checkpoint_dir);
    std::string names;
    for (const std::string& n : removed) names += (names.empty() ? "" : ", ") + n;
    if (!removed.empty())
      say("removed " + std::to_string(removed.size()) + " unfinished checkpoint file(s) of a killed write in " +
          cfg_.checkpoint_dir + ": " + names);
  });
}

// Once every rank has read its set: sets of --checkpoint-dir after the resumed step belong to the
// line this run went back on (a user resuming before a loss spike), and would win the next resume.
// A resume from a folder took its newest set that verifies: a newer one it skipped may have failed
// for a passing reason (a slow read), and stays for the next resume to try.
void Trainer::set_aside_later_line() {
  if (cfg_.checkpoint_dir.empty() || fs::is_directory(cfg_.resume)) return;
  std::vector<std::string> moved;
  comm::agree_on_inputs(world_, [&] {
    if (rank_ == 0) moved = set_aside_later_sets(cfg_.checkpoint_dir, step_, run_id_);
  });
  if (moved.empty()) return;
  std::string names;
  for (const std::string& m : moved) names += (names.empty() ? "" : ", ") + m;
  say("resumed behind " + std::to_string(moved.size()) + " later checkpoint set(s) of another line in " +
      cfg_.checkpoint_dir + ": moved to " + abandoned_folder(cfg_.checkpoint_dir, run_id_) + " (" + names +
      "); --resume that folder to go back to them");
}

}  // namespace dtrain::train

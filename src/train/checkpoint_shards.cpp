// The ZeRO shard parts of a checkpoint set (checkpoint.h): each rank's pieces written beside the
// main file, and assembled into the one-rank layout's whole tensors on load.
#include <algorithm>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/error.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain::train {

namespace {

// One tensor's pieces from the shard parts: `count` elements from `from` of the tensor, at
// `offset` of a piece's values (a piece written from a rank's tp part holds several runs).
struct ShardPiece {
  int64_t from, count, offset;
  const Tensor* values;  // null where only the parts' ranges were read
  int part;              // the shard part holding it
};
using PiecesByTensor = std::map<std::string, std::pair<Shape, std::vector<ShardPiece>>>;

// The piece `key` of part `part` (file `f`) by its range ("range/<key>": first element, count, the
// tensor's shape) and, where it holds several runs of the tensor, "runs/<key>" (first element and
// count of each, in the order of the values) into `tensors`, checked: within the tensor, as large as
// `values` where given, the tensor's shape the same in every part.
void add_piece(const std::string& key, const Tensor* range, const Tensor* runs, const Tensor* values, int part,
               const std::string& f, PiecesByTensor& tensors) {
  DT_INPUT_CHECK(range && range->dtype() == DType::I64 && range->numel() >= 2 && range->numel() <= 10,
                 f << ": piece " << key << " has no range");
  const int64_t* r64 = range->data<int64_t>();
  const Shape shape(r64 + 2, r64 + range->numel());
  const int64_t whole = shape_numel(shape, f + ": " + key);
  DT_INPUT_CHECK(r64[1] >= 0 && (!values || (r64[1] == values->numel() && values->dtype() == DType::F32)),
                 f << ": piece " << key << (values ? " of " + values->str() : std::string()) << " does not hold the "
                   << r64[1] << " elements of its range");
  DT_INPUT_CHECK(!runs || (runs->dtype() == DType::I64 && runs->numel() % 2 == 0 && runs->numel() > 0),
                 f << ": piece " << key << " has runs " << runs->str() << ", not pairs of first element and count");
  auto& [have, pieces] = tensors[key];
  if (pieces.empty()) have = shape;
  DT_INPUT_CHECK(have == shape,
                 f << ": " << key << " is " << shape_str(shape) << " here, " << shape_str(have) << " in another part");
  const int64_t n = runs ? runs->numel() / 2 : 1;
  const int64_t* pairs = runs ? runs->data<int64_t>() : r64;
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t from = pairs[2 * i], count = pairs[2 * i + 1];
    DT_INPUT_CHECK(from >= 0 && count >= 0 && from <= whole - count && offset <= r64[1] - count,
                   f << ": piece " << key << " does not fit its range [" << from << ", +" << count << ") of "
                     << shape_str(shape) << (runs ? " (run " + std::to_string(i) + ")" : std::string()));
    pieces.push_back({from, count, offset, values, part});
    offset += count;
  }
  DT_INPUT_CHECK(offset == r64[1],
                 f << ": piece " << key << "'s runs hold " << offset << " elements, its range " << r64[1]);
}

const Tensor* find_tensor(const CheckpointState& state, const std::string& key) {
  const auto it = state.tensors.find(key);
  return it == state.tensors.end() ? nullptr : &it->second;
}

// The pieces of part `part` (file `f`, read whole) by tensor, each fitting its range.
void collect_pieces(const CheckpointState& state, int part, const std::string& f, PiecesByTensor& tensors) {
  for (const auto& [key, piece] : state.tensors) {
    if (key.starts_with("range/") || key.starts_with("runs/")) continue;
    add_piece(key, find_tensor(state, "range/" + key), find_tensor(state, "runs/" + key), &piece, part, f, tensors);
  }
}

// The same from the part's ranges and runs alone (load_checkpoint_tensors_under "range/", "runs/").
void collect_ranges(const CheckpointState& ranges, const CheckpointState& runs, int part, const std::string& f,
                    PiecesByTensor& tensors) {
  for (const auto& [key, range] : ranges.tensors)
    add_piece(key.substr(6), &range, find_tensor(runs, "runs/" + key.substr(6)), nullptr, part, f, tensors);
}

// The pieces of each tensor tile it exactly: none left out, none repeated.
void check_tiling(PiecesByTensor& tensors, const std::string& main_file) {
  for (auto& [key, entry] : tensors) {
    auto& [shape, pieces] = entry;
    std::sort(pieces.begin(), pieces.end(), [](const ShardPiece& a, const ShardPiece& b) { return a.from < b.from; });
    int64_t next = 0;
    for (const ShardPiece& p : pieces) {
      DT_INPUT_CHECK(p.from == next, "checkpoint " << main_file << ": the shard parts' pieces of " << key
                                                   << " leave out or repeat elements from " << std::min(next, p.from));
      next += p.count;
    }
    DT_INPUT_CHECK(next == shape_numel(shape), "checkpoint " << main_file << ": the shard parts hold " << next
                                                             << " elements of " << key << ", which has "
                                                             << shape_numel(shape));
  }
}

}  // namespace

std::vector<std::string> checked_shard_parts(const CheckpointState& s, const std::string& main_file,
                                             const std::vector<SetPart>& listed, int64_t ranks) {
  DT_INPUT_CHECK(ranks < (1 << 20), "checkpoint " << main_file << " says " << ranks << " ranks wrote shards");
  std::vector<std::string> files;
  for (int r = 0; r < ranks; ++r) {
    const std::string f = shard_part_file(main_file, r);
    bool in_manifest = false;
    for (const SetPart& p : listed)
      if (p.kind == SetPart::kShard && p.rank == r) {
        check_set_part(s, main_file, p);
        in_manifest = true;
      }
    DT_INPUT_CHECK(in_manifest, "checkpoint " << main_file << " keeps its parameters in " << ranks
                                              << " shard parts, but its manifest lists no " << f);
    files.push_back(f);
  }
  return files;
}

// The shard parts of a ZeRO-2/3 set assembled into the whole tensors of the one-rank layout. The
// pieces of each tensor must tile it exactly (checked before anything is allocated, so a forged
// shape cannot ask for more than the parts hold).
void assemble_shard_parts(CheckpointState& s, const std::string& main_file, const std::vector<SetPart>& listed,
                          int64_t ranks) {
  std::vector<CheckpointState> parts;
  PiecesByTensor tensors;
  for (const std::string& f : checked_shard_parts(s, main_file, listed, ranks)) parts.push_back(load_checkpoint(f));
  for (size_t r = 0; r < parts.size(); ++r)
    collect_pieces(parts[r], static_cast<int>(r), shard_part_file(main_file, static_cast<int>(r)), tensors);
  check_tiling(tensors, main_file);
  for (auto& [key, entry] : tensors) {
    auto& [shape, pieces] = entry;
    Tensor t = Tensor::empty(shape, DType::F32);
    for (const ShardPiece& p : pieces)
      std::copy(p.values->f32() + p.offset, p.values->f32() + p.offset + p.count, t.f32() + p.from);
    s.tensors[key] = t;
  }
}

void verify_shard_parts(const CheckpointState& s, const std::string& main_file, int first, int stride) {
  const auto ranks = s.ints.find("zero_shard_ranks");
  if (ranks == s.ints.end()) return;
  for (int64_t r = first; r < ranks->second; r += stride) {
    const std::string f = shard_part_file(main_file, static_cast<int>(r));
    PiecesByTensor pieces;
    collect_pieces(load_checkpoint(f), static_cast<int>(r), f, pieces);  // every piece fits its range
  }
}

int for_each_shard_piece(const CheckpointState& s, const std::string& main_file, const PieceTaker& take,
                         const PieceWanted& wants) {
  const auto ranks = s.ints.find("zero_shard_ranks");
  if (ranks == s.ints.end() || ranks->second <= 0) return 0;
  const std::vector<std::string> files = checked_shard_parts(s, main_file, manifest_parts(s, main_file), ranks->second);
  PiecesByTensor ranges;
  for (size_t r = 0; r < files.size(); ++r)
    collect_ranges(load_checkpoint_tensors_under(files[r], "range/"), load_checkpoint_tensors_under(files[r], "runs/"),
                   static_cast<int>(r), files[r], ranges);
  check_tiling(ranges, main_file);
  std::vector<int64_t> listed(files.size(), 0);  // pieces per part, by the ranges
  std::vector<bool> needed(files.size(), !wants);
  for (const auto& [key, entry] : ranges)
    for (const ShardPiece& p : entry.second) {
      ++listed[static_cast<size_t>(p.part)];
      if (!needed[static_cast<size_t>(p.part)])
        needed[static_cast<size_t>(p.part)] = wants(key, p.from, p.count, entry.first);
    }
  int read = 0;
  for (size_t r = 0; r < files.size(); ++r) {
    if (!needed[r]) continue;
    const CheckpointState part = load_checkpoint(files[r]);
    PiecesByTensor pieces;
    collect_pieces(part, static_cast<int>(r), files[r], pieces);  // each piece against its range
    int64_t count = 0;
    for (const auto& [key, entry] : pieces) count += static_cast<int64_t>(entry.second.size());
    DT_INPUT_CHECK(count == listed[r], files[r] << " holds " << count << " pieces, its ranges " << listed[r]);
    for (const auto& [key, entry] : pieces)
      for (const ShardPiece& p : entry.second)
        take(key, p.from, entry.first, p.values->reshape({p.values->numel()}).slice0(p.offset, p.offset + p.count));
    ++read;
  }
  return read;
}

std::string piece_parameter(std::string_view key) {
  if (key.starts_with("range/")) key.remove_prefix(6);
  if (key.starts_with("param/")) return std::string(key.substr(6));
  if (!key.starts_with("optim/") || key.rfind('.') == std::string_view::npos) return {};
  return std::string(key.substr(6, key.rfind('.') - 6));
}

std::map<std::string, Tensor> pieces_in_whole_tensors(const std::map<std::string, Tensor>& pieces,
                                                      const std::map<std::string, nn::TpPart>& parts) {
  std::map<std::string, Tensor> out;
  for (const auto& [key, values] : pieces) {
    if (key.starts_with("range/")) continue;
    const nn::TpPart& part = parts.at(piece_parameter(key));
    const int64_t* range = pieces.at("range/" + key).data<int64_t>();
    const std::vector<nn::ElementRun> runs = nn::whole_runs(part, range[0], range[1], true);
    if (runs.empty()) continue;  // another tp rank writes these elements
    int64_t total = 0;
    for (const nn::ElementRun& r : runs) total += r.count;
    Tensor written = Tensor::empty({total}), pairs = Tensor::empty({2 * static_cast<int64_t>(runs.size())}, DType::I64);
    int64_t at = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      std::copy_n(values.f32() + runs[i].local - range[0], runs[i].count, written.f32() + at);
      pairs.data<int64_t>()[2 * i] = runs[i].whole;
      pairs.data<int64_t>()[2 * i + 1] = runs[i].count;
      at += runs[i].count;
    }
    Tensor& whole_range = out["range/" + key] =
        Tensor::empty({2 + static_cast<int64_t>(part.whole.size())}, DType::I64);
    whole_range.data<int64_t>()[0] = runs[0].whole;
    whole_range.data<int64_t>()[1] = total;
    std::copy(part.whole.begin(), part.whole.end(), whole_range.data<int64_t>() + 2);
    out[key] = written;
    if (runs.size() > 1) out["runs/" + key] = pairs;
  }
  return out;
}

PieceSource pieces_in_tp_parts(const PieceSource& source, const std::map<std::string, nn::TpPart>& parts) {
  return [source, &parts](const PieceTaker& take, const PieceWanted& wants) {
    // The part of the piece's parameter, its whole shape checked.
    auto part_of = [&](const std::string& key, const Shape& shape) -> const nn::TpPart* {
      const auto it = parts.find(piece_parameter(key));
      if (it == parts.end()) return nullptr;  // not of this rank's model (or no piece): passed on as it is
      DT_INPUT_CHECK(shape == it->second.whole,
                     key << " is " << shape_str(shape) << ", this model's " << shape_str(it->second.whole));
      return &it->second;
    };
    const PieceWanted wants_whole = [&](const std::string& key, int64_t from, int64_t count, const Shape& shape) {
      const nn::TpPart* part = part_of(key, shape);
      if (!part) return !wants || wants(key, from, count, shape);
      for (const nn::ElementRun& r : nn::part_runs(*part, from, count))
        if (!wants || wants(key, r.local, r.count, part->local)) return true;
      return false;
    };
    const PieceTaker take_whole = [&](const std::string& key, int64_t from, const Shape& shape, const Tensor& values) {
      const nn::TpPart* part = part_of(key, shape);
      if (!part) return take(key, from, shape, values);
      for (const nn::ElementRun& r : nn::part_runs(*part, from, values.numel()))
        take(key, r.local, part->local, values.slice0(r.whole - from, r.whole - from + r.count));
    };
    source(take_whole, wants_whole);
  };
}

void write_shard_part(const std::string& main_file, const std::map<std::string, Tensor>& pieces,
                      comm::Communicator& world, int64_t step, int64_t run_id, SavedFile* saved) {
  comm::agree_on_inputs(world, [&] {
    CheckpointState part;
    part.tensors = pieces;
    part.ints["step"] = step;
    part.ints["rank"] = world.rank();
    part.ints["world_size"] = world.size();
    part.ints["run_id"] = run_id;
    const SavedFile written = save_checkpoint(shard_part_file(main_file, world.rank()), part);
    if (saved) *saved = written;
  });
}

}  // namespace dtrain::train

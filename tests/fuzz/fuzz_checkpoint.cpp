// Fuzz target: the checkpoint reader, as a resume reads a checkpoint set: the main file
// ckpt-step000000007.h5, pipeline stage s's file ckpt-step000000007.stage<s>.h5 and rank r's gradient
// compression part ckpt-step000000007.h5.rank<r>. fuzz_checkpoint: the input's first part is the main
// file, a part tagged "stage<s>" or "rank<r>" that file. fuzz_checkpoint_h5: the input is a recipe of
// the set: each file a checkpoint state (tensors of any dtype and shape, strings, ints, lists) that
// save_checkpoint writes, so its checksum holds, then edited through HDF5's writer (fuzz_h5.h).
// resolve_checkpoint must find the main file in the directory and load_checkpoint_set read the set;
// when the main file says it kept compression parts, rank 0's part goes through load_compression_part
// into rank 0 of a two-rank DataParallel (local_dp.h) with the compression the file names, which then
// runs a step on the loaded state, as a resumed run's first step does.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/train/checkpoint.h"
#include "fuzz_util.h"
#include "local_dp.h"
#ifdef DTRAIN_FUZZ_H5_RECIPE
#include "dtrain/data/hdf5_util.h"
#include "fuzz_h5.h"
#endif

using namespace dtrain;

namespace {

// The compressions with per-rank state; a file naming another one is loaded into a top-k run
// (load_compression_part then says that the compression changed). A fresh run per input, so that
// every input is reproduced alone.
std::unique_ptr<fuzz::LocalDataParallel> run_for(const std::string& kept) {
  static const char* const known[] = {"topk:0.5", "powersgd:1", "qsgd:4", "onebit"};
  std::string c = "topk:0.5";
  for (const char* k : known)
    if (kept == k) c = k;
  return std::make_unique<fuzz::LocalDataParallel>(c);
}

// "stage3" -> 3 for prefix "stage"; -1 when the tag is not prefix + a number in [0, limit).
[[maybe_unused]] int tag_number(const std::string& tag, const std::string& prefix, int limit) {
  if (tag.size() <= prefix.size() || tag.size() > prefix.size() + 2 || tag.rfind(prefix, 0) != 0) return -1;
  int n = 0;
  for (size_t i = prefix.size(); i < tag.size(); ++i) {
    if (tag[i] < '0' || tag[i] > '9') return -1;
    n = n * 10 + (tag[i] - '0');
  }
  return n < limit ? n : -1;
}

#ifdef DTRAIN_FUZZ_H5_RECIPE
const fuzz::H5Vocabulary kVocabulary{
    {{"param/1.weight", H5T_IEEE_F32LE, 2},
     {"compress/bucket0.factor", H5T_IEEE_F32LE, 1},
     {"compress/bucket0.draws", H5T_STD_I64LE, 1},
     {"manifest/parts", H5T_STD_I64LE, 2},
     {"range/param/1.weight", H5T_STD_I64LE, 1}},
    {{"format", H5T_C_S1, 0},
     {"checksum", H5T_STD_I64LE, 1},
     {"tensors_xxh3", H5T_STD_I64LE, 1},
     {"attributes_xxh3", H5T_STD_I64LE, 1},
     {"manifest_parts", H5T_STD_I64LE, 1},
     {"manifest_world_size", H5T_STD_I64LE, 1},
     {"step", H5T_STD_I64LE, 1},
     {"pp_stages", H5T_STD_I64LE, 1},
     {"compression_ranks", H5T_STD_I64LE, 1},
     {"zero_shard_ranks", H5T_STD_I64LE, 1},
     {"compression", H5T_C_S1, 0},
     {"rank", H5T_STD_I64LE, 1},
     {"list:input_shape", H5T_STD_I64LE, 1},
     {"dtype", H5T_C_S1, 0}},
    {"dtrain-checkpoint-1", "dtrain-checkpoint-2", "f32", "bf16", "f16", "i32", "i64", "u8", "f64", "topk:0.5", "powersgd:1", "qsgd:4"}};

// What the files of one set agree on most of the time, so that a recipe reaches the checks behind
// the first ones (the stages' step, the compression parts' rank and step, their tensors' sizes).
struct SetPlan {
  int64_t step;
  std::string compression;
  int stages, ranks;
  int shards;  // ZeRO shard parts
};

int64_t any_int(FuzzedDataProvider& in) {
  return in.ConsumeBool() ? in.PickValueInArray<int64_t>({0, 1, 2, 3, 7, -1, INT64_MAX, INT64_MIN})
                          : in.ConsumeIntegral<int64_t>();
}

// A checkpoint state drawn from `in`: what save_checkpoint writes for any model and layout. `part`
// is "main", "stage" or "rank<r>".
train::CheckpointState state_recipe(FuzzedDataProvider& in, const SetPlan& plan, const std::string& part) {
  static const std::vector<std::string> tensors = {"param/1.weight",
                                                   "param/1.bias",
                                                   "param/wte",
                                                   "buffer/2.rng",
                                                   "compress/bucket0.residual",
                                                   "compress/bucket0.factor",
                                                   "compress/bucket1.factor",
                                                   "compress/bucket2.factor",
                                                   "compress/bucket3.factor",
                                                   "compress/bucket0.velocity",
                                                   "compress/bucket0.draws",
                                                   "compress/bucket1.draws",
                                                   "compress/bucket4.residual",
                                                   "compress/bucket0.bogus",
                                                   "compress/bucket-1.residual",
                                                   "compress/bucketx.residual"};
  static const std::vector<std::string> ints = {"step",       "pp_stages", "compression_ranks", "rank",
                                                "world_size", "stage",     "zero_shard_ranks"};
  train::CheckpointState s;
  for (int n = in.ConsumeIntegralInRange(0, 6); n > 0; --n) {
    const std::string name = tensors[in.ConsumeIntegralInRange<size_t>(0, tensors.size() - 1)];
    const DType dtype = in.ConsumeIntegralInRange(0, 3) != 0
                            ? DType::F32
                            : in.PickValueInArray({DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8});
    Shape shape;
    if (in.ConsumeBool())
      shape = {in.ConsumeIntegralInRange(0, 64)};
    else
      for (int r = in.ConsumeIntegralInRange(0, 3); r > 0; --r) shape.push_back(in.ConsumeIntegralInRange(0, 6));
    Tensor t = Tensor::zeros(shape, dtype);
    const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(t.nbytes());
    if (!bytes.empty()) std::memcpy(t.raw(), bytes.data(), bytes.size());
    s.tensors[name] = t;
  }
  const bool follow = in.ConsumeIntegralInRange(0, 7) != 0;  // most files follow the plan
  if (follow) {
    s.ints["step"] = plan.step;
    if (part == "main") {
      if (plan.stages > 0) s.ints["pp_stages"] = plan.stages + 1;
      s.ints["compression_ranks"] = plan.ranks;
      s.strings["compression"] = plan.compression;
      if (plan.shards > 0) s.ints["zero_shard_ranks"] = plan.shards;
    } else if (part.rfind("rank", 0) == 0) {
      s.ints["rank"] = std::stoi(part.substr(4));
      s.strings["compression"] = plan.compression;
    }
  }
  for (int n = in.ConsumeIntegralInRange(0, follow ? 2 : 6); n > 0; --n)
    s.ints[ints[in.ConsumeIntegralInRange<size_t>(0, ints.size() - 1)]] = any_int(in);
  if (in.ConsumeIntegralInRange(0, 7) == 0)
    s.strings[in.PickValueInArray({"model", "compression"})] = in.ConsumeRandomLengthString(16);
  if (in.ConsumeBool()) s.int_lists["input_shape"] = {in.ConsumeIntegral<int8_t>(), 2, 2};
  return s;
}

// Rank r's ZeRO shard part: pieces of "param/1.weight" ([4, 3]) and of others, whose ranges mostly
// tile the tensor over the plan's parts (rank r: elements [6r, 6r + 6) of 2 parts), sometimes not;
// some of them as runs of the tensor ("runs/<key>": the halves swapped, or any numbers).
train::CheckpointState shard_recipe(FuzzedDataProvider& in, const SetPlan& plan, int r) {
  train::CheckpointState s;
  s.ints["step"] = plan.step;
  s.ints["rank"] = in.ConsumeIntegralInRange(0, 7) != 0 ? r : static_cast<int>(any_int(in));
  for (int n = in.ConsumeIntegralInRange(0, 3); n > 0; --n) {
    const std::string key = in.PickValueInArray<std::string>({"param/1.weight", "optim/1.weight.exp_avg", "param/wte"});
    const bool follow = in.ConsumeIntegralInRange(0, 3) != 0;
    const int64_t from = follow ? 6 * r : any_int(in), count = follow ? 6 : in.ConsumeIntegralInRange<int64_t>(0, 16);
    const DType dtype = in.ConsumeIntegralInRange(0, 7) != 0 ? DType::F32 : DType::I32;
    Tensor piece = Tensor::zeros({std::clamp<int64_t>(count + (follow ? 0 : in.ConsumeIntegralInRange(-1, 1)), 0, 16)},
                                 dtype);
    const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(piece.nbytes());
    if (!bytes.empty()) std::memcpy(piece.raw(), bytes.data(), bytes.size());
    std::vector<int64_t> range = {from, count, 4, 3};
    if (!follow)
      for (size_t d = 2; d < range.size(); ++d) range[d] = in.ConsumeBool() ? any_int(in) : range[d];
    range.resize(in.ConsumeIntegralInRange(0, 7) != 0 ? range.size() : in.ConsumeIntegralInRange<size_t>(0, 12), 2);
    Tensor r64 = Tensor::empty({static_cast<int64_t>(range.size())}, DType::I64);
    std::copy(range.begin(), range.end(), r64.data<int64_t>());
    s.tensors[key] = piece;
    if (in.ConsumeIntegralInRange(0, 7) != 0) s.tensors["range/" + key] = r64;
    if (in.ConsumeIntegralInRange(0, 3) == 0) {  // the piece as runs of the tensor: its halves swapped, or any
      const int64_t n = in.ConsumeIntegralInRange(0, 3);
      Tensor runs = Tensor::empty({2 * n + (in.ConsumeIntegralInRange(0, 7) == 0)}, DType::I64);
      for (int64_t i = 0; i < runs.numel(); ++i) runs.data<int64_t>()[i] = any_int(in);
      if (follow && n == 2) {
        const int64_t halves[] = {from + count / 2, count - count / 2, from, count / 2};
        std::copy(std::begin(halves), std::end(halves), runs.data<int64_t>());
      }
      s.tensors["runs/" + key] = runs;
    }
  }
  return s;
}

// One file of the set: a state saved with its checksum, then up to three HDF5 edits.
void write_part(FuzzedDataProvider& in, const SetPlan& plan, const std::string& part, const std::string& path) {
  train::save_checkpoint(path, state_recipe(in, plan, part));
  auto lock = data::h5::lock();
  data::h5::Handle file = data::h5::file(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  if (!file.valid()) fuzz::fail("cannot reopen " + path);
  fuzz::add_h5_objects(in, file.get(), kVocabulary, in.ConsumeIntegralInRange(0, 3), false);
}
#endif

// A sharded resume's reader (ranges first, then the parts holding a wanted piece) on a set whose
// shard parts `assembled` took: where it accepts the set too it hands over the assembly's numbers
// (it may refuse more: a range without its piece, which the assembly passes over).
void check_pieces_reader(const train::CheckpointState& assembled, const std::string& main_file) {
  const auto ranks = assembled.ints.find("zero_shard_ranks");
  if (ranks == assembled.ints.end() || ranks->second <= 0) return;
  const train::CheckpointState main = train::load_checkpoint_set(main_file, false);
  const train::PieceTaker compare = [&](const std::string& key, int64_t from, const Shape&, const Tensor& values) {
    const auto whole = assembled.tensors.find(key);
    if (whole == assembled.tensors.end() || whole->second.numel() < from + values.numel() ||
        std::memcmp(whole->second.f32() + from, values.f32(), values.nbytes()) != 0)
      fuzz::fail("for_each_shard_piece handed over a piece of " + key + " the assembly does not hold");
  };
  const train::PieceWanted even = [](const std::string&, int64_t from, int64_t, const Shape&) { return from % 2 == 0; };
  try {
    train::for_each_shard_piece(main, main_file, compare, even);
    train::for_each_shard_piece(main, main_file, compare);
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::fs::path dir = fuzz::fresh_scratch() / "ckpt";
  const std::string main_file = train::checkpoint_file(dir.string(), 7);
#ifdef DTRAIN_FUZZ_H5_RECIPE
  FuzzedDataProvider in(data, size);
  SetPlan plan;
  plan.step = in.ConsumeBool() ? 7 : any_int(in);
  plan.compression = in.PickValueInArray<std::string>({"topk:0.5", "powersgd:1", "qsgd:4", "onebit", "fp16"});
  plan.stages = in.ConsumeIntegralInRange(0, 2);
  plan.ranks = in.PickValueInArray({0, 2, 2, 1, 3});
  plan.shards = in.PickValueInArray({0, 0, 2, 1});
  // The shard parts first, so that the main file's manifest may list them as written.
  std::vector<train::SetPart> listed;
  for (int r = 0; r < plan.shards; ++r) {
    const train::SavedFile saved = train::save_checkpoint(train::shard_part_file(main_file, r), shard_recipe(in, plan, r));
    if (in.ConsumeIntegralInRange(0, 7) != 0) listed.push_back({train::SetPart::kShard, r, 0, saved.bytes, saved.checksum});
  }
  {
    train::CheckpointState main = state_recipe(in, plan, "main");
    if (!listed.empty() && in.ConsumeIntegralInRange(0, 3) != 0) train::add_manifest(main, listed, plan.shards);
    train::save_checkpoint(main_file, main);
    auto lock = data::h5::lock();
    data::h5::Handle file = data::h5::file(H5Fopen(main_file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!file.valid()) fuzz::fail("cannot reopen " + main_file);
    fuzz::add_h5_objects(in, file.get(), kVocabulary, in.ConsumeIntegralInRange(0, 3), false);
  }
  for (int s = 1; s <= plan.stages; ++s) write_part(in, plan, "stage", train::stage_part_file(main_file, s));
  for (int r = 0; r < std::min(plan.ranks, 2); ++r)
    write_part(in, plan, "rank" + std::to_string(r), train::rank_part_file(main_file, r));
#else
  const std::vector<fuzz::Part> parts = fuzz::split_parts(data, size);
  fuzz::write_file(main_file, parts[0].bytes);
  for (size_t i = 1; i < parts.size(); ++i) {
    if (const int s = tag_number(parts[i].tag, "stage", 8); s >= 1)
      fuzz::write_file(train::stage_part_file(main_file, s), parts[i].bytes);
    else if (const int r = tag_number(parts[i].tag, "rank", 4); r >= 0)
      fuzz::write_file(train::rank_part_file(main_file, r), parts[i].bytes);
    else if (const int z = tag_number(parts[i].tag, "shard", 4); z >= 0)
      fuzz::write_file(train::shard_part_file(main_file, z), parts[i].bytes);
    else
      return -1;  // a part of no known role
  }
#endif
  try {
    if (train::resolve_checkpoint(dir.string()) != main_file) fuzz::fail("resolve_checkpoint missed the main file");
    train::CheckpointState s = train::load_checkpoint_set(main_file);
    check_pieces_reader(s, main_file);
    const auto kept = s.strings.find("compression");
    const auto ranks = s.ints.find("compression_ranks");
    if (ranks != s.ints.end() && ranks->second != 0) {
      auto run = run_for(kept == s.strings.end() ? "" : kept->second);
      const std::string note = train::load_compression_part(s, main_file, run->dp.get(), 0, 2, run->compression, true);
      if (note.empty())
        run->step();
      else
        fuzz::rejected(std::runtime_error(note));
    }
  } catch (const InputError& e) {
    fuzz::rejected(e);
  }
  fuzz::expect_no_open_hdf5_objects("load_checkpoint_set");
  return 0;
}

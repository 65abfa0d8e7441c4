#include "dtrain/train/checkpoint.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>
#include <xxhash.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/env.h"
#include "dtrain/core/error.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/kernels/engine.h"
#include "dtrain/parallel/data_parallel.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

hid_t h5_type(DType t) {
  switch (t) {
    case DType::F32:
      return H5T_NATIVE_FLOAT;
    case DType::I32:
      return H5T_NATIVE_INT32;
    case DType::I64:
      return H5T_NATIVE_INT64;
    case DType::U8:
      return H5T_NATIVE_UINT8;
    case DType::BF16:
    case DType::F16:
      return H5T_NATIVE_UINT16;  // raw 16-bit words; the dtype is kept in an attribute
  }
  return H5T_NATIVE_FLOAT;
}

std::string attr_string(hid_t obj, const char* name) {
  std::string v;
  return data::h5::read_attr_string(obj, name, v) ? v : std::string();
}

std::vector<int64_t> attr_i64s(hid_t obj, const char* name) {
  std::vector<int64_t> v;
  return data::h5::read_attr_i64(obj, name, v) ? v : std::vector<int64_t>();
}

// The checksums of a file: XXH3-64 (xxHash) in format 2; zlib's CRC-32 in the files of format 1,
// still read. Both take a size_t length, so tensors of 4 GiB and more are covered whole.
class Xxh3 {
 public:
  Xxh3() : state_(XXH3_createState()) {
    DT_CHECK(state_ && XXH3_64bits_reset(state_) == XXH_OK, "cannot set up an XXH3 checksum");
  }
  ~Xxh3() { XXH3_freeState(state_); }
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void add(const void* p, size_t n) {
    if (n) XXH3_64bits_update(state_, p, n);
  }
  uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

class Crc32 {
 public:
  void add(const void* p, size_t n) {  // (zlib restarts at a null pointer: nothing of no bytes is added)
    if (n) crc_ = crc32_z(crc_, static_cast<const Bytef*>(p), n);
  }
  uint64_t digest() const { return static_cast<uint32_t>(crc_); }

 private:
  uLong crc_ = crc32(0L, Z_NULL, 0);
};

constexpr const char* kFormat = "dtrain-checkpoint-2";   // XXH3-64 checksums
constexpr const char* kFormat1 = "dtrain-checkpoint-1";  // CRC-32 checksums

template <class Hash>
uint64_t tensors_digest(const std::map<std::string, Tensor>& tensors) {
  Hash h;
  for (const auto& [name, t] : tensors) {  // std::map: sorted, so the order is the same on load
    h.add(name.data(), name.size());
    h.add(t.raw(), t.nbytes());
  }
  return h.digest();
}

// The checksums and the format tag themselves are the only attributes not covered.
bool covered(const std::string& attribute) {
  for (const char* k : {"format", "checksum", "attributes_checksum", "tensors_xxh3", "attributes_xxh3"})
    if (attribute == k) return false;
  return true;
}

// The attributes that say what a file is (step, rank, run, layout, manifest, ...), covered by a
// checksum of their own: a flipped bit there would otherwise load as another step or another rank's
// part.
template <class Hash>
uint64_t attributes_digest(const CheckpointState& s) {
  Hash h;
  for (const auto& [k, v] : s.strings)
    if (covered(k)) {
      h.add(k.data(), k.size());
      h.add(v.data(), v.size());
    }
  for (const auto& [k, v] : s.ints)
    if (covered(k)) {
      h.add(k.data(), k.size());
      h.add(&v, sizeof v);
    }
  for (const auto& [k, v] : s.int_lists)
    if (!v.empty()) {  // an empty list's attribute may not come back at all
      h.add(k.data(), k.size());
      h.add(v.data(), v.size() * sizeof(int64_t));
    }
  return h.digest();
}

// The DTRAIN_TEST_KILL_CHECKPOINT hook ("before:NAME", "during:NAME"): the process writing the
// checkpoint file NAME kills itself with SIGKILL, as kill -9 would, before creating it or with its
// temporary file half written.
void kill_if_asked(const std::string& path, const char* when) {
  const std::string hook = env::get("DTRAIN_TEST_KILL_CHECKPOINT");
  if (!hook.empty() && hook == std::string(when) + ":" + fs::path(path).filename().string()) std::raise(SIGKILL);
}

// A file's or a folder's contents on the disk, not only in the page cache, before anything relies
// on them (the rename that makes a checkpoint the newest, the pruning of the one before).
void sync_to_disk(const std::string& path, bool folder) {
  const int fd = ::open(path.c_str(), (folder ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  DT_INPUT_CHECK(fd >= 0, "cannot open '" << path << "' to sync it to disk: " << std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  DT_INPUT_CHECK(rc == 0, "fsync of '" << path << "' failed: " << std::strerror(err));
}

}  // namespace

namespace {
// One tensor into `file` as dataset `name`, in slabs of rows of about 4 MiB, the HDF5 lock taken per
// call: a background write never holds the loader threads' reads for a whole checkpoint.
void write_dataset(hid_t file, hid_t lcpl, const std::string& name, const Tensor& t, const std::string& where) {
  using data::h5::Handle;
  constexpr int64_t kSlabBytes = int64_t(4) << 20;
  std::vector<hsize_t> dims;
  for (int64_t d : t.shape()) dims.push_back(static_cast<hsize_t>(d));
  if (dims.empty()) dims.push_back(1);
  Handle ds, space;
  {
    auto lock = data::h5::lock();
    space = Handle(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    ds = Handle(H5Dcreate2(file, name.c_str(), h5_type(t.dtype()), space.get(), lcpl, H5P_DEFAULT, H5P_DEFAULT),
                H5Dclose);
    DT_INPUT_CHECK(ds.valid() && data::h5::write_attr_string(ds.get(), "dtype", dtype_name(t.dtype())),
                   "cannot create dataset " << name << " in '" << where << "' (disk full?)");
  }
  const int64_t rows = static_cast<int64_t>(dims[0]);
  const int64_t row_bytes = rows ? static_cast<int64_t>(t.nbytes()) / rows : 0;
  const int64_t slab = row_bytes ? std::max<int64_t>(1, kSlabBytes / row_bytes) : rows;
  for (int64_t r = 0; r < rows && t.nbytes(); r += slab) {
    const int64_t k = std::min(slab, rows - r);
    std::vector<hsize_t> start(dims.size(), 0), count = dims;
    start[0] = static_cast<hsize_t>(r);
    count[0] = static_cast<hsize_t>(k);
    auto lock = data::h5::lock();
    Handle mem(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose);
    const bool ok =
        H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) >= 0 &&
        H5Dwrite(ds.get(), h5_type(t.dtype()), mem.get(), space.get(), H5P_DEFAULT,
                 static_cast<const char*>(t.raw()) + r * row_bytes) >= 0;
    DT_INPUT_CHECK(ok, "cannot write dataset " << name << " to '" << where << "' (disk full?)");
  }
  auto lock = data::h5::lock();
  space.reset();
  DT_INPUT_CHECK(H5Dclose(ds.release()) >= 0, "cannot write dataset " << name << " to '" << where << "' (disk full?)");
}
}  // namespace

SavedFile save_checkpoint(const std::string& path, const CheckpointState& s) {
  using data::h5::Handle;
  fs::path final_path(path);
  const fs::path folder = final_path.has_parent_path() ? final_path.parent_path() : fs::path(".");
  fs::create_directories(folder);
  std::string tmp = path + ".tmp";
  kill_if_asked(path, "before");
  SavedFile saved;
  {
    Handle file, lcpl;
    {
      auto lock = data::h5::lock();  // HDF5 is not thread-safe and loader threads read shards
      file = Handle(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
      DT_INPUT_CHECK(file.valid(), "cannot create checkpoint file '" << tmp << "'");
      lcpl = Handle(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
      H5Pset_create_intermediate_group(lcpl.get(), 1);
    }
    for (const auto& [name, t] : s.tensors) {
      DT_CHECK(t.device().is_cpu(), "checkpoint tensors must be on the host, " << name << " is " << t.str());
      write_dataset(file.get(), lcpl.get(), name, t, tmp);
    }
    kill_if_asked(path, "during");                     // the tensors are in the temporary file, its attributes are not
    saved.checksum = tensors_digest<Xxh3>(s.tensors);  // outside the lock
    const uint64_t attributes = attributes_digest<Xxh3>(s);
    auto lock = data::h5::lock();
    bool attrs = true;
    for (const auto& [k, v] : s.strings)  // (a loaded state's "format" is written once, below)
      attrs = attrs && (!covered(k) || data::h5::write_attr_string(file.get(), k.c_str(), v));
    for (const auto& [k, v] : s.ints)
      attrs = attrs && (!covered(k) || data::h5::write_attr_i64(file.get(), k.c_str(), {v}));
    for (const auto& [k, v] : s.int_lists)  // an empty list is written where HDF5 can, and is not required
      attrs = (data::h5::write_attr_i64(file.get(), ("list:" + k).c_str(), v) || v.empty()) && attrs;
    // The 64-bit checksums kept as int64 attributes of the same bits.
    attrs = attrs && data::h5::write_attr_i64(file.get(), "tensors_xxh3", {static_cast<int64_t>(saved.checksum)}) &&
            data::h5::write_attr_i64(file.get(), "attributes_xxh3", {static_cast<int64_t>(attributes)}) &&
            data::h5::write_attr_string(file.get(), "format", kFormat);
    DT_INPUT_CHECK(attrs, "cannot write the attributes of '" << tmp << "' (disk full?)");
    lcpl.reset();
    DT_INPUT_CHECK(H5Fclose(file.release()) >= 0, "cannot close '" << tmp << "' (disk full?)");
  }
  sync_to_disk(tmp, false);
  saved.bytes = static_cast<int64_t>(fs::file_size(tmp));
  // Test hook: a pause with the file complete but not yet in place (a crash here must leave the
  // previous checkpoint the newest loadable one).
  if (const long ms = env::get_long("DTRAIN_TEST_CHECKPOINT_RENAME_DELAY_MS"); ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  fs::rename(tmp, final_path);          // atomic on one file system: the old checkpoint stays until this
  sync_to_disk(folder.string(), true);  // the rename itself on the disk
  return saved;
}

namespace {

// Every dataset of `file` (checkpoint `path`), by its name without the leading "/".
// The file's tensors whose names start with `prefix`.
std::map<std::string, Tensor> read_tensors(hid_t file, const std::string& path, const std::string& prefix = "") {
  std::vector<std::string> names;
  H5Ovisit2(
      file, H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->push_back(name);
        return 0;
      },
      &names, H5O_INFO_BASIC);
  std::map<std::string, Tensor> tensors;
  for (const std::string& name : names) {
    if (!(name.starts_with(prefix) || name.starts_with("/" + prefix))) continue;
    data::h5::Handle ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
    DT_INPUT_CHECK(ds.valid(), "checkpoint '" << path << "': dataset " << name << " cannot be opened (corrupt file?)");
    const std::string dt = attr_string(ds.get(), "dtype");
    DType dtype = DType::F32;
    try {
      if (!dt.empty()) dtype = dtype_from_name(dt);
    } catch (const InputError& e) {
      DT_INPUT_CHECK(false, "checkpoint '" << path << "': dataset " << name << ": " << e.what());
    }
    // Its size checked against the file before the tensor is allocated.
    const Shape shape = data::h5::read_shape(ds.get(), static_cast<int64_t>(dtype_size(dtype)), path, name);
    Tensor t = Tensor::empty(shape, dtype);
    DT_INPUT_CHECK(t.nbytes() == 0 || H5Dread(ds.get(), h5_type(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()) >= 0,
                   "checkpoint '" << path << "': dataset " << name << " cannot be read (corrupt file?)");
    tensors["/" == name.substr(0, 1) ? name.substr(1) : name] = t;
  }
  return tensors;
}

// The attributes of `file` into `s`: strings, ints, lists ("list:<name>"); the checksums are not
// kept.
void read_attributes(hid_t file, CheckpointState& s) {
  H5Aiterate2(
      file, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t loc, const char* name, const H5A_info_t*, void* data) -> herr_t {
        auto* s = static_cast<CheckpointState*>(data);
        data::h5::Handle attr(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
        data::h5::Handle type(H5Aget_type(attr.get()), H5Tclose);
        const std::string n = name;
        if (H5Tget_class(type.get()) == H5T_STRING) {
          s->strings[n] = attr_string(loc, name);
        } else if (n.rfind("list:", 0) == 0) {
          s->int_lists[n.substr(5)] = attr_i64s(loc, name);
        } else if (covered(n)) {
          auto v = attr_i64s(loc, name);
          if (!v.empty()) s->ints[n] = v[0];
        }
        return 0;
      },
      &s);
}

// The file's stored checksums against what was read: XXH3-64 in format 2, CRC-32 in format 1 (whose
// files written before the attributes had a checksum of their own have none to check).
template <class Hash>
void check_checksums(hid_t file, const std::string& path, const CheckpointState& s, const char* tensors_attr,
                     const char* attributes_attr, bool attributes_required) {
  const auto sum = attr_i64s(file, tensors_attr);
  DT_INPUT_CHECK(sum.size() == 1 && static_cast<uint64_t>(sum[0]) == tensors_digest<Hash>(s.tensors),
                 "checkpoint '" << path << "' fails its checksum: the file is corrupt");
  const auto attributes = attr_i64s(file, attributes_attr);
  if (attributes.empty() && !attributes_required) return;
  DT_INPUT_CHECK(attributes.size() == 1 && static_cast<uint64_t>(attributes[0]) == attributes_digest<Hash>(s),
                 "checkpoint '" << path << "' fails the checksum of its attributes: the file is corrupt");
}

// An HDF5 checkpoint file opened for reading, its format checked; returns whether it is format 1.
data::h5::Handle open_checkpoint(const std::string& path, bool& format1) {
  DT_INPUT_CHECK(fs::exists(path), "checkpoint '" << path << "' does not exist");
  DT_INPUT_CHECK(H5Fis_hdf5(path.c_str()) > 0,
                 "checkpoint '" << path << "' is not a readable HDF5 file (truncated or corrupt?)");
  data::h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  DT_INPUT_CHECK(file.get() >= 0, "checkpoint '" << path << "' cannot be opened");
  const std::string format = attr_string(file.get(), "format");
  DT_INPUT_CHECK(format == kFormat || format == kFormat1,
                 "'" << path << "' is not a dtrain checkpoint ("
                     << (format.empty() ? std::string("no format attribute") : "format '" + format + "'") << ")");
  format1 = format == kFormat1;
  return file;
}

}  // namespace

CheckpointState load_checkpoint(const std::string& path) {
  auto lock = data::h5::lock();  // HDF5 is not thread-safe; loader threads read shards
  bool format1 = false;
  data::h5::Handle file = open_checkpoint(path, format1);
  CheckpointState s;
  s.tensors = read_tensors(file.get(), path);
  read_attributes(file.get(), s);
  if (format1)
    check_checksums<Crc32>(file.get(), path, s, "checksum", "attributes_checksum", false);
  else
    check_checksums<Xxh3>(file.get(), path, s, "tensors_xxh3", "attributes_xxh3", true);
  return s;
}

CheckpointState load_checkpoint_tensors_under(const std::string& path, const std::string& prefix) {
  auto lock = data::h5::lock();
  bool format1 = false;
  data::h5::Handle file = open_checkpoint(path, format1);
  CheckpointState s;
  s.tensors = read_tensors(file.get(), path, prefix);
  return s;
}

int64_t held_parameters(const CheckpointState& s) {
  int64_t held = 0;
  for (const auto& [name, t] : s.tensors)
    if (name.starts_with("param/")) held += t.numel();
  return held;
}

CheckpointState load_checkpoint_set(const std::string& main_file, bool assemble_shards) {
  CheckpointState s = load_checkpoint(main_file);
  auto it = s.ints.find("pp_stages");
  const int64_t stages = it == s.ints.end() ? 1 : it->second;
  const std::vector<SetPart> listed = manifest_parts(s, main_file);
  for (int64_t st = 1; st < stages; ++st) {
    const std::string f = stage_part_file(main_file, st);
    for (const SetPart& p : listed)
      if (p.kind == SetPart::kStage && p.stage == st) check_set_part(s, main_file, p);
    DT_INPUT_CHECK(fs::exists(f), "checkpoint " << main_file << " is stage 0 of " << stages << " pipeline stages, but "
                                                << f << " (stage " << st << ") is missing");
    CheckpointState part = load_checkpoint(f);
    DT_INPUT_CHECK(part.ints["step"] == s.ints["step"],
                   f << " is from step " << part.ints["step"] << ", " << main_file << " from step " << s.ints["step"]);
    DT_INPUT_CHECK(part.ints["run_id"] == s.ints["run_id"],
                   f << " was written by another run than " << main_file << " (run ids differ)");
    for (auto& [name, t] : part.tensors) s.tensors.emplace(name, t);  // a tied weight's copy: stage 0's
  }
  const auto shards = s.ints.find("zero_shard_ranks");
  if (shards != s.ints.end() && shards->second > 0) {
    if (assemble_shards)
      assemble_shard_parts(s, main_file, listed, shards->second);
    else
      checked_shard_parts(s, main_file, listed, shards->second);
  }
  return s;
}

std::string SetPart::file(const std::string& main_file) const {
  if (kind == kShard) return shard_part_file(main_file, static_cast<int>(rank));
  return kind == kStage ? stage_part_file(main_file, stage) : rank_part_file(main_file, static_cast<int>(rank));
}

std::string SetPart::what() const {
  if (kind == kShard) return "rank " + std::to_string(rank) + "'s ZeRO shard part";
  return kind == kStage ? "pipeline stage " + std::to_string(stage) + "'s part"
                        : "rank " + std::to_string(rank) + "'s compression part";
}

std::vector<SetPart> gather_set_parts(comm::Communicator* world, int64_t stage, const SavedFile* rank_part,
                                      const SavedFile* stage_part, const SavedFile* shard_part) {
  // Per rank: its compression part's bytes (-1: none) and checksum, its stage part's likewise, its
  // stage, its shard part's bytes and checksum.
  constexpr int64_t kRow = 7;
  Tensor mine = Tensor::empty({kRow}, DType::I64);
  int64_t* m = mine.data<int64_t>();
  m[0] = rank_part ? rank_part->bytes : -1;
  m[1] = rank_part ? static_cast<int64_t>(rank_part->checksum) : 0;
  m[2] = stage_part ? stage_part->bytes : -1;
  m[3] = stage_part ? static_cast<int64_t>(stage_part->checksum) : 0;
  m[4] = stage;
  m[5] = shard_part ? shard_part->bytes : -1;
  m[6] = shard_part ? static_cast<int64_t>(shard_part->checksum) : 0;
  const int n = world ? world->size() : 1;
  Tensor all = mine;
  if (n > 1) {
    all = Tensor::empty({kRow * n}, DType::I64);
    world->allgather(mine, all)->wait();
  }
  std::vector<SetPart> parts;
  for (const int64_t kind : {SetPart::kStage, SetPart::kRank, SetPart::kShard})
    for (int r = 0; r < n; ++r) {
      const int64_t* a = all.data<int64_t>() + kRow * r +
                         (kind == SetPart::kStage   ? 2
                          : kind == SetPart::kShard ? 5
                                                    : 0);
      if (a[0] >= 0) parts.push_back({kind, r, all.data<int64_t>()[kRow * r + 4], a[0], static_cast<uint64_t>(a[1])});
    }
  return parts;
}

void add_manifest(CheckpointState& main, const std::vector<SetPart>& parts, int world_size) {
  const auto n = static_cast<int64_t>(parts.size());
  main.ints["manifest_parts"] = n;
  main.ints["manifest_world_size"] = world_size;
  main.tensors.erase("manifest/parts");
  if (n == 0) return;
  Tensor rows = Tensor::empty({n, 5}, DType::I64);
  int64_t* r = rows.data<int64_t>();
  for (const SetPart& p : parts) {
    for (int64_t v : {p.kind, p.rank, p.stage, p.bytes, static_cast<int64_t>(p.checksum)}) *r++ = v;
  }
  main.tensors["manifest/parts"] = rows;
}

std::vector<SetPart> manifest_parts(const CheckpointState& main, const std::string& main_file) {
  const auto count = main.ints.find("manifest_parts");
  if (count == main.ints.end() || count->second == 0) return {};  // written before manifests, or no parts
  const int64_t n = count->second;
  const auto rows = main.tensors.find("manifest/parts");
  DT_INPUT_CHECK(
      rows != main.tensors.end() && rows->second.dtype() == DType::I64 && rows->second.shape() == (Shape{n, 5}),
      "checkpoint '" << main_file << "' lists " << n
                     << " parts but has no manifest/parts dataset of that many rows (corrupt file?)");
  std::vector<SetPart> parts;
  for (const int64_t* r = rows->second.data<int64_t>(); n > static_cast<int64_t>(parts.size()); r += 5) {
    const SetPart p{r[0], r[1], r[2], r[3], static_cast<uint64_t>(r[4])};
    DT_INPUT_CHECK((p.kind == SetPart::kStage || p.kind == SetPart::kRank || p.kind == SetPart::kShard) &&
                       p.rank >= 0 && p.rank < (1 << 30) && p.stage >= 0 && p.stage < (1 << 30) && p.bytes >= 0,
                   "checkpoint '" << main_file << "': row " << parts.size() << " of its manifest is not a part");
    parts.push_back(p);
  }
  return parts;
}

namespace {

// The int attributes `names` of checkpoint `path` (absent ones left out), its tensors not read.
std::map<std::string, int64_t> int_attributes(const std::string& path, const std::vector<const char*>& names) {
  auto lock = data::h5::lock();
  bool format1 = false;
  data::h5::Handle file = open_checkpoint(path, format1);
  std::map<std::string, int64_t> out;
  for (const char* name : names)
    if (const auto v = attr_i64s(file.get(), name); v.size() == 1) out[name] = v[0];
  return out;
}

int64_t int_or(const std::map<std::string, int64_t>& m, const std::string& key, int64_t otherwise) {
  const auto it = m.find(key);
  return it == m.end() ? otherwise : it->second;
}

}  // namespace

void check_set_part(const CheckpointState& main, const std::string& main_file, const SetPart& part) {
  const std::string f = part.file(main_file);
  const std::string where = "checkpoint " + main_file + ": " + part.what() + " '" + f + "'";
  std::error_code ec;
  const auto bytes = fs::file_size(f, ec);
  DT_INPUT_CHECK(!ec, where << " is missing");
  DT_INPUT_CHECK(static_cast<int64_t>(bytes) == part.bytes,
                 where << " is " << bytes << " bytes, the manifest says " << part.bytes << " (torn or replaced)");
  const auto a = int_attributes(f, {"run_id", "step", "rank", "pp_stage", "tensors_xxh3"});
  DT_INPUT_CHECK(int_or(a, "run_id", 0) == int_or(main.ints, "run_id", 0),
                 where << " was written by another run (run id " << int_or(a, "run_id", 0) << ", the set's "
                       << int_or(main.ints, "run_id", 0) << ")");
  DT_INPUT_CHECK(
      int_or(a, "step", -1) == int_or(main.ints, "step", -2),
      where << " is from step " << int_or(a, "step", -1) << ", the set from step " << int_or(main.ints, "step", -2));
  const bool rank = part.kind != SetPart::kStage;
  DT_INPUT_CHECK(
      rank ? int_or(a, "rank", -1) == part.rank : int_or(a, "pp_stage", -1) == part.stage,
      where << " says it is " << (rank ? "rank " : "stage ") << int_or(a, rank ? "rank" : "pp_stage", -1) << "'s");
  const auto sum = static_cast<uint64_t>(int_or(a, "tensors_xxh3", 0));
  DT_INPUT_CHECK(a.count("tensors_xxh3") && sum == part.checksum, where << " has tensor checksum " << std::hex << sum
                                                                        << ", the manifest says " << part.checksum
                                                                        << std::dec << " (rewritten or replaced)");
}

void check_manifest(const CheckpointState& main, const std::string& main_file, int first, int stride) {
  const std::vector<SetPart> parts = manifest_parts(main, main_file);
  for (size_t i = static_cast<size_t>(first); i < parts.size(); i += static_cast<size_t>(std::max(stride, 1)))
    check_set_part(main, main_file, parts[i]);
}

void check_parts_visible(const CheckpointState& main, const std::string& main_file) {
  std::set<int64_t> unseen;
  std::string first;
  for (const SetPart& part : manifest_parts(main, main_file)) {
    try {
      check_set_part(main, main_file, part);
    } catch (const InputError& e) {
      if (first.empty()) first = e.what();
      unseen.insert(part.rank);
    }
  }
  if (unseen.empty()) return;
  std::string ranks;
  for (const int64_t r : unseen) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw InputError("checkpoint folder '" + fs::path(main_file).parent_path().string() +
                   "' is not one folder every rank shares: the writer of the set cannot see the parts of rank(s) " +
                   ranks + " (" + first + "); give --checkpoint-dir on a file system every node mounts (a " +
                   "node's own disk holds only its ranks' parts); the earlier sets are kept");
}

bool write_compression_parts(const std::string& main_file, const parallel::DataParallel* dp, comm::Communicator* world,
                             int64_t step, const std::string& compression, int64_t run_id, SavedFile* saved) {
  if (!dp) return false;
  const std::map<std::string, Tensor> state = dp->compression_state();
  const int rank = world ? world->rank() : 0;
  auto write = [&] {
    if (state.empty()) return;
    CheckpointState part;
    for (const auto& [key, t] : state) part.tensors["compress/" + key] = t;
    part.strings["compression"] = compression;
    part.ints["step"] = step;
    part.ints["rank"] = rank;
    part.ints["world_size"] = world ? world->size() : 1;
    part.ints["run_id"] = run_id;
    const SavedFile written = save_checkpoint(rank_part_file(main_file, rank), part);
    if (saved) *saved = written;
  };
  if (world)
    comm::agree_on_inputs(*world, write);
  else
    write();
  return !state.empty();
}

bool uses_compression_parts(const CheckpointState& main, const parallel::DataParallel* dp, int world,
                            const std::string& compression, bool same_layout, std::string* why_not) {
  const auto ranks = main.ints.find("compression_ranks");
  const auto kept = main.strings.find("compression");
  std::string why;
  if (ranks == main.ints.end() || ranks->second == 0)
    why = "";
  else if (!dp || !dp->compresses())
    why = "resume: the checkpoint kept gradient compression state (--compression " +
          (kept == main.strings.end() ? std::string("?") : kept->second) +
          "); this run does not compress, so it is not used";
  else if (ranks->second != world || kept == main.strings.end() || kept->second != compression || !same_layout)
    why =
        "resume: --compression, the rank count or the layout changed since the checkpoint; error feedback "
        "restarts from zero";
  else
    return true;
  if (why_not) *why_not = why;
  return false;
}

CheckpointState load_rank_part(const CheckpointState& main, const std::string& main_file, int rank, int world) {
  for (int r = 0; r < world; ++r) {
    const std::string part = rank_part_file(main_file, r);
    DT_INPUT_CHECK(fs::exists(part), "checkpoint '" << main_file << "' keeps rank " << r
                                                    << "'s gradient compression state in '" << part
                                                    << "', which is missing");
  }
  for (const SetPart& p : manifest_parts(main, main_file))
    if (p.kind == SetPart::kRank && p.rank == rank) check_set_part(main, main_file, p);
  const std::string part = rank_part_file(main_file, rank);
  CheckpointState cs = load_checkpoint(part);
  const auto kept_step = main.ints.find("step");
  DT_INPUT_CHECK(kept_step != main.ints.end(),
                 "checkpoint '" << main_file << "' has no step attribute (corrupt file?)");
  const int64_t step = kept_step->second;
  DT_INPUT_CHECK(cs.ints["step"] == step && cs.ints["rank"] == rank,
                 "'" << part << "' is rank " << cs.ints["rank"] << "'s state at step " << cs.ints["step"]
                     << ", not rank " << rank << "'s at step " << step);
  const auto run = main.ints.find("run_id");
  DT_INPUT_CHECK(cs.ints["run_id"] == (run == main.ints.end() ? 0 : run->second),
                 "'" << part << "' was written by another run than " << main_file << " (run ids differ)");
  return cs;
}

void put_compression_part(const CheckpointState& part, const std::string& part_file, parallel::DataParallel* dp) {
  std::map<std::string, Tensor> state;
  for (const auto& [key, t] : part.tensors)
    if (key.rfind("compress/", 0) == 0) state[key.substr(9)] = t;
  try {
    dp->load_compression_state(state);
  } catch (const InputError& e) {
    DT_INPUT_CHECK(false, "'" << part_file << "': " << e.what());
  }
}

std::string load_compression_part(const CheckpointState& main, const std::string& main_file, parallel::DataParallel* dp,
                                  int rank, int world, const std::string& compression, bool same_layout) {
  std::string why_not;
  if (!uses_compression_parts(main, dp, world, compression, same_layout, &why_not)) return why_not;
  put_compression_part(load_rank_part(main, main_file, rank, world), rank_part_file(main_file, rank), dp);
  return "";
}

void check_finite_loss(double loss, int64_t step, int rank) {
  if (!std::isfinite(loss))
    throw DivergenceError("loss became " + std::to_string(loss) + " at step " + std::to_string(step) + " on rank " +
                          std::to_string(rank) + ": lower --lr or set --clip-grad-norm");
}

void check_finite_weights(const std::vector<nn::Parameter*>& params, int64_t step, int rank) {
  for (const nn::Parameter* p : params)
    if (!engine_for(p->value.device()).all_finite(p->value))
      throw DivergenceError("the weights after step " + std::to_string(step) + " on rank " + std::to_string(rank) +
                            " are not finite (first: " + p->name +
                            "); no checkpoint written: lower --lr or set --clip-grad-norm");
}

}  // namespace dtrain::train

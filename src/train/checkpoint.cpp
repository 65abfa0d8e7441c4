#include "dtrain/train/checkpoint.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "dtrain/comm/communicator.h"
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

// zlib's crc32_z takes a size_t length: tensors of 4 GiB and more are covered whole.
uLong crc_bytes(uLong crc, const void* p, size_t n) { return crc32_z(crc, static_cast<const Bytef*>(p), n); }

uint32_t crc_of(const std::map<std::string, Tensor>& tensors) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& [name, t] : tensors) {  // std::map: sorted, so the order is the same on load
    crc = crc_bytes(crc, name.data(), name.size());
    if (t.nbytes()) crc = crc_bytes(crc, t.raw(), t.nbytes());
  }
  return static_cast<uint32_t>(crc);
}

// The attributes that say what a file is (step, rank, run, layout, ...), covered by a checksum of
// their own: a flipped bit there would otherwise load as another step or another rank's part.
// (The checksums and the format tag themselves are not covered.)
uint32_t attributes_crc(const CheckpointState& s) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& [k, v] : s.strings)
    if (k != "format") {
      crc = crc_bytes(crc, k.data(), k.size());
      crc = crc_bytes(crc, v.data(), v.size());
    }
  for (const auto& [k, v] : s.ints)
    if (k != "checksum" && k != "attributes_checksum") {
      crc = crc_bytes(crc, k.data(), k.size());
      crc = crc_bytes(crc, &v, sizeof v);
    }
  for (const auto& [k, v] : s.int_lists)
    if (!v.empty()) {  // an empty list's attribute may not come back at all
      crc = crc_bytes(crc, k.data(), k.size());
      crc = crc_bytes(crc, v.data(), v.size() * sizeof(int64_t));
    }
  return static_cast<uint32_t>(crc);
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

void save_checkpoint(const std::string& path, const CheckpointState& s) {
  using data::h5::Handle;
  fs::path final_path(path);
  const fs::path folder = final_path.has_parent_path() ? final_path.parent_path() : fs::path(".");
  fs::create_directories(folder);
  std::string tmp = path + ".tmp";
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
    const int64_t tensors_crc = crc_of(s.tensors), attributes = attributes_crc(s);  // outside the lock
    auto lock = data::h5::lock();
    bool attrs = true;
    for (const auto& [k, v] : s.strings) attrs = attrs && data::h5::write_attr_string(file.get(), k.c_str(), v);
    for (const auto& [k, v] : s.ints) attrs = attrs && data::h5::write_attr_i64(file.get(), k.c_str(), {v});
    for (const auto& [k, v] : s.int_lists)  // an empty list is written where HDF5 can, and is not required
      attrs = (data::h5::write_attr_i64(file.get(), ("list:" + k).c_str(), v) || v.empty()) && attrs;
    attrs = attrs && data::h5::write_attr_i64(file.get(), "checksum", {tensors_crc}) &&
            data::h5::write_attr_i64(file.get(), "attributes_checksum", {attributes}) &&
            data::h5::write_attr_string(file.get(), "format", "dtrain-checkpoint-1");
    DT_INPUT_CHECK(attrs, "cannot write the attributes of '" << tmp << "' (disk full?)");
    lcpl.reset();
    DT_INPUT_CHECK(H5Fclose(file.release()) >= 0, "cannot close '" << tmp << "' (disk full?)");
  }
  sync_to_disk(tmp, false);
  // Test hook: a pause with the file complete but not yet in place (a crash here must leave the
  // previous checkpoint the newest loadable one).
  if (const char* ms = std::getenv("DTRAIN_TEST_CHECKPOINT_RENAME_DELAY_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
  fs::rename(tmp, final_path);          // atomic on one file system: the old checkpoint stays until this
  sync_to_disk(folder.string(), true);  // the rename itself on the disk
}

CheckpointState load_checkpoint(const std::string& path) {
  auto lock = data::h5::lock();  // HDF5 is not thread-safe; loader threads read shards
  DT_INPUT_CHECK(fs::exists(path), "checkpoint '" << path << "' does not exist");
  DT_INPUT_CHECK(H5Fis_hdf5(path.c_str()) > 0,
                 "checkpoint '" << path << "' is not a readable HDF5 file (truncated or corrupt?)");
  data::h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  DT_INPUT_CHECK(file.get() >= 0, "checkpoint '" << path << "' cannot be opened");
  DT_INPUT_CHECK(attr_string(file.get(), "format") == "dtrain-checkpoint-1",
                 "'" << path << "' is not a dtrain checkpoint (no format attribute)");
  CheckpointState s;
  // Walk every dataset.
  struct Walk {
    std::vector<std::string> names;
  } walk;
  H5Ovisit2(
      file.get(), H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        if (info->type == H5O_TYPE_DATASET) static_cast<Walk*>(data)->names.push_back(name);
        return 0;
      },
      &walk, H5O_INFO_BASIC);
  for (const std::string& name : walk.names) {
    data::h5::Handle ds(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
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
    s.tensors["/" == name.substr(0, 1) ? name.substr(1) : name] = t;
  }
  auto crc = attr_i64s(file.get(), "checksum");
  DT_INPUT_CHECK(crc.size() == 1 && static_cast<uint32_t>(crc[0]) == crc_of(s.tensors),
                 "checkpoint '" << path << "' fails its checksum: the file is corrupt");
  // Attributes: strings, ints, lists.
  struct Attrs {
    hid_t file;
    CheckpointState* s;
  } attrs{file.get(), &s};
  H5Aiterate2(
      file.get(), H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t loc, const char* name, const H5A_info_t*, void* data) -> herr_t {
        auto* a = static_cast<Attrs*>(data);
        data::h5::Handle attr(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
        data::h5::Handle type(H5Aget_type(attr.get()), H5Tclose);
        std::string n = name;
        if (H5Tget_class(type.get()) == H5T_STRING) {
          a->s->strings[n] = attr_string(loc, name);
        } else if (n.rfind("list:", 0) == 0) {
          a->s->int_lists[n.substr(5)] = attr_i64s(loc, name);
        } else if (n != "checksum") {
          auto v = attr_i64s(loc, name);
          if (!v.empty()) a->s->ints[n] = v[0];
        }
        return 0;
      },
      &attrs);
  // Files written before the attributes had a checksum of their own have none to check.
  if (const auto a = s.ints.find("attributes_checksum"); a != s.ints.end()) {
    DT_INPUT_CHECK(static_cast<uint32_t>(a->second) == attributes_crc(s),
                   "checkpoint '" << path << "' fails the checksum of its attributes: the file is corrupt");
    s.ints.erase(a);
  }
  return s;
}

CheckpointState load_checkpoint_set(const std::string& main_file) {
  CheckpointState s = load_checkpoint(main_file);
  auto it = s.ints.find("pp_stages");
  const int64_t stages = it == s.ints.end() ? 1 : it->second;
  for (int64_t st = 1; st < stages; ++st) {
    const std::string f = stage_part_file(main_file, st);
    DT_INPUT_CHECK(fs::exists(f), "checkpoint " << main_file << " is stage 0 of " << stages << " pipeline stages, but "
                                                << f << " (stage " << st << ") is missing");
    CheckpointState part = load_checkpoint(f);
    DT_INPUT_CHECK(part.ints["step"] == s.ints["step"],
                   f << " is from step " << part.ints["step"] << ", " << main_file << " from step " << s.ints["step"]);
    DT_INPUT_CHECK(part.ints["run_id"] == s.ints["run_id"],
                   f << " was written by another run than " << main_file << " (run ids differ)");
    for (auto& [name, t] : part.tensors) s.tensors.emplace(name, t);  // a tied weight's copy: stage 0's
  }
  return s;
}

std::vector<std::string> checkpoint_candidates(const std::string& p, const std::string& option) {
  DT_INPUT_CHECK(fs::exists(p), "option --" << option << ": '" << p << "' does not exist");
  if (!fs::is_directory(p)) return {p};
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(p)) {
    std::string n = e.path().filename().string();
    // (ckpt-N.stageS.h5 files are the other pipeline stages' parts of ckpt-N.h5.)
    if (n.rfind("ckpt-", 0) == 0 && e.path().extension() == ".h5" && n.find(".stage") == std::string::npos)
      found.push_back(e.path().string());
  }
  DT_INPUT_CHECK(!found.empty(), "option --" << option << ": no ckpt-*.h5 checkpoint in directory '" << p << "'");
  std::sort(found.rbegin(), found.rend());  // names carry zero-padded step numbers: newest first
  return found;
}

std::string resolve_checkpoint(const std::string& p, const std::string& option) {
  return checkpoint_candidates(p, option).front();
}

std::vector<std::string> remove_unfinished_writes(const std::string& dir) {
  std::vector<std::string> removed;
  if (!fs::is_directory(dir)) return removed;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("ckpt-step", 0) == 0 && e.path().extension() == ".tmp" && fs::is_regular_file(e.path())) {
      fs::remove(e.path());
      removed.push_back(n);
    }
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

std::string checkpoint_file(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-step%09lld.h5", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

std::string stage_part_file(const std::string& main_file, int64_t stage) {
  fs::path p(main_file);
  return (p.parent_path() / (p.stem().string() + ".stage" + std::to_string(stage) + ".h5")).string();
}

std::string rank_part_file(const std::string& main_file, int rank) {
  return main_file + ".rank" + std::to_string(rank);
}

namespace {

// The main file a file of the set belongs to ("ckpt-step1.h5" for itself and for
// "ckpt-step1.h5.rank3" and "ckpt-step1.stage2.h5"), or "" for a file outside the set.
std::string main_file_of(const std::string& name) {
  if (name.rfind("ckpt-step", 0) != 0) return "";
  if (const size_t at = name.find(".h5.rank"); at != std::string::npos) return name.substr(0, at + 3);
  if (const size_t at = name.find(".stage"); at != std::string::npos) return name.substr(0, at) + ".h5";
  return name.size() > 3 && name.compare(name.size() - 3, 3, ".h5") == 0 ? name : "";
}

}  // namespace

void prune_checkpoints(const std::string& dir, const std::string& just_written, int keep) {
  const std::string mine = fs::path(just_written).filename().string();
  // Every file of the set by its main file, of the steps before the one just written.
  std::map<std::string, std::vector<fs::path>> sets;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string main = main_file_of(e.path().filename().string());
    if (!main.empty() && main < mine) sets[main].push_back(e.path());
  }
  std::vector<std::string> complete;  // main files present, oldest first (names carry zero-padded steps)
  for (const auto& [main, files] : sets)
    if (fs::exists(fs::path(dir) / main)) complete.push_back(main);
  const size_t kept_before = static_cast<size_t>(std::max(keep, 1)) - 1;  // the one just written counts
  const size_t drop = complete.size() > kept_before ? complete.size() - kept_before : 0;
  for (const auto& [main, files] : sets) {
    const bool orphan = !fs::exists(fs::path(dir) / main);
    const bool old = std::find(complete.begin(), complete.begin() + static_cast<std::ptrdiff_t>(drop), main) !=
                     complete.begin() + static_cast<std::ptrdiff_t>(drop);
    if (orphan || old)
      for (const fs::path& f : files) fs::remove(f);
  }
}

bool write_compression_parts(const std::string& main_file, const parallel::DataParallel* dp, comm::Communicator* world,
                             int64_t step, const std::string& compression, int64_t run_id) {
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
    save_checkpoint(rank_part_file(main_file, rank), part);
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

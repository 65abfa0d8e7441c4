#pragma once
// Internal helpers around the HDF5 C API. The installed HDF5 is the parallel build, which is not
// thread-safe: every HDF5 call in the process must hold hdf5_mutex().
#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::data::h5 {

// The one process-wide lock for HDF5. Taking it through lock() also switches HDF5's automatic
// error-stack printing off (once), so users see dtrain's message instead of HDF5's trace.
std::mutex& mutex();
std::unique_lock<std::mutex> lock();

// The HDF5 library's version, "1.10.8", asked under the lock: every HDF5 call counts, even this one
// (a run's provenance asked it while a loader thread opened a shard, and the process's heap broke).
std::string library_version();

// The most specific description on HDF5's current error stack ("truncated file: eof = ..."), or "".
std::string last_error();

// Throws InputError(message): lets the header's templates report without including core/error.h.
[[noreturn]] void throw_input_error(const std::string& message);

// An owned hid_t closed with the matching H5*close. Move-only.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), closer_(o.closer_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
      closer_ = o.closer_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  hid_t release() { return std::exchange(id_, H5I_INVALID_HID); }  // the caller closes it
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

inline Handle file(hid_t id) { return Handle(id, H5Fclose); }
inline Handle dataset(hid_t id) { return Handle(id, H5Dclose); }
inline Handle space(hid_t id) { return Handle(id, H5Sclose); }
inline Handle type(hid_t id) { return Handle(id, H5Tclose); }
inline Handle plist(hid_t id) { return Handle(id, H5Pclose); }
inline Handle attr(hid_t id) { return Handle(id, H5Aclose); }

// Attribute writers on an object (the file's root group here). Caller holds the lock.
bool write_attr_string(hid_t obj, const char* name, const std::string& value);
bool write_attr_i64(hid_t obj, const char* name, const std::vector<int64_t>& values);
bool write_attr_f64(hid_t obj, const char* name, const std::vector<double>& values);
bool write_attr_scalar_i64(hid_t obj, const char* name, int64_t value);  // a scalar dataspace
// A 1-D array of fixed-length NUL-terminated strings (h5py reads it as an array of bytes).
bool write_attr_strings(hid_t obj, const char* name, const std::vector<std::string>& values);

// The shape of dataset `dset` of file `path`, checked before a read of it as `elem_bytes`-byte
// elements allocates anything: every dimension fits, so does the product of the non-zero ones (any
// part of the shape, such as a sample of a dataset of no rows, has an int64 size), and the bytes
// the read needs (also in the file's element size, and a whole chunk of a chunked dataset) are
// backed by data in the file, at most kMaxInflation times what the file stores for the dataset
// (HDF5 reads chunks that were never written as the fill value, so a small file may declare any
// size). Throws InputError naming the file and `name`. Caller holds the lock.
inline constexpr uint64_t kMaxInflation = 1100;  // deflate, dtrain's only filter, cannot exceed 1032:1
std::vector<int64_t> read_shape(hid_t dset, int64_t elem_bytes, const std::string& path, const std::string& name);

// A 1-D dataset `name` of `n` elements of `file_type`, written from `data` (`mem_type`); false on
// failure (h5::last_error says why). Caller holds the lock.
bool write_1d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, size_t n, const void* data);

// The whole 1-D dataset `name` of `file` (at `path`, for messages), converted to `mem_type` (the C
// type T); its size is checked against the file (read_shape) before anything is allocated. Throws
// InputError naming the file and dataset. Caller holds the lock.
template <typename T>
std::vector<T> read_1d(hid_t file, const char* name, hid_t mem_type, const std::string& path) {
  Handle ds = H5Lexists(file, name, H5P_DEFAULT) > 0 ? dataset(H5Dopen2(file, name, H5P_DEFAULT)) : Handle();
  if (!ds.valid()) throw_input_error("'" + path + "' has no dataset '" + name + "'");
  const std::vector<int64_t> shape = read_shape(ds.get(), sizeof(T), path, name);
  if (shape.size() != 1) throw_input_error("'" + path + "': dataset '" + name + "' must be 1-D");
  std::vector<T> out(static_cast<size_t>(shape[0]));
  if (!out.empty() && H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    throw_input_error("cannot read dataset '" + std::string(name) + "' of '" + path + "': " + last_error());
  return out;
}

// Attribute readers: false when the attribute is missing or of an unreadable type; an InputError
// naming the file when it declares more bytes than the whole file holds. Caller holds the lock.
bool read_attr_i64(hid_t obj, const char* name, std::vector<int64_t>& out);
bool read_attr_f64(hid_t obj, const char* name, std::vector<double>& out);
bool read_attr_string(hid_t obj, const char* name, std::string& out);
bool read_attr_strings(hid_t obj, const char* name, std::vector<std::string>& out);  // as write_attr_strings writes

}  // namespace dtrain::data::h5

#include "dtrain/data/hdf5_util.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string_view>

#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"

namespace dtrain::data::h5 {

std::mutex& mutex() {
  static std::mutex m;
  return m;
}

std::unique_lock<std::mutex> lock() {
  std::unique_lock<std::mutex> l(mutex());
  static bool quiet = false;  // guarded by the mutex
  if (!quiet) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    quiet = true;
  }
  return l;
}

std::string library_version() {
  auto held = lock();
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

namespace {
herr_t innermost_error(unsigned n, const H5E_error2_t* err, void* client) {
  // Walking upward starts at the innermost (most specific) entry: keep only that one.
  if (n == 0 && err->desc) *static_cast<std::string*>(client) = err->desc;
  return 0;
}
}  // namespace

std::string last_error() {
  std::string desc;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_error, &desc);
  return desc;
}

void throw_input_error(const std::string& message) { throw InputError(message); }

bool write_1d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, size_t n, const void* data) {
  const hsize_t dims = n;
  Handle sp = space(H5Screate_simple(1, &dims, nullptr));
  Handle ds = dataset(H5Dcreate2(file, name, file_type, sp.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  return ds.valid() && (n == 0 || H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
}

static bool write_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, hsize_t n, const void* data) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  Handle sp = space(H5Screate_simple(1, &n, nullptr));
  if (!sp.valid()) return false;
  Handle a = attr(H5Acreate2(obj, name, file_type, sp.get(), H5P_DEFAULT, H5P_DEFAULT));
  return a.valid() && H5Awrite(a.get(), mem_type, data) >= 0;
}

// A fixed-length string type of `size` bytes, NUL-terminated.
static Handle string_type(size_t size) {
  Handle t = type(H5Tcopy(H5T_C_S1));
  H5Tset_size(t.get(), std::max<size_t>(size, 1));
  H5Tset_strpad(t.get(), H5T_STR_NULLTERM);
  return t;
}

bool write_attr_string(hid_t obj, const char* name, const std::string& value) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  // A fixed-length, NUL-terminated scalar string: h5py returns it as bytes/str.
  Handle t = string_type(value.size() + 1);
  Handle sp = space(H5Screate(H5S_SCALAR));
  Handle a = attr(H5Acreate2(obj, name, t.get(), sp.get(), H5P_DEFAULT, H5P_DEFAULT));
  return a.valid() && H5Awrite(a.get(), t.get(), value.c_str()) >= 0;
}

bool write_attr_i64(hid_t obj, const char* name, const std::vector<int64_t>& values) {
  return write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, values.size(), values.data());
}

bool write_attr_f64(hid_t obj, const char* name, const std::vector<double>& values) {
  return write_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, values.size(), values.data());
}

bool write_attr_strings(hid_t obj, const char* name, const std::vector<std::string>& values) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  size_t width = 1;
  for (const std::string& v : values) width = std::max(width, v.size() + 1);
  std::vector<char> packed(values.size() * width, '\0');
  for (size_t i = 0; i < values.size(); ++i) std::copy(values[i].begin(), values[i].end(), packed.begin() + i * width);
  Handle t = string_type(width);
  const hsize_t n = values.size();
  Handle sp = space(H5Screate_simple(1, &n, nullptr));
  Handle a = attr(H5Acreate2(obj, name, t.get(), sp.get(), H5P_DEFAULT, H5P_DEFAULT));
  return a.valid() && H5Awrite(a.get(), t.get(), packed.data()) >= 0;
}

bool write_attr_scalar_i64(hid_t obj, const char* name, int64_t value) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  Handle sp = space(H5Screate(H5S_SCALAR));
  Handle a = attr(H5Acreate2(obj, name, H5T_STD_I64LE, sp.get(), H5P_DEFAULT, H5P_DEFAULT));
  return a.valid() && H5Awrite(a.get(), H5T_NATIVE_INT64, &value) >= 0;
}

namespace {

// prod(dims) * elem_bytes, or false when a dimension is absurd or the product of the non-zero ones
// passes int64: a dataset of no rows still has its sample's size computed (shape_numel), which
// must fit.
bool bytes_of(const std::vector<hsize_t>& dims, uint64_t elem_bytes, uint64_t& bytes) {
  uint64_t nonzero = elem_bytes;
  bool empty = false;
  for (hsize_t d : dims) {
    if (d >= (hsize_t(1) << 48) || __builtin_mul_overflow(nonzero, std::max<hsize_t>(d, 1), &nonzero)) return false;
    empty = empty || d == 0;
  }
  bytes = empty ? 0 : nonzero;
  return nonzero <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

}  // namespace

std::vector<int64_t> read_shape(hid_t dset, int64_t elem_bytes, const std::string& path, const std::string& name) {
  Handle sp = space(H5Dget_space(dset));
  const int rank = sp.valid() ? H5Sget_simple_extent_ndims(sp.get()) : -1;
  DT_INPUT_CHECK(rank >= 0, "'" << path << "': cannot read the shape of dataset '" << name << "' (" << last_error()
                                << "; corrupt file?)");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(sp.get(), dims.data(), nullptr);
  // HDF5 converts element by element through buffers of the file's element size, and reads a
  // chunked dataset a whole chunk at a time: both count.
  Handle t = type(H5Dget_type(dset));
  const uint64_t elem = std::max<uint64_t>(static_cast<uint64_t>(elem_bytes), t.valid() ? H5Tget_size(t.get()) : 0);
  uint64_t bytes = 0, chunk_bytes = 0;
  bool fits = bytes_of(dims, elem, bytes);
  Handle dcpl = plist(H5Dget_create_plist(dset));
  if (fits && dcpl.valid() && H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
    std::vector<hsize_t> chunk(static_cast<size_t>(rank));
    fits = H5Pget_chunk(dcpl.get(), rank, chunk.data()) == rank && bytes_of(chunk, elem, chunk_bytes);
  }
  std::error_code ec;
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  const uint64_t stored = std::min<uint64_t>(H5Dget_storage_size(dset), ec ? 0 : file_bytes);
  const std::vector<int64_t> shape(dims.begin(), dims.end());
  const bool backed = bytes == 0 || (bytes / kMaxInflation < stored && chunk_bytes / kMaxInflation < stored);
  DT_INPUT_CHECK(fits && backed, "'" << path << "': dataset '" << name << "' declares " << shape_str(shape) << " of "
                                     << elem << "-byte elements ("
                                     << (fits ? std::to_string(std::max(bytes, chunk_bytes)) + " bytes to read"
                                              : std::string("sizes past 2^63 bytes"))
                                     << ") but the file stores " << stored << " bytes of it (corrupt or truncated?)");
  return shape;
}

namespace {

// Throws InputError when attribute `name` of `obj` declares more bytes (`count` elements of
// `elem_bytes` each) than its whole file holds: a corrupt header must not size an allocation.
void check_attr_backed(hid_t obj, const char* name, uint64_t count, uint64_t elem_bytes) {
  Handle f = file(H5Iget_file_id(obj));
  hsize_t file_bytes = 0;
  if (f.valid() && H5Fget_filesize(f.get(), &file_bytes) < 0) file_bytes = 0;
  if (count <= file_bytes / std::max<uint64_t>(elem_bytes, 1)) return;
  std::string path(256, '\0');
  const ssize_t len = f.valid() ? H5Fget_name(f.get(), path.data(), path.size()) : -1;
  path.resize(len > 0 ? std::min<size_t>(static_cast<size_t>(len), path.size() - 1) : 0);
  throw InputError(DT_STR("'" << path << "': attribute '" << name << "' declares " << count << " element(s) of "
                               << elem_bytes << " bytes but the whole file holds " << file_bytes
                               << " bytes (corrupt file?)"));
}

}  // namespace

template <typename T>
static bool read_attr_numeric(hid_t obj, const char* name, hid_t mem_type, std::vector<T>& out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Handle a = attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!a.valid()) return false;
  Handle sp = space(H5Aget_space(a.get()));
  hssize_t n = H5Sget_simple_extent_npoints(sp.get());
  if (n < 0) return false;
  Handle t = type(H5Aget_type(a.get()));
  H5T_class_t cls = H5Tget_class(t.get());
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) return false;
  check_attr_backed(obj, name, static_cast<uint64_t>(n), H5Tget_size(t.get()));
  out.assign(static_cast<size_t>(n), T{});
  return H5Aread(a.get(), mem_type, out.data()) >= 0;
}

bool read_attr_i64(hid_t obj, const char* name, std::vector<int64_t>& out) {
  return read_attr_numeric(obj, name, H5T_NATIVE_INT64, out);
}

bool read_attr_f64(hid_t obj, const char* name, std::vector<double>& out) {
  return read_attr_numeric(obj, name, H5T_NATIVE_DOUBLE, out);
}

bool read_attr_strings(hid_t obj, const char* name, std::vector<std::string>& out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Handle a = attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!a.valid()) return false;
  Handle t = type(H5Aget_type(a.get()));
  if (H5Tget_class(t.get()) != H5T_STRING || H5Tis_variable_str(t.get()) > 0) return false;
  Handle sp = space(H5Aget_space(a.get()));
  const hssize_t n = H5Sget_simple_extent_npoints(sp.get());
  const size_t width = H5Tget_size(t.get());
  if (n < 0 || width == 0) return false;
  check_attr_backed(obj, name, static_cast<uint64_t>(n), width);
  std::string packed(static_cast<size_t>(n) * width, '\0');
  if (n > 0 && H5Aread(a.get(), t.get(), packed.data()) < 0) return false;
  out.clear();
  for (hssize_t i = 0; i < n; ++i) {
    const std::string_view v(packed.data() + i * width, width);
    out.emplace_back(v.substr(0, v.find('\0')));
  }
  return true;
}

// One string: an array of them (or none) is not this attribute.
bool read_attr_string(hid_t obj, const char* name, std::string& out) {
  std::vector<std::string> values;
  if (!read_attr_strings(obj, name, values) || values.size() != 1) return false;
  out = std::move(values.front());
  return true;
}

}  // namespace dtrain::data::h5

#include "fuzz_h5.h"

#include <algorithm>
#include <cstring>

#include "dtrain/data/hdf5_util.h"
#include "fuzz_util.h"

namespace dtrain::fuzz {

namespace {

using data::h5::Handle;

constexpr size_t kMaxWritten = 64 << 10;  // bytes of values a dataset is given at most

// Sizes drawn so far in this file: values that must agree (a shard's rows in inputs and labels,
// its sample shape in an attribute) often do.
thread_local std::vector<hsize_t> drawn_dims;

std::string pick_string(FuzzedDataProvider& in, const std::vector<std::string>& known, size_t max_len) {
  if (!known.empty() && in.ConsumeIntegralInRange(0, 7) != 0)
    return known[in.ConsumeIntegralInRange<size_t>(0, known.size() - 1)];
  return in.ConsumeRandomLengthString(max_len);
}

// One of `known` most of the time (the caller then takes its type and rank), else a drawn name.
const H5Object* pick_known(FuzzedDataProvider& in, const std::vector<H5Object>& known) {
  if (known.empty() || in.ConsumeIntegralInRange(0, 7) == 0) return nullptr;
  return &known[in.ConsumeIntegralInRange<size_t>(0, known.size() - 1)];
}

std::string drawn_name(FuzzedDataProvider& in) {
  std::string s = in.ConsumeRandomLengthString(24);
  s.erase(std::remove(s.begin(), s.end(), '\0'), s.end());
  return s.empty() || s == "." || s == "/" ? "x" : s;
}

Handle copy(hid_t t) { return data::h5::type(H5Tcopy(t)); }

Handle string_type(FuzzedDataProvider& in) {
  Handle t = copy(H5T_C_S1);
  H5Tset_size(t.get(), in.ConsumeIntegralInRange<size_t>(1, 64));
  H5Tset_strpad(t.get(), in.PickValueInArray({H5T_STR_NULLTERM, H5T_STR_NULLPAD, H5T_STR_SPACEPAD}));
  return t;
}

Handle any_type(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 15)) {
    case 0:
      return copy(H5T_STD_U8LE);
    case 1:
      return copy(H5T_STD_I8LE);
    case 2:
      return copy(H5T_STD_U16BE);
    case 3:
      return copy(H5T_STD_I32LE);
    case 4:
      return copy(H5T_STD_I32BE);
    case 5:
      return copy(H5T_STD_I64LE);
    case 6:
      return copy(H5T_STD_U64BE);
    case 7:
      return copy(H5T_IEEE_F32LE);
    case 8:
      return copy(H5T_IEEE_F64BE);
    case 9:
      return string_type(in);
    case 10: {
      Handle t = copy(H5T_C_S1);
      H5Tset_size(t.get(), H5T_VARIABLE);
      return t;
    }
    case 11: {
      Handle t = data::h5::type(H5Tcreate(H5T_COMPOUND, 8));
      H5Tinsert(t.get(), "a", 0, H5T_STD_I32LE);
      H5Tinsert(t.get(), "b", 4, H5T_IEEE_F32LE);
      return t;
    }
    case 12: {
      const hsize_t n = in.ConsumeIntegralInRange<hsize_t>(1, 4);
      return data::h5::type(H5Tarray_create2(H5T_STD_I32LE, 1, &n));
    }
    case 13:
      return data::h5::type(H5Tcreate(H5T_OPAQUE, in.ConsumeIntegralInRange<size_t>(1, 16)));
    case 14:
      return copy(H5T_STD_B16LE);
    default: {  // an integer of unusual precision
      Handle t = copy(H5T_STD_U32LE);
      H5Tset_precision(t.get(), in.ConsumeIntegralInRange<size_t>(1, 32));
      return t;
    }
  }
}

// The expected type of `known` most of the time, else any.
Handle pick_type(FuzzedDataProvider& in, const H5Object* known) {
  if (!known || in.ConsumeIntegralInRange(0, 7) == 0) return any_type(in);
  return H5Tequal(known->type, H5T_C_S1) > 0 ? string_type(in) : copy(known->type);
}

hsize_t new_dim(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 4)) {
    case 0:
      return in.ConsumeIntegralInRange<hsize_t>(0, 5);
    case 1:
      return in.PickValueInArray<hsize_t>({0, 1, 2, 3, 4, 8, 28, 32, 100, 256});
    case 2:
      return in.PickValueInArray<hsize_t>({1000, 1 << 20, hsize_t(1) << 31, hsize_t(1) << 40, hsize_t(1) << 47});
    default:
      return in.ConsumeIntegral<uint16_t>() % 300;
  }
}

hsize_t pick_dim(FuzzedDataProvider& in) {
  if (!drawn_dims.empty() && in.ConsumeIntegralInRange(0, 2) == 0)
    return drawn_dims[in.ConsumeIntegralInRange<size_t>(0, drawn_dims.size() - 1)];
  drawn_dims.push_back(new_dim(in));
  return drawn_dims.back();
}

size_t elements(const std::vector<hsize_t>& dims) {
  size_t n = 1;
  for (hsize_t d : dims)
    if (__builtin_mul_overflow(n, static_cast<size_t>(d), &n)) return SIZE_MAX;
  return n;
}

// Writes values of `type` for `elems` elements through `write`: strings from the vocabulary, small
// integers or sizes drawn before (as int64, converted by HDF5 to integer and float types), or raw
// bytes.
template <typename Write>
void write_values(FuzzedDataProvider& in, hid_t type, size_t elems, const H5Vocabulary& v, Write write) {
  const size_t size = H5Tget_size(type);
  const H5T_class_t cls = H5Tget_class(type);
  if (elems == 0 || size == 0 || elems > kMaxWritten || elems * size > kMaxWritten) return;
  if (cls == H5T_STRING && H5Tis_variable_str(type) > 0) {
    std::vector<std::string> strings;
    for (size_t i = 0; i < elems; ++i) strings.push_back(pick_string(in, v.strings, 32));
    std::vector<const char*> ptrs;
    for (const std::string& s : strings) ptrs.push_back(s.c_str());
    write(type, ptrs.data());
  } else if (cls == H5T_STRING) {
    std::vector<char> buf(elems * size, '\0');
    for (size_t i = 0; i < elems; ++i) {
      const std::string s = pick_string(in, v.strings, 64);
      std::memcpy(buf.data() + i * size, s.data(), std::min(size, s.size()));
    }
    write(type, buf.data());
  } else if ((cls == H5T_INTEGER || cls == H5T_FLOAT) && in.ConsumeIntegralInRange(0, 3) != 0) {
    std::vector<int64_t> vals(elems);
    const int64_t base = in.ConsumeIntegralInRange<int64_t>(-2, 12);
    for (int64_t& x : vals) {
      switch (in.ConsumeIntegralInRange(0, 3)) {
        case 0:
          x = base;
          break;
        case 1:
          x = drawn_dims.empty() ? base : static_cast<int64_t>(drawn_dims[x % drawn_dims.size()]);
          break;
        default:
          x = in.ConsumeIntegralInRange<int64_t>(-1, 15);
      }
    }
    write(H5T_NATIVE_INT64, vals.data());
  } else {
    std::vector<uint8_t> buf = in.ConsumeBytes<uint8_t>(elems * size);
    buf.resize(elems * size);
    write(type, buf.data());
  }
}

Handle add_dataset(FuzzedDataProvider& in, hid_t loc, const H5Vocabulary& v, const H5Object* known) {
  const std::string name = known ? known->name : drawn_name(in);
  Handle type = pick_type(in, known);
  if (!type.valid()) return {};
  int kind = in.ConsumeIntegralInRange(0, 9);  // 0: scalar, 1: null, else simple
  int rank = in.ConsumeIntegralInRange(1, 4);
  if (known && known->rank >= 0 && in.ConsumeIntegralInRange(0, 7) != 0) {
    kind = known->rank == 0 ? 0 : 2;
    rank = known->rank;
  }
  std::vector<hsize_t> dims;
  if (kind >= 2)
    for (int r = rank; r > 0; --r) dims.push_back(pick_dim(in));
  const size_t elems = kind == 1 ? 0 : elements(dims);
  const size_t size = H5Tget_size(type.get());
  const bool small = elems <= kMaxWritten && elems * size <= kMaxWritten;
  int layout = in.ConsumeIntegralInRange(0, 3);  // contiguous, chunked, chunked + deflate, compact
  if (dims.empty()) layout = 0;
  if (layout == 3 && (!small || elems * size > 16 << 10)) layout = 1;
  Handle dcpl = data::h5::plist(H5Pcreate(H5P_DATASET_CREATE));
  Handle space;
  if (layout == 1 || layout == 2) {
    std::vector<hsize_t> max(dims.size(), H5S_UNLIMITED), chunk;
    for (size_t i = 0; i < dims.size(); ++i) chunk.push_back(in.ConsumeIntegralInRange<hsize_t>(1, 64));
    H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data());
    if (layout == 2) H5Pset_deflate(dcpl.get(), 1);
    space = data::h5::space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), max.data()));
  } else {
    if (layout == 3) H5Pset_layout(dcpl.get(), H5D_COMPACT);
    space = data::h5::space(kind == 0   ? H5Screate(H5S_SCALAR)
                            : kind == 1 ? H5Screate(H5S_NULL)
                                        : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  }
  Handle lcpl = data::h5::plist(H5Pcreate(H5P_LINK_CREATE));
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  if (H5Lexists(loc, name.c_str(), H5P_DEFAULT) > 0) H5Ldelete(loc, name.c_str(), H5P_DEFAULT);
  Handle ds =
      data::h5::dataset(H5Dcreate2(loc, name.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT));
  if (ds.valid() && small && in.ConsumeIntegralInRange(0, 3) != 0)
    write_values(in, type.get(), elems, v,
                 [&](hid_t mem, const void* buf) { H5Dwrite(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf); });
  return ds;
}

void add_attribute(FuzzedDataProvider& in, hid_t obj, const H5Vocabulary& v, const H5Object* known) {
  const std::string name = known ? known->name : drawn_name(in);
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  Handle type = pick_type(in, known);
  if (!type.valid()) return;
  int kind = in.ConsumeIntegralInRange(0, 5);  // 0-1: scalar, 2: null, else 1-D or 2-D
  int rank = in.ConsumeIntegralInRange(1, 2);
  if (known && known->rank >= 0 && in.ConsumeIntegralInRange(0, 7) != 0) {
    kind = known->rank == 0 ? 0 : 3;
    rank = known->rank;
  }
  std::vector<hsize_t> dims;
  if (kind >= 3)
    for (int r = rank; r > 0; --r)
      dims.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<hsize_t>(0, 5) : std::min<hsize_t>(pick_dim(in), 64));
  Handle space = data::h5::space(kind <= 1   ? H5Screate(H5S_SCALAR)
                                 : kind == 2 ? H5Screate(H5S_NULL)
                                             : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  Handle a = data::h5::attr(H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (a.valid())
    write_values(in, type.get(), kind == 2 ? 0 : elements(dims), v,
                 [&](hid_t mem, const void* buf) { H5Awrite(a.get(), mem, buf); });
}

}  // namespace

void add_h5_objects(FuzzedDataProvider& in, hid_t loc, const H5Vocabulary& v, int max_objects, bool skeleton) {
  drawn_dims.clear();
  Handle last;
  if (skeleton) {
    for (const H5Object& d : v.datasets)
      if (in.ConsumeIntegralInRange(0, 15) != 0)
        if (Handle ds = add_dataset(in, loc, v, &d); ds.valid()) last = std::move(ds);
    for (const H5Object& a : v.attributes)
      if (in.ConsumeIntegralInRange(0, 7) != 0) add_attribute(in, loc, v, &a);
  }
  for (int i = 0; i < max_objects && in.remaining_bytes() > 0; ++i) {
    switch (in.ConsumeIntegralInRange(0, 2)) {
      case 0:
        if (Handle ds = add_dataset(in, loc, v, pick_known(in, v.datasets)); ds.valid()) last = std::move(ds);
        break;
      case 1:
        add_attribute(in, loc, v, pick_known(in, v.attributes));
        break;
      default:
        add_attribute(in, last.valid() ? last.get() : loc, v, pick_known(in, v.attributes));
    }
  }
}

void write_h5_recipe(FuzzedDataProvider& in, const std::filesystem::path& path, const H5Vocabulary& v,
                     int max_objects) {
  std::filesystem::create_directories(path.parent_path());
  auto lock = data::h5::lock();
  Handle file = data::h5::file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  if (!file.valid()) fail("cannot create " + path.string());
  add_h5_objects(in, file.get(), v, max_objects, true);
}

}  // namespace dtrain::fuzz

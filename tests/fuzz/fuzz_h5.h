#pragma once
// Structure-aware inputs for the HDF5 readers (the *_h5 targets): HDF5 files built through HDF5's own
// writer from a recipe drawn from the fuzz input. Every file is well-formed HDF5, so what varies is
// what dtrain reads from it: which datasets and attributes exist, their types (integers of any width
// and byte order, floats, fixed and variable strings, compounds, arrays, opaque), dataspaces (scalar,
// null, rank 1-4, sizes far beyond what is stored), layouts (contiguous, chunked, deflate, compact)
// and values. The raw-byte targets spend most of their time in HDF5's own parser; these reach
// dtrain's checks behind it.
#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>

#include <filesystem>
#include <string>
#include <vector>

namespace dtrain::fuzz {

// A dataset or attribute a target's reader looks for, with the type and rank it expects there
// (rank -1: any). A recipe names objects after these most of the time, and gives them the expected
// type and rank most of the time; string types (H5T_C_S1) get a drawn length.
struct H5Object {
  std::string name;
  hid_t type;
  int rank;
};

struct H5Vocabulary {
  std::vector<H5Object> datasets, attributes;
  std::vector<std::string> strings;  // string values drawn most of the time
};

// Adds datasets and attributes drawn from `in` to the file or group `loc` (an attribute goes on
// `loc` or on the dataset made last): with `skeleton`, first the vocabulary's datasets and
// attributes (each most of the time, shaped as expected, sizes shared between them), then up to
// `max_objects` more of any kind. Caller holds the HDF5 lock.
void add_h5_objects(FuzzedDataProvider& in, hid_t loc, const H5Vocabulary& v, int max_objects, bool skeleton);
// A new file at `path` made of add_h5_objects with its skeleton. Takes the HDF5 lock.
void write_h5_recipe(FuzzedDataProvider& in, const std::filesystem::path& path, const H5Vocabulary& v, int max_objects);

}  // namespace dtrain::fuzz

// compare_sets GOT WANT TOLERANCE: whether two checkpoint sets (main files; their stage, shard and
// rank parts beside them) hold the same state: the same tensors, every f32 tensor within TOLERANCE
// of WANT's relative to its largest element (a set written on another processor rounds its GEMMs
// otherwise), every other tensor and every attribute equal, the run's identity and the parts'
// checksums aside. Prints each difference; exit 0 when there is none, 1 otherwise.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>

#include "dtrain/train/checkpoint.h"

using namespace dtrain;

namespace {

int differences = 0;

void differ(const std::string& what) {
  std::cout << what << "\n";
  ++differences;
}

// What names a run (its id, the set it resumed from), its command line or a file's bytes, not its
// state.
bool identity(const std::string& key) {
  return key == "run_id" || key == "parent" || key == "provenance" || key.starts_with("manifest") || key.ends_with("xxh3") || key.ends_with("bytes") ||
         key.ends_with("checksum");
}

template <class Map>
void compare_attributes(const Map& got, const Map& want, const std::string& file) {
  std::set<std::string> keys;
  for (const auto& kv : got) keys.insert(kv.first);
  for (const auto& kv : want) keys.insert(kv.first);
  for (const std::string& k : keys) {
    if (identity(k)) continue;
    if (!got.count(k) || !want.count(k))
      differ(file + ": attribute " + k + (got.count(k) ? " is not in the fixture" : " is missing"));
    else if (got.at(k) != want.at(k))
      differ(file + ": attribute " + k + " differs");
  }
}

void compare_tensors(const train::CheckpointState& got, const train::CheckpointState& want, const std::string& file,
                     double tolerance) {
  for (const auto& [name, w] : want.tensors) {
    if (identity(name)) continue;
    const auto it = got.tensors.find(name);
    if (it == got.tensors.end()) {
      differ(file + ": " + name + " is missing");
      continue;
    }
    const Tensor g = to_host(it->second), x = to_host(w);
    if (g.shape() != x.shape() || g.dtype() != x.dtype()) {
      differ(file + ": " + name + " is " + g.str() + ", the fixture's " + x.str());
      continue;
    }
    if (x.dtype() != DType::F32) {
      if (std::memcmp(g.raw(), x.raw(), static_cast<size_t>(x.nbytes())) != 0) differ(file + ": " + name + " differs");
      continue;
    }
    double largest = 0, worst = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      largest = std::max(largest, std::abs(double(x.f32()[i])));
      worst = std::max(worst, std::abs(double(g.f32()[i]) - x.f32()[i]));
    }
    if (!(worst <= tolerance * std::max(largest, 1e-30)))
      differ(file + ": " + name + " differs by " + std::to_string(worst) + " (largest element " +
             std::to_string(largest) + ")");
  }
  for (const auto& kv : got.tensors)
    if (!identity(kv.first) && !want.tensors.count(kv.first)) differ(file + ": " + kv.first + " is not in the fixture");
}

void compare(const train::CheckpointState& got, const train::CheckpointState& want, const std::string& file,
             double tolerance) {
  compare_tensors(got, want, file, tolerance);
  compare_attributes(got.strings, want.strings, file);
  compare_attributes(got.ints, want.ints, file);
  compare_attributes(got.int_lists, want.int_lists, file);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: compare_sets GOT WANT TOLERANCE\n";
    return 2;
  }
  const std::string got = argv[1], want = argv[2];
  const double tolerance = std::atof(argv[3]);
  try {
    compare(train::load_checkpoint_set(got), train::load_checkpoint_set(want), "the set", tolerance);
    for (int r = 0;; ++r) {  // the compression parts, rank by rank
      const std::string g = train::rank_part_file(got, r), w = train::rank_part_file(want, r);
      if (!std::filesystem::exists(w)) {
        if (std::filesystem::exists(g)) differ(g + " is not in the fixture");
        break;
      }
      compare(train::load_checkpoint(g), train::load_checkpoint(w), "rank part " + std::to_string(r), tolerance);
    }
  } catch (const std::exception& e) {
    std::cout << e.what() << "\n";
    return 1;
  }
  std::cout << (differences ? std::to_string(differences) + " difference(s)" : "the same state") << "\n";
  return differences ? 1 : 0;
}

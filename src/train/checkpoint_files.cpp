// Where a checkpoint set's files are on the disk (checkpoint.h): their names, the newest set of a
// folder, leftovers of an interrupted write, and pruning the older sets.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/train/checkpoint.h"

namespace fs = std::filesystem;

namespace dtrain::train {

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

std::string shard_part_file(const std::string& main_file, int rank) {
  return main_file + ".shard" + std::to_string(rank);
}

namespace {

// The main file a file of the set belongs to ("ckpt-step1.h5" for itself and for
// "ckpt-step1.h5.rank3" and "ckpt-step1.stage2.h5"), or "" for a file outside the set.
std::string main_file_of(const std::string& name) {
  if (name.rfind("ckpt-step", 0) != 0) return "";
  if (const size_t at = name.find(".h5.rank"); at != std::string::npos) return name.substr(0, at + 3);
  if (const size_t at = name.find(".h5.shard"); at != std::string::npos) return name.substr(0, at + 3);
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

std::string abandoned_folder(const std::string& dir, int64_t run_id) {
  return (fs::path(dir) / ("abandoned-" + std::to_string(run_id))).string();
}

std::vector<std::string> set_aside_later_sets(const std::string& dir, int64_t step, int64_t run_id) {
  if (!fs::is_directory(dir)) return {};
  const std::string resumed = fs::path(checkpoint_file(dir, step)).filename().string();
  std::map<std::string, std::vector<fs::path>> later;  // every file of each later set, by its main file
  std::vector<std::string> moved;
  const fs::path aside = abandoned_folder(dir, run_id);
  try {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string main = main_file_of(e.path().filename().string());
      if (!main.empty() && main > resumed && e.is_regular_file()) later[main].push_back(e.path());
    }
    if (!later.empty()) fs::create_directories(aside);
    for (auto& [main, files] : later) {
      // The main file first: from then on the folder holds no set of that step to resume from.
      const std::string& first = main;  // (a structured binding is not captured before C++20's last rules)
      std::stable_partition(files.begin(), files.end(), [&](const fs::path& f) { return f.filename() == first; });
      for (const fs::path& f : files) fs::rename(f, aside / f.filename());
      moved.push_back(main);
    }
  } catch (const fs::filesystem_error& e) {
    throw InputError("cannot move the later checkpoint sets of '" + dir + "' aside into '" + aside.string() +
                     "': " + e.what());
  }
  return moved;
}

}  // namespace dtrain::train

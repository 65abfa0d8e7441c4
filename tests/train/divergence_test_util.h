#pragma once
// The checks both trainers' divergence tests share: the error a diverging run ends with names the
// failing step (by its loss or by its weights) and the option to change, and every checkpoint left
// in ckpt_dir is of an earlier step and holds finite weights.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "dtrain/kernels/engine.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain::test {

inline void expect_stopped_before_checkpoint(const std::string& what, const std::filesystem::path& ckpt_dir) {
  const bool by_loss = what.find("loss became") != std::string::npos;
  const bool by_weights = what.find("are not finite") != std::string::npos;
  ASSERT_TRUE(by_loss || by_weights) << "no divergence error; got: " << what;
  const std::string marker = by_loss ? "at step " : "after step ";
  const size_t at = what.find(marker);
  ASSERT_NE(at, std::string::npos) << what;
  const int bad = std::stoi(what.substr(at + marker.size()));
  EXPECT_GE(bad, 1) << what;
  EXPECT_NE(what.find("--lr"), std::string::npos) << what;
  if (!std::filesystem::exists(ckpt_dir)) return;
  for (const auto& f : std::filesystem::directory_iterator(ckpt_dir)) {
    const std::string name = f.path().filename().string();
    if (name.rfind("ckpt-step", 0) != 0) continue;
    EXPECT_LT(std::stoi(name.substr(9)), bad) << name << " holds a step at or after the failing one: " << what;
    train::CheckpointState st = train::load_checkpoint(f.path().string());
    for (const auto& [key, t] : st.tensors)
      if (key.rfind("param/", 0) == 0) {
        EXPECT_TRUE(cpu_engine().all_finite(t)) << name << ": " << key;
      }
  }
}

}  // namespace dtrain::test

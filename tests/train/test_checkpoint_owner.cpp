// One writer per checkpoint folder (checkpoint_owner.h): a live owner refuses a second run with
// both named; a gone one (its lock free on this host, a lapsed lease elsewhere, an earlier launch
// of the same job, even while its lock lingers) is taken over with a message.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/train/checkpoint_owner.h"
#include "train_test_util.h"

using namespace dtrain;
using train::FolderOwner;
using train::FolderOwnerRecord;

namespace {

std::string this_host() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

// The refusal's message, or "" when `run_id` took the folder.
std::string refusal(const std::string& dir, int64_t run_id) {
  try {
    FolderOwner owner(dir, run_id);
    return "";
  } catch (const InputError& e) {
    return e.what();
  }
}

// The owner file as another run left it, its lease renewed `age_s` seconds ago.
void recorded(const std::string& dir, const FolderOwnerRecord& r, int64_t age_s) {
  const std::string file = FolderOwner::file_of(dir);
  FolderOwner::write(file, r);
  const timespec at{std::time(nullptr) - age_s, 0};
  const timespec times[2] = {at, at};
  ASSERT_EQ(::utimensat(AT_FDCWD, file.c_str(), times, 0), 0);
}

// A pid that is not alive: a child's that was reaped.
int64_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

}  // namespace

TEST(CheckpointOwner, ASecondRunIsRefusedWithBothNamedAndTheFolderIsFreeAfterTheFirst) {
  const std::string dir = test::temp_dir("owner-live");
  {
    FolderOwner first(dir, 11);
    EXPECT_TRUE(first.note().empty()) << first.note();
    const std::string why = refusal(dir, 22);
    EXPECT_NE(why.find("'" + dir + "' belongs to run 11 (host " + this_host()), std::string::npos) << why;
    EXPECT_NE(why.find("holds the folder's lock"), std::string::npos) << why;
    EXPECT_NE(why.find("this run, run 22"), std::string::npos) << why;
    EXPECT_EQ(FolderOwner::read(FolderOwner::file_of(dir)).run_id, 11) << "the refused run changed the owner file";
  }
  EXPECT_EQ(FolderOwner::read(FolderOwner::file_of(dir)).run_id, 0) << "the first run left its record";
  FolderOwner next(dir, 33);
  EXPECT_TRUE(next.note().empty()) << "a folder its owner gave back is taken without a takeover: " << next.note();
  std::filesystem::remove_all(dir);
}

TEST(CheckpointOwner, AGoneOwnerIsTakenOverAndALiveOneElsewhereIsNot) {
  const std::string dir = test::temp_dir("owner-gone");
  std::filesystem::create_directories(dir);
  // Killed on this host: its lock went with it.
  recorded(dir, {5, this_host(), "", "", dead_pid()}, 0);
  {
    FolderOwner taker(dir, 6);
    EXPECT_NE(taker.note().find("took over checkpoint folder " + dir + " from run 5"), std::string::npos)
        << taker.note();
  }
  // On another host: its fresh lease keeps the folder; a lapsed one does not.
  recorded(dir, {7, "node-elsewhere", "", "", 1}, 10);
  const std::string why = refusal(dir, 8);
  EXPECT_NE(why.find("belongs to run 7 (host node-elsewhere"), std::string::npos) << why;
  EXPECT_NE(why.find("its lease is fresh"), std::string::npos) << why;
  recorded(dir, {7, "node-elsewhere", "", "", 1}, train::kOwnerLeaseS + 60);
  {
    FolderOwner taker(dir, 8);
    EXPECT_NE(taker.note().find("lease was last renewed"), std::string::npos) << taker.note();
  }
  // The same job: an earlier launch is gone (the scripts launch one after another); the same launch
  // (another step of the job on this folder) is not.
  ::setenv("SLURM_JOB_ID", "4242", 1);
  ::setenv("DTRAIN_LAUNCH", "0.1", 1);
  recorded(dir, {9, "node-elsewhere", "4242", "0.1", 1}, 10);
  EXPECT_NE(refusal(dir, 10).find("job 4242, launch 0.1"), std::string::npos);
  recorded(dir, {9, "node-elsewhere", "4242", "0.0", 1}, 10);
  {
    FolderOwner taker(dir, 10);
    EXPECT_NE(taker.note().find("an earlier launch of job 4242"), std::string::npos) << taker.note();
  }
  // A later launch while the earlier one's lock lingers (a lost node's, a rank 0 still ending).
  {
    FolderOwner earlier(dir, 11);
    ::setenv("DTRAIN_LAUNCH", "0.2", 1);
    FolderOwner later(dir, 12);
    EXPECT_NE(later.note().find("from run 11"), std::string::npos) << later.note();
    EXPECT_NE(later.note().find("an earlier launch of job 4242"), std::string::npos) << later.note();
  }
  ::unsetenv("SLURM_JOB_ID");
  ::unsetenv("DTRAIN_LAUNCH");
  std::filesystem::remove_all(dir);
}

// Shared main for GoogleTest binaries run under mpiexec (dtrain_add_mpi_test). It initialises MPI
// once through the dtrain runtime, runs the tests on every rank, and makes the ranks agree: a test
// that fails on any rank is reported (by rank 0) as failed, and every rank exits non-zero.
// Only rank 0 prints the usual GoogleTest log; other ranks print their own failures, prefixed.
// A run in which no selected test ran to the end (every one skipped, or none selected) exits 77,
// which CTest counts as not run (SKIP_RETURN_CODE), never as a pass; under
// DTRAIN_REQUIRE_MPI_TESTS=1 (scripts/test.sh as root, where every one can run) it fails.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/comm/runtime.h"

namespace {

// Prints a non-zero rank's failures (its default printer is removed to keep the log readable).
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                 r.summary());
  }

 private:
  int rank_;
};

// After each test, the ranks exchange pass/fail, so rank 0 can name a failure seen elsewhere.
class RankAgreement : public testing::EmptyTestEventListener {
 public:
  RankAgreement(MPI_Comm comm, int size) : comm_(comm), size_(size) {}
  void OnTestEnd(const testing::TestInfo& info) override {
    int failed = info.result()->Failed() ? 1 : 0;
    std::vector<int> all(static_cast<size_t>(size_));
    MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, comm_);
    std::string ranks;
    for (int r = 0; r < size_; ++r)
      if (all[static_cast<size_t>(r)]) {
        if (!ranks.empty()) ranks += ',';
        ranks += std::to_string(r);
      }
    if (!ranks.empty())
      failures_.push_back(std::string(info.test_suite_name()) + "." + info.name() + " (failed on rank " + ranks + ")");
  }
  const std::vector<std::string>& failures() const { return failures_; }

 private:
  MPI_Comm comm_;
  int size_;
  std::vector<std::string> failures_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto& rt = dtrain::comm::Runtime::init(&argc, &argv);
  int rank = rt.topology().rank, size = rt.topology().size;
  MPI_Comm agree = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &agree);

  testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  auto* agreement = new RankAgreement(agree, size);
  listeners.Append(agreement);  // owned by gtest

  int local = RUN_ALL_TESTS();
  int any_failed = 0;
  int mine = (local != 0 || !agreement->failures().empty()) ? 1 : 0;
  MPI_Allreduce(&mine, &any_failed, 1, MPI_INT, MPI_MAX, agree);
  if (rank == 0) {
    for (const std::string& f : agreement->failures()) std::fprintf(stderr, "[ MPI FAILED ] %s\n", f.c_str());
    std::fprintf(stderr, "[ MPI ] %d ranks: %s\n", size, any_failed ? "FAILED" : "all passed");
  }
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  const bool nothing_ran = !any_failed && unit.successful_test_count() == 0;  // skipped ones do not count
  if (rank == 0 && nothing_ran)
    std::fprintf(stderr, "[ MPI ] no test ran at %d ranks (%d skipped): not a pass\n", size, unit.skipped_test_count());
  MPI_Comm_free(&agree);
  dtrain::comm::Runtime::finalize();
  const char* required = std::getenv("DTRAIN_REQUIRE_MPI_TESTS");
  const bool must_run = required && std::string(required) == "1";
  return any_failed || (nothing_ran && must_run) ? 1 : nothing_ran ? 77 : 0;
}

#include "dtrain/core/env.h"

#include <cstdlib>
#include <cstring>

#include "dtrain/core/error.h"

namespace dtrain::env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> k = {
      {"DTRAIN_ALLREDUCE", "mpi",
       "allreduce algorithm of the MPI backend for f32 host buffers: mpi, auto (by size and layout), shm (one "
       "node's shared memory), hier (shm within nodes, MPI between them); --allreduce sets it for a run"},
      {"DTRAIN_ATTENTION", "fused",
       "attention's path: fused (tiles and an online softmax, memory O(T), where the engine has it) or "
       "materialized ([B*H, T, T] scores and probabilities: the reference, and the fallback)"},
      {"DTRAIN_COMM_TIMEOUT", "300", "seconds any collective or point-to-point wait may take before the job aborts"},
      {"DTRAIN_ERROR_WAIT", "10",
       "seconds a rank that found an error waits for the others to report it too (then one rank says it for "
       "all) before it reports its own error alone and ends the job"},
      {"DTRAIN_FLIGHT_RECORDER", "512",
       "collectives each communicator's flight recorder keeps (printed in the hang forensics, compared by the "
       "desync check)"},
      {"DTRAIN_LAUNCH", "",
       "set by the job scripts: which launch of the job this is (requeue count.relaunch), recorded in the "
       "checkpoint folder's owner file, so a later launch of the same job takes the folder over from an earlier one"},
      {"DTRAIN_LM_HEAD", "fused",
       "the language model's head: fused (its cross-entropy computed with it, a chunk of rows of logits at a "
       "time) or materialized (the whole [tokens, vocabulary] logits, then the loss: the reference)"},
      {"DTRAIN_LOADER_THREADS", "2", "background threads per rank that read and augment batches"},
      {"DTRAIN_PREFETCH", "4", "batches the loader keeps ready ahead of the step"},
      {"DTRAIN_PROGRESS", "auto", "progress bar on rank 0: auto (when stdout is a terminal), on, off"},
      {"DTRAIN_SHM_CHUNK_MB", "4",
       "MiB per chunk of the shared-memory allreduce (each rank's window holds two chunks)"},
      {"DTRAIN_TEST_CHECKPOINT_READ_DELAY", "",
       "a test hook: RANK:MS makes world rank RANK wait MS milliseconds before it reads the checkpoint set "
       "(--resume) or the weights (--init-from) it starts from, as on a slow file system"},
      {"DTRAIN_TEST_CHECKPOINT_RENAME_DELAY_MS", "0",
       "a test hook: every checkpoint file waits MS milliseconds complete and synced before its rename (a kill "
       "then leaves it unfinished)"},
      {"DTRAIN_TEST_FLIP_BIT", "",
       "a test hook: RANK:STEP flips the top mantissa bit of the first weight on world rank RANK after step "
       "STEP (a silent corruption for --check-replicas to find)"},
      {"DTRAIN_TEST_KILL_CHECKPOINT", "",
       "a test hook: before:NAME or during:NAME makes the process that writes checkpoint file NAME (ckpt-step"
       "000000060.h5, ckpt-step000000060.h5.rank1, ckpt-step000000060.stage1.h5) kill itself with SIGKILL just "
       "before creating it, or with its temporary file half written"},
      {"DTRAIN_TEST_RANKS_PER_NODE", "",
       "a test hook: N makes the topology-aware allreduce treat world ranks [kN, (k+1)N) as node k, so one host "
       "runs the hierarchical algorithm for real"},
      {"DTRAIN_TEST_SKIP_COLLECTIVE", "",
       "a test hook: RANK:COMM:STEP makes world rank RANK not issue its first collective on communicator COMM "
       "(world, dp, tp, pp, ...) in step STEP, a desync for the desync check to name"},
      {"DTRAIN_TEST_SLOW", "",
       "a test hook: RANK:SECTION:MS makes world rank RANK sleep MS milliseconds in SECTION (data, forward, "
       "backward, optimizer) of every step, a straggler for --straggler-every to name"},
      {"DTRAIN_TEST_START_DELAY", "",
       "a test hook: RANK:SECONDS makes the launcher's rank RANK sleep before MPI_Init, a rank that never "
       "arrives for the start-up deadline"},
      {"DTRAIN_TEST_STOP", "",
       "a test hook: RANK:STEP stops world rank RANK with SIGSTOP after step STEP, a hung rank for the comm "
       "timeout and its hang forensics"},
      {"DTRAIN_WORKING_COPIES", "1",
       "under --precision bf16/fp16, keep bf16/fp16 copies of the GEMM weights, made once per step (0: GEMMs round "
       "the fp32 masters on every call; the same numbers)"},
  };
  return k;
}

static const Knob& find(const char* name) {
  for (const Knob& k : knobs())
    if (std::strcmp(k.name, name) == 0) return k;
  DT_CHECK(false, "environment knob " << name << " is not declared in src/core/env.cpp");
  __builtin_unreachable();
}

std::string get(const char* name) {
  const Knob& k = find(name);
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : std::string(k.default_value);
}

double get_double(const char* name) {
  std::string v = get(name);
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  DT_INPUT_CHECK(end && *end == '\0', "environment variable " << name << "='" << v << "' is not a number");
  return d;
}

long get_long(const char* name) {
  std::string v = get(name);
  char* end = nullptr;
  long d = std::strtol(v.c_str(), &end, 10);
  DT_INPUT_CHECK(end && *end == '\0', "environment variable " << name << "='" << v << "' is not an integer");
  return d;
}

}  // namespace dtrain::env

#!/usr/bin/env bash
# cluster/pbs/train.pbs run with the environment a PBS server gives a job (no PBS server is packaged
# for Debian): PBS_NODEFILE listing this host once per rank, PBS_O_WORKDIR, PBS_JOBID, PBS_JOBNAME,
# PBS_ENVIRONMENT, PBS_QUEUE, and a stand-in `qrerun` that records its call.
#  1. the job trains on 2 ranks; SIGTERM to the script (what qdel/preemption send): checkpoint,
#     the script calls qrerun with the job id and exits 0;
#  2. the rerun job resumes from the checkpoint and finishes at the requested step count;
#  3. a job with the user's own --checkpoint-dir and a --resume of an older run: its first start
#     resumes from that run, the rerun (the same job id) from the job's own newest checkpoint in the
#     user's folder, not from the older run again and not from step 0.
# usage: pbs_fake.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work/bin"
printf '%s\n%s\n' "$(hostname)" "$(hostname)" >"$work/nodefile"
cat >"$work/bin/qrerun" <<QRERUN
#!/bin/sh
echo "\$@" >>"$work/qrerun.calls"
QRERUN
chmod +x "$work/bin/qrerun"
export PATH="$work/bin:$PATH" PBS_NODEFILE=$work/nodefile PBS_O_WORKDIR=$work PBS_JOBID=4242.pbs-server \
  PBS_JOBNAME=dtrain PBS_ENVIRONMENT=PBS_BATCH PBS_QUEUE=workq PBS_O_HOST=$(hostname) \
  DTRAIN_HOME=$root DTRAIN_BIN=$bin DTRAIN_MPIRUN_ARGS="--oversubscribe --bind-to none"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
steps=4000
export DTRAIN_ARGS="--synthetic --model mlp --steps $steps --log-every 50 --threads 1 --progress off"
metrics=$work/runs/dtrain-4242/metrics.jsonl

(cd / && exec "$root/cluster/pbs/train.pbs") >"$work/run1.log" 2>&1 &
job=$!
for ((i = 0; i < 600; ++i)); do grep -q '"step"' "$metrics" 2>/dev/null && break; sleep 0.1; done
kill -TERM "$job"
rc=0; wait "$job" || rc=$?
cat "$work/run1.log"
[[ $rc -eq 0 ]] || fail "run 1: exit status $rc, expected 0 after asking for a rerun"
grep -q "2 ranks on $(hostname)" "$work/run1.log" || fail "run 1: not 2 ranks from PBS_NODEFILE"
grep -q 'dtrain: 2 ranks on 1 node' "$work/run1.log" || fail "run 1: dtrain did not see 2 ranks"
[[ $(cat "$work/qrerun.calls" 2>/dev/null) == "4242.pbs-server" ]] || fail "run 1: qrerun not called with the job id"
step=$(grep -o '"event": "preempted", "step": [0-9]*' "$metrics" | grep -o '[0-9]*$')

(cd / && exec "$root/cluster/pbs/train.pbs") >"$work/run2.log" 2>&1
cat "$work/run2.log"
grep -q "resumed from .* at step $step " "$work/run2.log" || fail "run 2: did not resume at step $step"
grep -q "\"summary\": \"run\", \"steps\": $steps," "$metrics" || fail "run 2: did not finish at step $steps"

# 3. The user's folder and --resume: an older run to start from, then a job preempted and rerun.
"$bin" train --synthetic --model mlp --steps 40 --threads 1 --progress off --checkpoint-dir "$work/old" >/dev/null
export PBS_JOBID=4343.pbs-server
export DTRAIN_ARGS="--synthetic --model mlp --steps $steps --log-every 50 --threads 1 --progress off \
--checkpoint-dir $work/mine --checkpoint-every 100 --resume $work/old"
metrics=$work/runs/dtrain-4343/metrics.jsonl
(cd / && exec "$root/cluster/pbs/train.pbs") >"$work/run3.log" 2>&1 &
job=$!
for ((i = 0; i < 600; ++i)); do grep -q '"step": [1-9][0-9][0-9]' "$metrics" 2>/dev/null && break; sleep 0.1; done
kill -TERM "$job"
rc=0; wait "$job" || rc=$?
cat "$work/run3.log"
[[ $rc -eq 0 ]] || fail "run 3: exit status $rc, expected 0 after asking for a rerun"
grep -q "resumed from $work/old/ckpt-step000000040.h5 at step 40" "$work/run3.log" || fail "run 3: did not start from the older run"
step3=$(grep -o '"event": "preempted", "step": [0-9]*' "$metrics" | grep -o '[0-9]*$')
[[ -f "$work/mine/ckpt-step$(printf %09d "$step3").h5" ]] || fail "run 3: no checkpoint at step $step3 in the user's folder"
(cd / && exec "$root/cluster/pbs/train.pbs") >"$work/run4.log" 2>&1
cat "$work/run4.log"
grep -q "resumed from $work/mine/ckpt-step$(printf %09d "$step3").h5 at step $step3 " "$work/run4.log" ||
  fail "run 4: the rerun did not resume from its own checkpoint at step $step3 in $work/mine"
grep -q "\"summary\": \"run\", \"steps\": $steps," "$metrics" || fail "run 4: did not finish at step $steps"
echo "PASS: PBS job preempted at step $step, rerun, resumed, finished at step $steps; with the user's" \
  "--checkpoint-dir and --resume, the rerun resumed at its own step $step3"

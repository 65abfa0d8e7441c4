#!/usr/bin/env bash
# Preemption through cluster/mpirun/launch.sh on 2 ranks (synthetic data):
#  1. SIGTERM to one rank only: both ranks stop at the same step, checkpoint, exit 42;
#  2. the same command again resumes; SIGTERM to the launcher script: checkpoint, exit 42;
#  3. the same command again resumes and finishes with exactly the requested step count.
# usage: preempt_mpirun.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
launch="$here/../../cluster/mpirun/launch.sh"
rm -rf "$work" && mkdir -p "$work"
export DTRAIN_BIN=$bin DTRAIN_RUN_DIR=$work DTRAIN_NP=2 DTRAIN_MPIRUN_ARGS="--oversubscribe --bind-to none"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
steps=4000
args=(--synthetic --model mlp --steps "$steps" --log-every 50 --threads 1 --progress off)
source "$here/preempt_lib.sh"

# Phase 1: one rank gets SIGTERM.
"$launch" "${args[@]}" >"$work/run1.log" 2>&1 &
job=$!
wait_for_step "$work/metrics.jsonl" 0
rank_pids "$job"
kill -TERM "${ranks[1]}"
rc=0; wait "$job" || rc=$?
cat "$work/run1.log"
[[ $rc -eq 42 ]] || fail "phase 1: exit status $rc, expected 42"
grep -q '"event": "preempted", "step": [0-9]*, "signal": "SIGTERM"' "$work/metrics.jsonl" || fail "phase 1: no preemption event"
step1=$(grep -o '"event": "preempted", "step": [0-9]*' "$work/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
ls "$work/ckpt/ckpt-step$(printf %09d "$step1").h5" >/dev/null || fail "phase 1: no checkpoint at step $step1"

# Phase 2: resume, then SIGTERM to the launcher script.
"$launch" "${args[@]}" >"$work/run2.log" 2>&1 &
job=$!
wait_for_step "$work/metrics.jsonl" $((step1 + 50))
kill -TERM "$job"
rc=0; wait "$job" || rc=$?
cat "$work/run2.log"
[[ $rc -eq 42 ]] || fail "phase 2: exit status $rc, expected 42"
grep -q "resumed from .* at step $step1" "$work/run2.log" || fail "phase 2: did not resume at step $step1"
step2=$(grep -o '"event": "preempted", "step": [0-9]*' "$work/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[[ $step2 -gt $step1 ]] || fail "phase 2: preempted at step $step2, not after $step1"

# Phase 3: resume and finish.
"$launch" "${args[@]}" >"$work/run3.log" 2>&1
cat "$work/run3.log"
grep -q "resumed from .* at step $step2" "$work/run3.log" || fail "phase 3: did not resume at step $step2"
grep -q "\"summary\": \"run\", \"steps\": $steps," "$work/metrics.jsonl" || fail "phase 3: the run did not end at step $steps"
echo "PASS: preempted at steps $step1 and $step2, finished at $steps"

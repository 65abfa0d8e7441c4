#!/usr/bin/env bash
# Preemption of trainer groups (dtrain train --trainers 2 --sweep ...) on 2 ranks:
#  1. SIGUSR1 to mpiexec (which passes it to both ranks): each trainer checkpoints, the job exits 42
#     and the summary marks both preempted;
#  2. the same command again: both trainers resume from their own checkpoints where they stopped
#     and finish with the requested steps; exit 0, both ok in summary.json.
# usage: preempt_sweep.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
source "$here/preempt_lib.sh"
steps=1500
run() {
  exec mpiexec -n 2 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp --steps "$steps" --log-every 50 \
    --threads 1 --progress off --trainers 2 --sweep lr=0.01,0.02 --sweep-dir "$work/sweep"
}

(run) >"$work/run1.log" 2>&1 &  # the subshell becomes mpiexec, which passes SIGUSR1 on to the ranks
job=$!
wait_for_step "$work/sweep/trainer-0/metrics.jsonl" 100
wait_for_step "$work/sweep/trainer-1/metrics.jsonl" 100
kill -USR1 "$job"
rc=0; wait "$job" || rc=$?
cat "$work/run1.log"
[[ $rc -eq 42 ]] || fail "phase 1: exit status $rc, expected 42"
for t in 0 1; do
  grep -q '"event": "preempted"' "$work/sweep/trainer-$t/metrics.jsonl" || fail "phase 1: trainer $t was not preempted"
  ls "$work/sweep/trainer-$t/checkpoints/"ckpt-step*.h5 >/dev/null || fail "phase 1: trainer $t has no checkpoint"
done
[[ $(grep -c '"status": "preempted"' "$work/sweep/summary.json") -eq 2 ]] || fail "phase 1: summary does not say preempted"

rc=0; (run) >"$work/run2.log" 2>&1 || rc=$?
cat "$work/run2.log"
[[ $rc -eq 0 ]] || fail "phase 2: exit status $rc, expected 0"
[[ $(grep -c "resumed from" "$work/run2.log") -eq 2 ]] || fail "phase 2: the trainers did not both resume"
[[ $(grep -c '"status": "ok"' "$work/sweep/summary.json") -eq 2 ]] || fail "phase 2: summary does not say ok"
[[ $(grep -c "\"steps\": \"$steps\"" "$work/sweep/summary.json") -eq 2 ]] || fail "phase 2: not $steps steps each"
echo "PASS: both trainers checkpointed on the signal and resumed to $steps steps"

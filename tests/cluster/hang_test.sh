#!/usr/bin/env bash
# Hang forensics and the desync check under a real mpiexec (3 ranks of `dtrain train`).
#   stop:   rank 1 stops (SIGSTOP) after step 5. The others time out (DTRAIN_COMM_TIMEOUT=4), rank
#           0's message names the collective where the sequences part and rank 1 as behind, and
#           ranks 0 and 2 (not the stopped rank) write hang-rank<r>.txt into the checkpoint folder
#           with their flight recorders and every thread's backtrace.
#   skip:   rank 1 does not issue its gradient allreduce of step 7. The desync check names the
#           collective and the rank on every rank, long before the 30 s timeout; without the hook
#           the same runs (also with pipeline stages, checking every step) pass.
#   suspend: every process of the job (mpiexec and the 3 ranks) is stopped with SIGSTOP for 12 s,
#           3 times the communication timeout (DTRAIN_COMM_TIMEOUT=4), as `scontrol suspend` does, and
#           continued: the run goes on to its last step and exits 0 (a deadline must not count the
#           time the job was stopped).
# usage: hang_test.sh stop|skip|suspend DTRAIN_BIN WORK_DIR
set -euo pipefail
mode=$1 bin=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
run() {  # run SECONDS ARGS...: mpiexec -n 3, output in $out, exit status in $rc, seconds in $took
  local limit=$1
  shift
  local t0=$SECONDS
  set +e
  out=$(timeout "$limit" mpiexec -n 3 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp \
    --threads 1 --progress off "$@" 2>&1)
  rc=$?
  set -e
  took=$((SECONDS - t0))
}
fail() {
  echo "FAIL: $1 (exit $rc after $took s)"
  echo "$out"
  exit 1
}
expect() { grep -Eq "$1" <<<"$out" || fail "the output does not match '$1'"; }

if [[ $mode == stop ]]; then
  DTRAIN_COMM_TIMEOUT=4 DTRAIN_TEST_STOP=1:5 run 60 --steps 40 --checkpoint-dir "$work/ckpt"
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "a stopped rank must end the job with a non-zero exit"
  expect "comm timeout: allreduce #[0-9]+ f32\[1\] max on 'world' \(3 ranks\) did not complete within 4(\.[0-9]+)? s; ranks that did not arrive: 1 on node"
  expect "the ranks' sequences part at allreduce #[0-9]+ f32 x 1 max after step 5 on 'world'; ranks behind: 1 \(no answer\)"
  expect "hang-rank<r>.txt written by world ranks (0, 2|2, 0)"
  [[ ! -e $work/ckpt/hang-rank1.txt ]] || fail "the stopped rank cannot have written forensics"
  for r in 0 2; do
    f=$work/ckpt/hang-rank$r.txt
    [[ -s $f ]] || fail "no $f"
    grep -q "^reason: comm timeout: allreduce #" "$f" || fail "$f does not give the reason"
    grep -Eq "^communicator 'dp' \(rank $r of 3\)" "$f" || fail "$f has no flight recorder of 'dp'"
    grep -Eq "allreduce #[0-9]+ f32 x [0-9]+ avg in step 5: enqueued .* ended" "$f" || fail "$f misses step 5's gradients"
    grep -Eq "allreduce #[0-9]+ f32 x 1 max after step 5: .*NOT ENDED" "$f" || fail "$f does not show the stuck collective"
    grep -q "MpiWork::wait" "$f" || fail "$f has no backtrace of the waiting thread"
    grep -q "MpiCommunicator::worker_loop" "$f" || fail "$f has no backtrace of the comm worker threads"
  done
  echo "PASS: stopped rank 1 named after $took s; forensics of ranks 0 and 2 in $work/ckpt"
elif [[ $mode == skip ]]; then
  DTRAIN_COMM_TIMEOUT=30 DTRAIN_TEST_SKIP_COLLECTIVE=1:dp:7 run 90 --steps 40 --desync-check-every 5
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "a skipped collective must end the job with a non-zero exit"
  ((took < 30)) || fail "the desync was not named before the 30 s timeout"
  expect "comm desync error .*collective sequences differ on 'dp' \(3 ranks\) at #[0-9]+: rank [02] \(world rank [02]\) issued allreduce #[0-9]+ f32 x [0-9]+ avg in step 7; rank 1 \(world rank 1\) is after step 7 and never issued it"
  grep -q "comm timeout" <<<"$out" && fail "the timeout fired before the desync check"
  echo "PASS: the skipped allreduce of rank 1 named after $took s"
  # No false alarm: the same run without the hook, and 2 pipeline stages x 2 replicas (4 ranks)
  # checking every step.
  DTRAIN_COMM_TIMEOUT=30 run 90 --steps 40 --desync-check-every 1
  [[ $rc -eq 0 ]] || fail "a run without the hook failed"
  set +e
  out=$(DTRAIN_COMM_TIMEOUT=30 timeout 120 mpiexec -n 4 --oversubscribe --bind-to none "$bin" train --synthetic \
    --model simple_cnn --pp 2 --batch-size 8 --steps 12 --threads 1 --progress off --desync-check-every 1 2>&1)
  rc=$?
  set -e
  [[ $rc -eq 0 ]] || fail "a pipeline run without the hook failed"
  echo "PASS: no desync reported in runs that have none"
elif [[ $mode == suspend ]]; then
  log=$work/out.txt
  t0=$SECONDS
  DTRAIN_COMM_TIMEOUT=4 DTRAIN_TEST_SLOW=0:data:30 mpiexec -n 3 --oversubscribe --bind-to none "$bin" train \
    --synthetic --model mlp --threads 1 --progress off --steps 400 --log-every 10 >"$log" 2>&1 &
  job=$!
  until grep -q "step 50/400" "$log" 2>/dev/null; do
    kill -0 $job 2>/dev/null || { rc=gone took=$((SECONDS - t0)) out=$(cat "$log"); fail "the run ended before step 50"; }
    sleep 0.2
  done
  ranks=$(pgrep -P $job)
  [[ $(wc -w <<<"$ranks") -eq 3 ]] || { rc=- took=0 out=$(cat "$log"); fail "expected 3 ranks under mpiexec, found: $ranks"; }
  kill -STOP $job $ranks
  stopped_at=$(grep -c "^epoch 1/1 step" "$log")
  sleep 12
  kill -CONT $ranks $job
  set +e
  wait $job
  rc=$?
  set -e
  took=$((SECONDS - t0)) out=$(cat "$log")
  [[ $rc -eq 0 ]] || fail "a job continued after a 12 s stop must go on"
  expect "^done: 400 steps"
  grep -q "comm timeout" <<<"$out" && fail "a deadline counted the stop"
  after=$(grep -c "^epoch 1/1 step" "$log")
  ((stopped_at < 40 && after == 40)) || fail "stopped at log line $stopped_at of $after: the stop did not fall mid-run"
  echo "PASS: stopped 12 s at log line $stopped_at of 40 (timeout 4 s), continued to step 400"
else
  echo "usage: hang_test.sh stop|skip|suspend DTRAIN_BIN WORK_DIR"
  exit 2
fi

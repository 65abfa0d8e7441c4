#!/usr/bin/env bash
# kill -9 of a rank at a precise moment of a checkpoint (the DTRAIN_TEST_KILL_CHECKPOINT hook: the
# rank kills itself with SIGKILL there), 2 ranks under mpirun, each writing a compression part, and
# --keep-checkpoints 1 (the set before the one being written is the only other one):
#   part     rank 1 during the write of its compression part of step 60
#   main     rank 0 during the write of the main file of step 60
#   async    rank 0 during the background write (--checkpoint-async) of the main file of step 60
#   between  rank 0 with every part of step 60 on the disk, before the main file
# The set of step 30 must stay whole, the resume from the folder continue at step 30, and the
# resumed run end bitwise where an uninterrupted run ends (its final set: parameters, optimizer
# state and both compression parts, compared by h5diff). Prints the steps lost: the last step the
# killed run reported minus the step the resume continued from.
# usage: checkpoint_kill.sh MODE DTRAIN_BIN WORK_DIR
set -euo pipefail
mode=$1 bin=$2 work=$3
fail() {
  echo "FAIL ($mode): $*"
  exit 1
}
rm -rf "$work" && mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
async=false
case $mode in
  part) hook=during:ckpt-step000000060.h5.rank1 ;;
  main) hook=during:ckpt-step000000060.h5 ;;
  async) hook=during:ckpt-step000000060.h5 async=true ;;
  between) hook=before:ckpt-step000000060.h5 ;;
  *) fail "unknown mode" ;;
esac
run() {
  timeout 120 mpirun -n 2 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp --steps 90 --threads 1 \
    --progress off --log-every 1 --optimizer adamw --compression topk:0.05 --checkpoint-every 30 \
    --keep-checkpoints 1 --checkpoint-async $async "$@"
}
set_of() { echo "$1/ckpt-step$(printf %09d "$2").h5 $1/ckpt-step$(printf %09d "$2").h5.rank0 $1/ckpt-step$(printf %09d "$2").h5.rank1"; }

run --checkpoint-dir "$work/straight" >"$work/straight.log" 2>&1 || {
  cat "$work/straight.log"
  fail "the uninterrupted run failed"
}
# --keep-checkpoints 1: the final set alone is left, once it is whole.
[[ "$(ls "$work/straight" | tr '\n' ' ')" == "ckpt-step000000090.h5 ckpt-step000000090.h5.rank0 ckpt-step000000090.h5.rank1 " ]] ||
  fail "--keep-checkpoints 1 left: $(ls "$work/straight")"

status=0
DTRAIN_TEST_KILL_CHECKPOINT=$hook run --checkpoint-dir "$work/ckpt" >"$work/killed.log" 2>&1 || status=$?
echo "killed run: exit status $status; left in the folder:"
ls -l "$work/ckpt"
[[ $status -ne 0 && $status -ne 124 ]] || {
  cat "$work/killed.log"
  fail "the run was not killed (status $status)"
}
grep -q "exited on signal 9" "$work/killed.log" || {
  cat "$work/killed.log"
  fail "no rank was killed by SIGKILL"
}
for f in $(set_of "$work/ckpt" 30); do [[ -f $f ]] || fail "the previous set lost $f before the new one was durable"; done
[[ ! -e "$work/ckpt/ckpt-step000000060.h5" ]] || fail "a main file of step 60 exists"
last=$(grep -oE 'step [0-9]+/90' "$work/killed.log" | tail -1 | grep -oE '[0-9]+' | head -1)

run --resume "$work/ckpt" --checkpoint-dir "$work/ckpt" >"$work/resume.log" 2>&1 || {
  cat "$work/resume.log"
  fail "the resume failed"
}
cat "$work/resume.log" | grep -E "resume|removed|checkpoint" || true
grep -q "resumed from $work/ckpt/ckpt-step000000030.h5 at step 30" "$work/resume.log" || fail "did not resume at step 30"
if ls "$work/ckpt"/*.tmp >/dev/null 2>&1; then fail "a .tmp file is left: $(ls "$work/ckpt")"; fi
for mode_tmp in main async part; do
  if [[ $mode == "$mode_tmp" ]]; then
    grep -q "unfinished checkpoint file(s) of a killed write" "$work/resume.log" || fail "no message about the removed .tmp"
  fi
done
# Bitwise: the final sets of both runs hold the same parameters, optimizer state and compression state.
s=$work/straight/ckpt-step000000090.h5 r=$work/ckpt/ckpt-step000000090.h5
h5diff -q "$s" "$r" /param /param || fail "the parameters differ from the uninterrupted run's"
h5diff -q "$s" "$r" /optim /optim || fail "the optimizer state differs from the uninterrupted run's"
for k in 0 1; do h5diff -q "$s.rank$k" "$r.rank$k" /compress /compress || fail "rank $k's compression state differs"; done
echo "PASS ($mode): killed at step ${last:-?} (hook $hook), resumed at step 30 from the whole previous set; steps lost: $((${last:-0} - 30)) (interval 30); final state bitwise equal"

#!/usr/bin/env bash
# kill -9 while a checkpoint is being written in the background: the previous checkpoint stays the
# newest loadable one and a resume starts from it. A test hook holds the finished temporary file
# for a few seconds before its rename; the job (2 ranks under mpirun) is killed once it appears.
# usage: checkpoint_async_kill.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
args=(train --synthetic --model mlp --steps 100000 --threads 1 --progress off --log-every 1000
  --checkpoint-every 30 --checkpoint-dir "$work/ckpt")
DTRAIN_TEST_CHECKPOINT_RENAME_DELAY_MS=3000 mpirun -n 2 --oversubscribe --bind-to none "$bin" "${args[@]}" \
  >"$work/run.log" 2>&1 &
job=$!
for ((i = 0; i < 1200; ++i)); do [[ -e "$work/ckpt/ckpt-step000000060.h5.tmp" ]] && break; sleep 0.05; done
# kill -9 of mpirun and of every rank (their command lines name the checkpoint folder).
kill_job() { pkill -KILL -f -- "--checkpoint-dir $work/ckpt" || true; }
[[ -e "$work/ckpt/ckpt-step000000060.h5.tmp" ]] || { kill_job; cat "$work/run.log"; fail "no second checkpoint being written"; }
kill_job
wait "$job" 2>/dev/null || true
cat "$work/run.log"
ls -l "$work/ckpt"
newest=$(ls "$work/ckpt"/ckpt-step*.h5 | tail -1)
[[ "$newest" == "$work/ckpt/ckpt-step000000030.h5" ]] || fail "newest checkpoint is $newest, expected step 30"
mpirun -n 2 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp --steps 35 --threads 1 --progress off \
  --resume "$work/ckpt" --checkpoint-dir "$work/resumed" >"$work/resume.log" 2>&1 || { cat "$work/resume.log"; fail "resume failed"; }
grep -q "resumed from $work/ckpt/ckpt-step000000030.h5 at step 30" "$work/resume.log" || { cat "$work/resume.log"; fail "did not resume at step 30"; }
echo "PASS: killed during the background write of step 60; step 30 is the newest checkpoint and resumes"

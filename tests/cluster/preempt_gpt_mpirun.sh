#!/usr/bin/env bash
# GPT preemption on 2 ranks (data parallel) through cluster/mpirun/launch.sh:
#  1. an uninterrupted run of $steps steps (the reference);
#  2. the same run with SIGUSR1 to one rank only: both ranks stop at the same step, write the
#     checkpoint and exit 42;
#  3. the same command again resumes at that step and finishes;
# the final checkpoint's parameters and AdamW moments equal the reference's bit for bit (h5diff).
# usage: preempt_gpt_mpirun.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
launch="$here/../../cluster/mpirun/launch.sh"
rm -rf "$work" && mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DTRAIN_BIN=$bin DTRAIN_NP=2 DTRAIN_MPIRUN_ARGS="--oversubscribe --bind-to none"
source "$here/preempt_lib.sh"

fortunes=/usr/share/games/fortunes
[[ -d $fortunes ]] || { echo "SKIP: no $fortunes (Debian package fortunes)"; exit 77; }
"$bin" convert text --inputs "$fortunes" --out "$work/tokens" >/dev/null
steps=3000  # long enough that the signal lands mid-run on a fast machine (~1,000 steps/s here)
args=(--model gpt --data "$work/tokens" --layers 2 --heads 2 --width 32 --context 32 --batch-size 4
      --steps "$steps" --lr 0.003 --warmup-steps 20 --eval-every 0 --eval-batches 2 --log-every 1 --threads 1
      --checkpoint-every 1000)

final() { echo "$1/ckpt/ckpt-step$(printf %09d "$steps").h5"; }

# 1. The reference.
DTRAIN_RUN_DIR=$work/reference "$launch" "${args[@]}" >"$work/reference.log" 2>&1 || { cat "$work/reference.log"; fail "the reference run failed"; }

# 2. SIGUSR1 to one rank.
export DTRAIN_RUN_DIR=$work/preempted
"$launch" "${args[@]}" >"$work/run1.log" 2>&1 &
job=$!
wait_for_step "$DTRAIN_RUN_DIR/metrics.jsonl" 250
rank_pids "$job"
kill -USR1 "${ranks[1]}"
rc=0; wait "$job" || rc=$?
cat "$work/run1.log"
[[ $rc -eq 42 ]] || fail "phase 2: exit status $rc, expected 42"
step1=$(grep -o '"event": "preempted", "step": [0-9]*' "$DTRAIN_RUN_DIR/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[[ -n "$step1" && $step1 -lt $steps ]] || fail "phase 2: no preemption event before step $steps"
ls "$DTRAIN_RUN_DIR/ckpt/ckpt-step$(printf %09d "$step1").h5" >/dev/null || fail "phase 2: no checkpoint at step $step1"

# 3. Resume and finish.
"$launch" "${args[@]}" >"$work/run2.log" 2>&1 || { cat "$work/run2.log"; fail "the resumed run failed"; }
cat "$work/run2.log"
grep -q "resumed from .* at step $step1\$" "$work/run2.log" || fail "phase 3: did not resume at step $step1"
grep -q "\"summary\": \"run\", \"steps\": $steps," "$DTRAIN_RUN_DIR/metrics.jsonl" || fail "phase 3: the run did not end at step $steps"
for group in /param /optim; do
  h5diff "$(final "$work/reference")" "$(final "$DTRAIN_RUN_DIR")" $group $group ||
    fail "the resumed run's $group differs from the uninterrupted run's"
done
echo "PASS: preempted at step $step1 by SIGUSR1 to rank 1, resumed, final parameters and moments bitwise equal"

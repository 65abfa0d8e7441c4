#!/usr/bin/env bash
# Integration tests on a real one-node SLURM started for the test (cluster/slurm/local/start.sh)
# and stopped at its end. Exit 77 (skipped) where SLURM cannot run: not root, or not installed.
#   slurm_test.sh train   DTRAIN_BIN DATA_DIR WORK_DIR   sbatch -n 2 with srun (PMIx) on Fashion-MNIST,
#                                                        then with mpirun inside the allocation
#   slurm_test.sh preempt DTRAIN_BIN WORK_DIR            signal the job, requeue, resume, finish
set -euo pipefail
mode=$1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# fail MESSAGE: the message, then what SLURM knows of the jobs and the tail of its daemons' logs,
# and the message again (CI shows the end of a long output).
fail() {
  echo "FAIL: $*"
  if [[ -n "${slurm_dir:-}" && -f "${slurm_dir}/env.sh" ]]; then
    scontrol show job 2>/dev/null | grep -E 'JobId=|JobState=|Restarts=|ExitCode=' || true
    # What the daemons logged of each job (slurmd: its batch scripts' and steps' lines), then the
    # ends of their logs.
    for f in "$slurm_dir"/log/slurm*.log; do
      echo "== $f"
      grep -E 'JobId=|job [0-9]+|\[[0-9]+\.' "$f" | grep -v 'state file' | tail -40
      tail -5 "$f"
    done 2>/dev/null || true
  fi
  echo "FAIL: $*"
  exit 1
}

slurm_dir=$(mktemp -d /tmp/dtrain-slurm-test.XXXXXX)
export DTRAIN_SLURM_PORT=${DTRAIN_SLURM_PORT:-16827}
# A machine where the daemons cannot start (no root, a container without the needed privileges,
# ports taken) skips the test; DTRAIN_REQUIRE_SLURM=1 makes that a failure instead.
rc=0; "$root/cluster/slurm/local/start.sh" "$slurm_dir" || rc=$?
if [[ $rc -ne 0 ]]; then
  rm -rf "$slurm_dir"
  [[ "${DTRAIN_REQUIRE_SLURM:-0}" == "1" ]] && fail "the local SLURM did not start (status $rc)"
  echo "SKIP: the local SLURM cannot run here (status $rc)"
  exit 77
fi
trap '"$root/cluster/slurm/local/stop.sh" "$slurm_dir"' EXIT
source "$slurm_dir/env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 DTRAIN_HOME=$root

source "$here/slurm_lib.sh"

case "$mode" in
  train)
    bin=$2 data=$3 work=$4
    rm -rf "$work" && mkdir -p "$work" && cd "$work"
    export DTRAIN_BIN=$bin
    for launcher in srun mpirun; do
      id=$(DTRAIN_LAUNCHER=$launcher sbatch --parsable -n 2 --job-name="dtrain-$launcher" \
        "$root/cluster/slurm/train.sbatch" --config "$root/examples/fashion_cnn.ini" --data "$data/train" \
        --test-data "$data/test" --epochs 1 --steps 200 --threads 1 --progress off)
      state=$(wait_job "$id" 600)
      out="$work/dtrain-$id.out"
      cat "$out"
      [[ "$state" == COMPLETED ]] || fail "$launcher: job $id ended $state"
      grep -q "dtrain: 2 ranks on 1 node; launcher SLURM" "$out" || fail "$launcher: training did not run on 2 ranks"
      acc=$(grep -o 'test accuracy [0-9.]*%' "$out" | tail -1 | grep -o '[0-9.]*')
      [[ -n "$acc" ]] || fail "$launcher: no test accuracy reported"
      awk -v a="$acc" 'BEGIN { exit !(a > 60) }' || fail "$launcher: test accuracy $acc% after 200 steps, expected > 60%"
      grep -q '"summary": "run", "steps": 200,' "$work/runs/dtrain-$launcher-$id/metrics.jsonl" || fail "$launcher: no summary"
      echo "PASS ($launcher): job $id on 2 ranks, test accuracy $acc%"
    done
    # Trainer groups in one job: two one-rank trainers of a learning-rate sweep, their folders and
    # summary in the job's run folder.
    id=$(sbatch --parsable -n 2 --job-name=dtrain-sweep "$root/cluster/slurm/train.sbatch" \
      --config "$root/examples/fashion_cnn.ini" --data "$data/train" --test-data "$data/test" --steps 100 \
      --threads 1 --progress off --trainers 2 --sweep lr=0.02,0.05)
    state=$(wait_job "$id" 600)
    out="$work/dtrain-$id.out"
    cat "$out"
    [[ "$state" == COMPLETED ]] || fail "sweep: job $id ended $state"
    summary="$work/runs/dtrain-sweep-$id/sweep/summary.json"
    [[ $(grep -c '"status": "ok"' "$summary") -eq 2 ]] || fail "sweep: $summary does not hold 2 finished trainers"
    grep -q "trainer 1/2 (lr=0.05) on ranks 1-1" "$out" || fail "sweep: trainer 1 did not run on rank 1"
    echo "PASS (train.sbatch --trainers 2): job $id, 2 trainers"
    # The multi-node script with its node, task and GPU counts overridden on sbatch's command line
    # as its header says (one node is all this SLURM has; no GPUs here).
    id=$(DTRAIN_GPUS_PER_TASK= sbatch --parsable -N 1 --ntasks-per-node=2 --gpus-per-task=0 --cpus-per-task=1 \
      --job-name=dtrain-multinode "$root/cluster/slurm/train-multinode.sbatch" --synthetic --model mlp \
      --steps 100 --threads 1 --progress off --log-every 50)
    state=$(wait_job "$id" 600)
    out="$work/dtrain-$id.out"
    cat "$out"
    [[ "$state" == COMPLETED ]] || fail "multi-node script: job $id ended $state"
    grep -q "dtrain: 2 ranks on 1 node; launcher SLURM" "$out" || fail "multi-node script: not 2 ranks"
    grep -q '"summary": "run", "steps": 100,' "$work/runs/dtrain-multinode-$id/metrics.jsonl" || fail "multi-node script: no summary"
    echo "PASS (train-multinode.sbatch): job $id on 2 ranks"
    ;;
  preempt)
    bin=$2 work=$3
    rm -rf "$work" && mkdir -p "$work" && cd "$work"
    export DTRAIN_BIN=$bin
    preempt_job dtrain 3000 --synthetic --model mlp --threads 1 --progress off --log-every 100
    # The user's own --checkpoint-dir and --resume OLD: the first start resumes from OLD, the
    # requeued one from the newest set this job wrote into the user's folder.
    "$bin" train --synthetic --model mlp --steps 40 --threads 1 --progress off --checkpoint-dir "$work/old" >/dev/null
    preempt_job dtrain-user 3000 --synthetic --model mlp --threads 1 --progress off --log-every 100 \
      --checkpoint-dir "$work/mine" --resume "$work/old"
    out=$(ls -t "$work"/dtrain-*.out | head -1)
    grep -q "resumed from $work/old/ckpt-step000000040.h5 at step 40" "$out" || fail "the first start did not resume from --resume"
    grep -Eq "resumed from $work/mine/ckpt-step[0-9]+.h5 at step [0-9]+" "$out" ||
      fail "the requeued start did not resume from the job's own set in --checkpoint-dir"
    [[ -z $(ls "$work/runs/dtrain-user-"*/ckpt 2>/dev/null) ]] || fail "checkpoints went to the script's folder"
    echo "PASS (dtrain-user): --resume for the first start, the job's own sets in --checkpoint-dir after the requeue"
    "$bin" convert text --inputs /usr/share/games/fortunes --out "$work/tokens" >/dev/null
    preempt_job dtrain-gpt 3000 --model gpt --data "$work/tokens" --layers 2 --heads 2 --width 32 --context 32 \
      --batch-size 4 --eval-every 0 --eval-batches 2 --log-every 100 --threads 1 --progress off
    ;;
  *) fail "mode must be train or preempt" ;;
esac

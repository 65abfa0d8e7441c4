# Shared by the SLURM tests (sourced): waiting for jobs, and a preemption that must requeue and
# resume. Uses $root (the source tree), $work (the submit folder) and fail().

# job_state ID: COMPLETED, FAILED, PENDING, ...
job_state() { scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
# wait_job ID SECONDS: waits for the job to end. A requeued job waiting out SLURM's requeue delay
# is let start, but only 2 s after it was first seen waiting: the requeue revoked the job's
# credential as of that second, and slurmd refuses a start whose new credential falls in the same
# second ("Job credential revoked"), which ends the job FAILED.
wait_job() {
  local s eligible now waiting_since=0
  for ((i = 0; i < $2; ++i)); do
    s=$(job_state "$1")
    now=$(date +%s)
    case "$s" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) echo "$s"; return 0 ;;
      PENDING)
        eligible=$(scontrol show job "$1" | grep -o 'EligibleTime=[^ ]*' | cut -d= -f2)
        eligible=$(date -d "$eligible" +%s 2>/dev/null || echo 0)
        if ((eligible <= now + 2)); then
          waiting_since=0
        elif ((waiting_since == 0)); then
          waiting_since=$now
        elif ((now >= waiting_since + 2)); then
          scontrol update jobid="$1" StartTime=now 2>/dev/null || true
          waiting_since=0
        fi
        ;;
      *) waiting_since=0 ;;  # a later requeue waits its own 2 s
    esac
    sleep 1
  done
  echo "TIMEOUT_WAITING"
}

# preempt_job NAME STEPS ARGS...: submits train.sbatch ($SBATCH_SHAPE, default -n 2), signals the batch
# script as --signal=B:USR1@T does before the time limit, and checks that the job was
# requeued once, resumed at the preempted step and finished at STEPS. Rank 0 sleeps 3 ms a step
# (DTRAIN_TEST_SLOW) so that a run cannot end before the signal reaches it on a loaded machine.
preempt_job() {
  local name=$1 steps=$2
  shift 2
  local id metrics out state step
  id=$(DTRAIN_TEST_SLOW=0:data:3 sbatch --parsable ${SBATCH_SHAPE:--n 2} --job-name="$name" \
    "$root/cluster/slurm/train.sbatch" --steps "$steps" "$@")
  metrics="$work/runs/$name-$id/metrics.jsonl"
  for ((i = 0; i < 600; ++i)); do grep -q '"step"' "$metrics" 2>/dev/null && break; sleep 0.2; done
  scancel --batch --signal=USR1 "$id"
  state=$(wait_job "$id" 600)
  out="$work/dtrain-$id.out"
  cat "$out"
  [[ "$state" == COMPLETED ]] || { scontrol show job "$id"; fail "$name: job $id ended $state"; }
  grep -q 'requeueing job' "$out" || fail "$name: the job was not requeued"
  step=$(grep -o '"event": "preempted", "step": [0-9]*' "$metrics" | head -1 | grep -o '[0-9]*$' || true)
  [[ -n "$step" ]] || fail "$name: no preemption recorded"
  grep -Eq "resumed from .* at step $step( |\$)" "$out" || fail "$name: the requeued job did not resume at step $step"
  [[ $(scontrol show job "$id" | grep -o 'Restarts=[0-9]*') == Restarts=1 ]] || fail "$name: expected one restart"
  grep -q "\"summary\": \"run\", \"steps\": $steps," "$metrics" || fail "$name: the run did not finish at step $steps"
  echo "PASS ($name): preempted at step $step, requeued, resumed, finished at step $steps"
}

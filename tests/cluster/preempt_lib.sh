# Shared by the preemption tests (sourced): fail, waiting for a step, finding the rank processes.
fail() { echo "FAIL: $*"; exit 1; }

# wait_for_step METRICS STEP: waits until the metrics file holds a step past STEP, so a signal
# lands mid-run.
wait_for_step() {
  for _ in $(seq 600); do
    local last
    last=$(grep -o '"step": [0-9]*' "$1" 2>/dev/null | tail -1 | grep -o '[0-9]*$' || true)
    [[ -n "$last" && "$last" -gt "$2" ]] && return 0
    sleep 0.1
  done
  fail "training did not pass step $2"
}

# rank_pids JOB_PID: sets the array `ranks` to the dtrain processes under the launcher's mpirun.
rank_pids() {
  local mpirun_pid
  mpirun_pid=$(pgrep -P "$1" -x mpirun || pgrep -P "$1" | head -1)
  ranks=($(pgrep -P "$mpirun_pid" -f dtrain))
  [[ ${#ranks[@]} -eq 2 ]] || fail "expected 2 rank processes under mpirun, found ${#ranks[@]}"
}

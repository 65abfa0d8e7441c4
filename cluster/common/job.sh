# Shared by the SLURM, PBS and mpirun job scripts (sourced, not run). It finds the dtrain binary,
# adds checkpoint/metrics/resume options, runs the launcher in the background so that the shell can
# forward a preemption signal to it, and reports whether the run was preempted.
#
# Environment (every one optional):
#   DTRAIN_HOME        the dtrain source tree (default: the folder above cluster/)
#   DTRAIN_BIN         the dtrain executable (default: dtrain on PATH, else $DTRAIN_HOME/build/dtrain)
#   DTRAIN_RUN_DIR     where this job writes checkpoints and metrics (default: set by each script)
#   DTRAIN_CKPT_DIR    checkpoints (default: $DTRAIN_RUN_DIR/ckpt); a job restarted with the same
#                      folder resumes from its newest checkpoint
#   DTRAIN_METRICS     JSON-lines metrics (default: $DTRAIN_RUN_DIR/metrics.jsonl)
#   DTRAIN_ARGS        extra `dtrain train` options, split on spaces (script arguments are added too)
#   DTRAIN_PREEMPTED_EXIT  the exit status dtrain uses after a preemption checkpoint (default 42)
#   DTRAIN_LAUNCHER_GRACE  seconds the launcher may live on after this node's ranks have all
#                      exited before it is ended (default 60; 0: never). mpirun can hang tearing
#                      down a job whose other node is unreachable; the job must still end.

DTRAIN_PREEMPTED_EXIT=${DTRAIN_PREEMPTED_EXIT:-42}

dtrain_log() { echo "dtrain-job: $*" >&2; }

# dtrain_status_text RC: what dtrain's exit status RC means (README "Exit statuses"). Only 42 is
# requeued: a bad option or a diverged run would fail the same way again.
dtrain_status_text() {
  case "$1" in
    0) echo "done" ;;
    1) echo "runtime failure (see the rank's message above)" ;;
    2) echo "bad input or option: fix the job before resubmitting" ;;
    3) echo "diverged (non-finite loss or weights): lower --lr or set --clip-grad-norm" ;;
    "$DTRAIN_PREEMPTED_EXIT") echo "preempted after writing a checkpoint" ;;
    *) echo "ended by the launcher or a signal" ;;
  esac
}

# dtrain_find_bin: sets DTRAIN_BIN.
dtrain_find_bin() {
  if [[ -z "${DTRAIN_BIN:-}" ]]; then
    if command -v dtrain >/dev/null 2>&1; then DTRAIN_BIN=$(command -v dtrain)
    else DTRAIN_BIN="${DTRAIN_HOME}/build/dtrain"; fi
  fi
  if [[ ! -x "$DTRAIN_BIN" ]]; then
    dtrain_log "no dtrain executable at '$DTRAIN_BIN' (set DTRAIN_BIN or DTRAIN_HOME)"
    return 1
  fi
}

# dtrain_train_args ARGS...: fills the array DTRAIN_TRAIN_ARGS with `train`, the user's options,
# and --checkpoint-dir / --metrics / --resume (and --sweep-dir for trainer groups) unless the user gave them.
dtrain_train_args() {
  local user=("$@")
  if [[ -n "${DTRAIN_ARGS:-}" ]]; then
    local extra
    read -r -a extra <<<"$DTRAIN_ARGS"
    user=("${extra[@]}" "${user[@]}")
  fi
  DTRAIN_CKPT_DIR=${DTRAIN_CKPT_DIR:-$DTRAIN_RUN_DIR/ckpt}
  DTRAIN_METRICS=${DTRAIN_METRICS:-$DTRAIN_RUN_DIR/metrics.jsonl}
  DTRAIN_TRAIN_ARGS=(train "${user[@]}")
  local joined=" ${user[*]} "
  if [[ "$joined" != *" --checkpoint-dir"* ]]; then
    mkdir -p "$DTRAIN_CKPT_DIR"
    DTRAIN_TRAIN_ARGS+=(--checkpoint-dir "$DTRAIN_CKPT_DIR")
  fi
  [[ "$joined" == *" --metrics"* ]] || DTRAIN_TRAIN_ARGS+=(--metrics "$DTRAIN_METRICS")
  # Trainer groups keep each trainer's folder (and the resume of a requeued sweep) in the run folder.
  if [[ "$joined" == *" --trainers"* || "$joined" == *" --sweep"* ]] && [[ "$joined" != *" --sweep-dir"* ]]; then
    DTRAIN_TRAIN_ARGS+=(--sweep-dir "$DTRAIN_RUN_DIR/sweep")
  fi
  if [[ "$joined" != *" --resume"* ]] && compgen -G "$DTRAIN_CKPT_DIR/ckpt-step*.h5" >/dev/null; then
    dtrain_log "resuming from the newest checkpoint in $DTRAIN_CKPT_DIR"
    DTRAIN_TRAIN_ARGS+=(--resume "$DTRAIN_CKPT_DIR")
  fi
}

# dtrain_run_forwarding CMD...: runs CMD in the background; SIGTERM, SIGUSR1 or SIGINT reaching this
# shell is passed on to CMD as SIGUSR1 (srun and mpirun both forward SIGUSR1 to every rank, while
# mpirun would answer SIGTERM by killing the ranks before they checkpoint). Returns CMD's status.
dtrain_run_forwarding() {
  "$@" &
  local pid=$! ended
  ended=$(mktemp)
  dtrain_end_lingering_launcher "$pid" "$ended" &
  local watchdog=$!
  # shellcheck disable=SC2064
  trap "dtrain_log 'signal received: asking the ranks to checkpoint'; kill -USR1 $pid 2>/dev/null" TERM USR1 INT
  local rc=0
  while true; do
    wait "$pid"
    rc=$?
    # wait returns early (status > 128) when a trapped signal arrives; go on waiting while CMD lives.
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - TERM USR1 INT
  kill "$watchdog" 2>/dev/null
  wait "$watchdog" 2>/dev/null
  # A launcher ended by the watchdog: the ranks' failure (status 1) is what the job reports.
  [[ -s "$ended" ]] && rc=1
  rm -f "$ended"
  return "$rc"
}

# dtrain_end_lingering_launcher PID FILE: ends the launcher PID (TERM, then KILL; writes FILE) when the dtrain ranks it
# started on this node (its child processes) have all exited and it is still running
# DTRAIN_LAUNCHER_GRACE seconds later: after a rank aborted the job because a node was lost,
# Open MPI's mpirun waits for that node's daemon forever. srun's ranks are not its children, so an
# srun is never ended here (SLURM itself ends a job step on a lost node).
dtrain_end_lingering_launcher() {
  local pid=$1 ended=$2 grace=${DTRAIN_LAUNCHER_GRACE:-60} seen=0 since=0 name
  [[ "$grace" =~ ^[0-9]+$ ]] && ((grace > 0)) || return 0
  name=$(basename "${DTRAIN_BIN:-dtrain}" | cut -c1-15)
  while kill -0 "$pid" 2>/dev/null; do
    if pgrep -P "$pid" -x "$name" >/dev/null; then
      seen=1 since=0
    elif ((seen)); then
      ((since == 0)) && since=$SECONDS
      if ((SECONDS - since >= grace)); then
        dtrain_log "the launcher is still running ${grace}s after the ranks on this node exited (a node lost?); ending it"
        echo "$grace" >"$ended"
        kill -TERM "$pid" 2>/dev/null
        sleep 5
        kill -KILL "$pid" 2>/dev/null
        return 0
      fi
    fi
    sleep 1
  done
}

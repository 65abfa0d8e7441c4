# Shared by the SLURM, PBS and mpirun job scripts (sourced, not run). It finds the dtrain binary,
# adds checkpoint/metrics/resume options, runs the launcher in the background so that the shell can
# forward a preemption signal to it, and reports whether the run was preempted.
#
# Environment (every one optional):
#   DTRAIN_HOME        the dtrain source tree (default: the folder above cluster/)
#   DTRAIN_BIN         the dtrain executable (default: dtrain on PATH, else $DTRAIN_HOME/build/dtrain)
#   DTRAIN_RUN_DIR     where this job writes checkpoints and metrics (default: set by each script)
#   DTRAIN_CKPT_DIR    checkpoints (default: $DTRAIN_RUN_DIR/ckpt, or the user's --checkpoint-dir);
#                      a requeued job resumes from its own newest checkpoint, wherever they go
#   DTRAIN_METRICS     JSON-lines metrics (default: $DTRAIN_RUN_DIR/metrics.jsonl)
#   DTRAIN_ARGS        extra `dtrain train` options, split on spaces (script arguments are added too)
#   DTRAIN_PREEMPTED_EXIT  the exit status dtrain uses after a preemption checkpoint (default 42)
#   DTRAIN_MAX_RESTARTS    relaunches inside the allocation after a lost rank or node (default 2; the
#                      script argument --max-restarts N says the same and is not passed to dtrain)
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

# dtrain_option NAME ARGS...: the value `dtrain train ARGS` takes for option NAME, from the effective
# configuration (--print-config: the command line over the INI file), else from the words of ARGS
# ("--NAME VALUE" or "--NAME=VALUE"); empty when unset.
dtrain_option() {
  local name=$1
  shift
  local v
  v=$("$DTRAIN_BIN" train "$@" --print-config 2>/dev/null | sed -n "s/^$name *= *//p" | head -1)
  if [[ -z $v ]]; then
    local args=("$@") i
    for ((i = 0; i < ${#args[@]}; ++i)); do
      [[ ${args[i]} == "--$name" ]] && v=${args[i + 1]:-}
      [[ ${args[i]} == "--$name="* ]] && v=${args[i]#--$name=}
    done
  fi
  echo "$v"
}

# dtrain_newest_set DIR: the newest main file of a checkpoint set in DIR (not a stage's or a rank's
# part, which are written before it), or nothing.
dtrain_newest_set() {
  compgen -G "$1/ckpt-step*.h5" | grep -E '/ckpt-step[0-9]+\.h5$' | sort | tail -1 || true
}

# dtrain_train_args ARGS...: fills the array DTRAIN_TRAIN_ARGS with `train`, the user's options,
# and --checkpoint-dir / --metrics / --resume (and --sweep-dir for trainer groups) unless the user gave them.
# A requeued or rerun job (the same SLURM/PBS job id started again: a marker in its checkpoint folder
# says so) resumes from the newest complete set this job wrote, wherever its checkpoints go (the
# script's folder, the user's --checkpoint-dir or the INI's); the user's --resume is for its first
# start only.
dtrain_train_args() {
  local user=("$@")
  if [[ -n "${DTRAIN_ARGS:-}" ]]; then
    local extra
    read -r -a extra <<<"$DTRAIN_ARGS"
    user=("${extra[@]}" "${user[@]}")
  fi
  dtrain_take_max_restarts "${user[@]}"
  user=("${DTRAIN_USER_ARGS[@]}")
  DTRAIN_CKPT_DIR=${DTRAIN_CKPT_DIR:-$DTRAIN_RUN_DIR/ckpt}
  DTRAIN_METRICS=${DTRAIN_METRICS:-$DTRAIN_RUN_DIR/metrics.jsonl}
  local joined=" ${user[*]} " ckpt
  ckpt=$(dtrain_option checkpoint-dir "${user[@]}")
  local own_ckpt=0
  if [[ -z $ckpt ]]; then
    ckpt=$DTRAIN_CKPT_DIR own_ckpt=1
  fi
  mkdir -p "$ckpt"
  local job=${SLURM_JOB_ID:-${PBS_JOBID:-}} restart=0
  if [[ -n $job ]]; then
    local marker="$ckpt/.dtrain-job-${job//[^A-Za-z0-9_.-]/_}"
    [[ -e $marker ]] && restart=1
    touch "$marker"
  fi
  # A restart of a job that wrote checkpoints takes them; one that wrote none starts as the first did.
  local newest
  newest=$(dtrain_newest_set "$ckpt")
  [[ -n $newest ]] || restart=0
  if ((restart)); then  # the user's --resume is dropped: this job's own sets come first now
    local kept=() i
    for ((i = 0; i < ${#user[@]}; ++i)); do
      if [[ ${user[i]} == --resume ]]; then ((++i)); continue; fi
      [[ ${user[i]} == --resume=* ]] && continue
      kept+=("${user[i]}")
    done
    user=("${kept[@]}")
    joined=" ${user[*]} "
  fi
  DTRAIN_TRAIN_ARGS=(train "${user[@]}")
  ((own_ckpt)) && DTRAIN_TRAIN_ARGS+=(--checkpoint-dir "$ckpt")
  [[ "$joined" == *" --metrics"* ]] || DTRAIN_TRAIN_ARGS+=(--metrics "$DTRAIN_METRICS")
  # Trainer groups keep each trainer's folder (and the resume of a requeued sweep) in the run folder.
  if [[ "$joined" == *" --trainers"* || "$joined" == *" --sweep"* ]] && [[ "$joined" != *" --sweep-dir"* ]]; then
    DTRAIN_TRAIN_ARGS+=(--sweep-dir "$DTRAIN_RUN_DIR/sweep")
  fi
  if [[ -n $newest ]] && { ((restart)) || { ((own_ckpt)) && [[ "$joined" != *" --resume"* ]]; }; }; then
    if ((restart)); then
      dtrain_log "restart of job $job: resuming from its newest checkpoint in $ckpt"
    else
      dtrain_log "resuming from the newest checkpoint in $ckpt"
    fi
    DTRAIN_TRAIN_ARGS+=(--resume "$ckpt")
  fi
  DTRAIN_CKPT_DIR=$ckpt
}

# dtrain_take_max_restarts ARGS...: DTRAIN_MAX_RESTARTS from --max-restarts N (or =N) among ARGS,
# which the job script reads and dtrain does not; DTRAIN_USER_ARGS holds the other arguments.
dtrain_take_max_restarts() {
  local args=("$@") i
  DTRAIN_MAX_RESTARTS=${DTRAIN_MAX_RESTARTS:-2} DTRAIN_USER_ARGS=()
  for ((i = 0; i < ${#args[@]}; ++i)); do
    case "${args[i]}" in
      --max-restarts) DTRAIN_MAX_RESTARTS=${args[i + 1]:-}; ((++i)) ;;
      --max-restarts=*) DTRAIN_MAX_RESTARTS=${args[i]#--max-restarts=} ;;
      *) DTRAIN_USER_ARGS+=("${args[i]}") ;;
    esac
  done
  [[ $DTRAIN_MAX_RESTARTS =~ ^[0-9]+$ ]] || { dtrain_log "--max-restarts must be a count, got '$DTRAIN_MAX_RESTARTS'"; exit 2; }
}

# dtrain_restart_wanted RC RESTARTS: whether a run that ended with RC, after RESTARTS relaunches
# inside this allocation, is relaunched again: a lost rank or node (status 1, or the launcher's or
# a signal's), not success, bad input (2), divergence (3) or a preemption (requeued instead).
dtrain_restart_wanted() {
  case "$1" in 0 | 2 | 3 | "$DTRAIN_PREEMPTED_EXIT") return 1 ;; esac
  (($2 < DTRAIN_MAX_RESTARTS))
}

# dtrain_record_restart N LOST RANKS NODES: says in the log and the metrics that relaunch N (of
# DTRAIN_MAX_RESTARTS) starts RANKS ranks on NODES after LOST (nodes, or "none": a rank failed on a
# node that still answers), resuming from the newest checkpoint; the steps lost are those the
# metrics had logged past it (at least that many; --log-every bounds the rest).
dtrain_record_restart() {
  local n=$1 lost=$2 ranks=$3 nodes=$4 newest last resume=0 metrics
  newest=$(dtrain_newest_set "$DTRAIN_CKPT_DIR")
  [[ -n $newest ]] && resume=$((10#$(basename "$newest" .h5 | sed 's/^ckpt-step//; s/[^0-9].*//')))
  metrics=$(dtrain_option metrics "${DTRAIN_TRAIN_ARGS[@]:1}")
  metrics=${metrics:-$DTRAIN_METRICS}
  last=$(grep -o '"step": [0-9]*' "$metrics" 2>/dev/null | tail -1 | grep -o '[0-9]*$' || true)
  last=${last:-$resume}
  local lost_steps=$((last > resume ? last - resume : 0))
  dtrain_log "restart $n/$DTRAIN_MAX_RESTARTS inside the allocation: lost $lost; $ranks ranks on $nodes resume from step $resume (at least $lost_steps steps lost)"
  printf '{"event": "restart", "restart": %d, "lost_nodes": "%s", "ranks": %d, "nodes": "%s", "resume_step": %d, "last_logged_step": %d, "steps_lost": %d}\n' \
    "$n" "$lost" "$ranks" "$nodes" "$resume" "$last" "$lost_steps" >>"$metrics"
}

# dtrain_run_forwarding CMD...: runs CMD in the background; SIGTERM, SIGUSR1 or SIGINT reaching this
# shell is passed on to CMD as SIGUSR1 (srun and mpirun both forward SIGUSR1 to every rank, while
# mpirun would answer SIGTERM by killing the ranks before they checkpoint). Returns CMD's status.
dtrain_run_forwarding() {
  # Which launch of the job this is (requeues.launches in this allocation): a later launch takes the
  # checkpoint folder over from an earlier one (its owner file, checkpoint_owner.h).
  DTRAIN_LAUNCHES=$((${DTRAIN_LAUNCHES:-0} + 1))
  export DTRAIN_LAUNCH="${SLURM_RESTART_COUNT:-${PBS_RUN_COUNT:-0}}.$DTRAIN_LAUNCHES"
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

#!/usr/bin/env bash
# Launches `dtrain train` with mpirun over the hosts of a hostfile (or this host), checkpointing
# into a run folder: a new one per launch (runs/mpirun-<date>-<time>-<pid>), or DTRAIN_RUN_DIR, from
# whose checkpoints a launch resumes. A SIGTERM/SIGUSR1/SIGINT to this script makes every rank
# checkpoint at its next step and the script exit with 42 (launch again with the DTRAIN_RUN_DIR it
# names to resume).
#
# usage: [VAR=value ...] cluster/mpirun/launch.sh [dtrain train options]
#   DTRAIN_HOSTFILE    Open MPI hostfile ("node01 slots=4" per line; a host repeated once per slot
#                      also works); unset: this host only
#   DTRAIN_NP          ranks (default: the slots of the hostfile, else 2)
#   DTRAIN_MPIRUN      the mpirun command (default: mpirun)
#   DTRAIN_MPIRUN_ARGS extra mpirun options (default: --bind-to none, so each rank can run threads)
#   DTRAIN_RUN_DIR     checkpoints and metrics (default: a new ./runs/mpirun-<date>-<time>-<pid>;
#                      an earlier launch's folder resumes that run)
#   and those of cluster/common/job.sh (DTRAIN_BIN, DTRAIN_ARGS, DTRAIN_CKPT_DIR, DTRAIN_METRICS).
set -euo pipefail
DTRAIN_HOME=${DTRAIN_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=../common/job.sh
source "$DTRAIN_HOME/cluster/common/job.sh"

DTRAIN_RUN_DIR=${DTRAIN_RUN_DIR:-$PWD/runs/mpirun-$(date +%Y%m%d-%H%M%S)-$$}
mpirun_cmd=(${DTRAIN_MPIRUN:-mpirun})
read -r -a mpirun_extra <<<"${DTRAIN_MPIRUN_ARGS:---bind-to none}"

np=${DTRAIN_NP:-}
if [[ -n "${DTRAIN_HOSTFILE:-}" ]]; then
  [[ -r "$DTRAIN_HOSTFILE" ]] || { dtrain_log "DTRAIN_HOSTFILE '$DTRAIN_HOSTFILE' cannot be read"; exit 2; }
  if [[ -z "$np" ]]; then
    # Slots: "slots=N" where given, one per line otherwise; comments and blank lines skipped.
    np=$(awk '!/^[[:space:]]*(#|$)/ { n = 1; for (i = 2; i <= NF; ++i) if ($i ~ /^slots=/) { sub(/^slots=/, "", $i); n = $i }; s += n } END { print s + 0 }' "$DTRAIN_HOSTFILE")
  fi
  mpirun_extra+=(--hostfile "$DTRAIN_HOSTFILE")
fi
np=${np:-2}
[[ "$np" =~ ^[1-9][0-9]*$ ]] || { dtrain_log "DTRAIN_NP must be a positive integer, got '$np'"; exit 2; }

dtrain_find_bin
dtrain_train_args "$@"
dtrain_log "$np ranks, run folder $DTRAIN_RUN_DIR"
set +e
dtrain_run_forwarding "${mpirun_cmd[@]}" -n "$np" -x DTRAIN_LAUNCH "${mpirun_extra[@]}" "$DTRAIN_BIN" "${DTRAIN_TRAIN_ARGS[@]}"
rc=$?
set -e
if [[ $rc -eq $DTRAIN_PREEMPTED_EXIT ]]; then
  dtrain_log "preempted: checkpoint in $DTRAIN_CKPT_DIR; resume with DTRAIN_RUN_DIR=$DTRAIN_RUN_DIR and the same command"
fi
dtrain_log "ends with status $rc: $(dtrain_status_text "$rc")"
exit "$rc"

#!/usr/bin/env bash
# Starts a real one-node SLURM on this host for tests and trials: munged, slurmctld and slurmd,
# all as root, all state under one folder, on their own ports and munge socket so that a SLURM
# already installed on the machine is left alone. Stop it with cluster/slurm/local/stop.sh.
#
# usage: cluster/slurm/local/start.sh [DIR]      (DIR default: $DTRAIN_SLURM_DIR or /tmp/dtrain-slurm)
#   then: source DIR/env.sh; sbatch ...; squeue
# Environment: DTRAIN_SLURM_PORT (slurmctld port, default 16817; slurmd uses the next one),
#   DTRAIN_SLURM_TIMEOUT (seconds to wait for the node to come up, default 60).
# Exit status: 0 up; 77 cannot run here (not root, or the Debian packages slurmctld, slurmd, munge
# are not installed) so tests can report "skipped"; 1 a daemon failed (its log is printed).
set -euo pipefail
dir=${1:-${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}}
port=${DTRAIN_SLURM_PORT:-16817}
timeout=${DTRAIN_SLURM_TIMEOUT:-60}
say() { echo "slurm-local: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then say "needs root (slurmd runs jobs as their users)"; exit 77; fi
for b in munged slurmctld slurmd sbatch sinfo scontrol; do
  command -v "$b" >/dev/null 2>&1 || { say "$b not found (apt-get install slurmctld slurmd munge)"; exit 77; }
done
if [[ -f "$dir/env.sh" ]] && [[ -f "$dir/slurmctld.pid" ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
  say "already running in $dir"; exit 0
fi

# The folder is emptied only when this script made it (its marker file is there): a DIR the user
# named that holds anything else is refused, never removed.
marker=.dtrain-slurm-local
if [[ -d "$dir" && -n "$(ls -A "$dir")" && ! -f "$dir/$marker" ]]; then
  say "$dir holds files this script did not make (no $marker): give an empty or new folder"; exit 1
fi
[[ -f "$dir/$marker" ]] && rm -rf "$dir"
mkdir -p "$dir"
touch "$dir/$marker"
source "$(dirname "$0")/lib.sh"
node=$(hostname -s)
slurm_local_write_conf "$dir" "$port" "$node(127.0.0.1)" "$dir/slurmd.pid" "$node:127.0.0.1"
cat >"$dir/env.sh" <<ENV
export SLURM_CONF=$dir/slurm.conf
ENV
export SLURM_CONF=$dir/slurm.conf

fail() {
  say "$1"
  for f in "$dir"/log/*.log; do echo "== $f"; tail -20 "$f"; done >&2
  "$(dirname "$0")/stop.sh" "$dir" || true
  exit 1
}

slurm_local_start_munge "$dir" || fail "munged did not start"
slurmctld -f "$dir/slurm.conf" || fail "slurmctld did not start"
slurmd -f "$dir/slurm.conf" -N "$node" || fail "slurmd did not start"

slurm_local_wait_idle "$timeout" "$node" || fail "node $node did not become idle in ${timeout}s"
say "up in $dir ($node: idle); source $dir/env.sh"

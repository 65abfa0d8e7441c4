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

rm -rf "$dir"
mkdir -p "$dir"/{state,spool,log,munge}
chmod 700 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"

node=$(hostname -s)
# The node's real shape (CPUs, sockets, memory) so slurmd registers without a mismatch.
shape=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //')
cat >"$dir/slurm.conf" <<CONF
ClusterName=dtrain-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 $shape State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
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

munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" ||
  fail "munged did not start"
slurmctld -f "$dir/slurm.conf" || fail "slurmctld did not start"
slurmd -f "$dir/slurm.conf" -N "$node" || fail "slurmd did not start"

for ((i = 0; i < timeout * 2; ++i)); do
  state=$(sinfo -h -N -n "$node" -o '%T' 2>/dev/null || true)
  case "$state" in
    idle*) say "up in $dir ($node: idle); source $dir/env.sh"; exit 0 ;;
    down* | drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.5
done
fail "node $node did not become idle in ${timeout}s (state '${state:-none}')"

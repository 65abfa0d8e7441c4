# Shared by the one-node SLURM (cluster/slurm/local/) and the emulated cluster's multi-node SLURM
# (cluster/emulate/slurm.sh): the configuration, munge, waiting for nodes, stopping (sourced).

# slurm_local_write_conf DIR PORT CONTROLLER SLURMD_PIDFILE NODE:ADDR...: DIR/slurm.conf for a
# SLURM run as root with all state under DIR: slurmctld on CONTROLLER ("name(address)"), one node
# per NODE:ADDR with this host's real shape, one default partition; DIR/mpi.conf puts PMIx's client
# folders under the node's /var/tmp.
slurm_local_write_conf() {
  local dir=$1 port=$2 controller=$3 slurmd_pid=$4
  shift 4
  local shape names=() spec
  # The real shape (CPUs, sockets, memory) so slurmd registers without a mismatch.
  shape=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ *UpTime=.*//')
  mkdir -p "$dir"/{state,spool,log}
  cat >"$dir/slurm.conf" <<CONF
ClusterName=dtrain-local
SlurmctldHost=$controller
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
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
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
CONF
  for spec in "$@"; do
    echo "NodeName=${spec%%:*} NodeAddr=${spec#*:} $shape State=UNKNOWN" >>"$dir/slurm.conf"
    names+=("${spec%%:*}")
  done
  local IFS=,
  echo "PartitionName=local Nodes=${names[*]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$dir/slurm.conf"
  echo "PMIxCliTmpDirBase=/var/tmp" >"$dir/mpi.conf"
}

# slurm_local_start_munge DIR: munged with a fresh key and its socket under DIR/munge.
slurm_local_start_munge() {
  local dir=$1
  mkdir -p "$dir/munge"
  chmod 700 "$dir/munge"
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
}

# slurm_local_wait_idle SECONDS NODE...: waits until every NODE is idle (resuming nodes SLURM put
# down at registration); prints the states and fails if they are not idle in time.
slurm_local_wait_idle() {
  local timeout=$1 i node state all
  shift
  for ((i = 0; i < timeout * 2; ++i)); do
    all=1
    for node in "$@"; do
      state=$(sinfo -h -N -n "$node" -o '%T' 2>/dev/null || true)
      case "$state" in
        idle*) ;;
        down* | drain*) all=0; scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
        *) all=0 ;;
      esac
    done
    ((all)) && return 0
    sleep 0.5
  done
  echo "nodes not idle after ${timeout}s: $(sinfo -h -N -o '%N %T' 2>/dev/null | tr '\n' ' ')" >&2
  return 1
}

# slurm_local_kill PIDFILE...: ends each daemon named by a pid file (TERM, KILL after 10 s).
slurm_local_kill() {
  local pidfile pid
  for pidfile in "$@"; do
    [[ -f "$pidfile" ]] || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  done
  return 0
}

#!/usr/bin/env bash
# Starts an emulated cluster on this host: N nodes, each a network namespace with its own address,
# hostname and private /var/tmp (a holder process keeps its namespaces alive), joined by a bridge
# in a "switch" namespace, each node's link optionally limited to a rate by tc's token bucket.
# Nothing is added to the host's own network namespace. Optionally a multi-node SLURM runs on the
# nodes (slurmctld on the first, one slurmd per node). Stop it with cluster/emulate/stop.sh.
#
# usage: cluster/emulate/start.sh [--nodes N] [--rate RATE] [--slurm] [DIR]
#   N      nodes (default 2), named ${DTRAIN_EMU_PREFIX:-emu}1 ... ${prefix}N
#   RATE   each node's link rate in tc's units (100mbit, 1gbit, 10gbit; default: unlimited);
#          cluster/emulate/link.sh changes it (or takes a link down) while the cluster runs
#   DIR    state folder (default $DTRAIN_EMU_DIR or /tmp/dtrain-emu); DIR/env.sh gives
#          DTRAIN_EMU_DIR, DTRAIN_EMU_NODES, DTRAIN_EMU_SUBNET and, with --slurm, SLURM_CONF
# Inside the nodes, mpirun reaches the other nodes as on a configured cluster (the nodes' Open MPI
# site configuration names on.sh as the rsh agent and the cluster's subnet for TCP):
#   cluster/emulate/on.sh emu1 mpirun --host emu1:2,emu2:2 -n 4 build/dtrain info --all-ranks
# Environment: DTRAIN_EMU_SUBNET (first three octets, default 10.213.7), DTRAIN_EMU_PREFIX.
# Run a command on a node with cluster/emulate/on.sh NODE CMD... (also mpirun's rsh agent).
# Starting again with the same DIR and shape does nothing; another shape restarts the cluster.
# Exit status: 0 up; 77 cannot run here (not root, no network namespaces, tools missing) so tests
# can report "skipped"; 1 something failed (the cluster is stopped again).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
nodes=2 rate="" slurm=0 dir=${DTRAIN_EMU_DIR:-/tmp/dtrain-emu}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --slurm) slurm=1; shift ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "emulate: unknown option '$1'" >&2; exit 2 ;;
    *) dir=$1; shift ;;
  esac
done
source "$here/lib.sh"
[[ "$nodes" =~ ^[1-9][0-9]?$ ]] || { emu_say "--nodes must be 1 to 99, got '$nodes'"; exit 2; }

emu_can_run || exit 77
shape="nodes=$nodes rate=${rate:-none} slurm=$slurm prefix=$EMU_PREFIX subnet=$EMU_SUBNET"
if [[ -f "$dir/shape" && "$(cat "$dir/shape")" == "$shape" ]] && emu_alive "$dir"; then
  emu_say "already running in $dir ($shape)"; exit 0
fi
# DIR is removed and remade only when this script made it (its marker file): a folder the user
# named that holds anything else is refused, never removed.
if [[ -d "$dir" && -n "$(ls -A "$dir")" && ! -f "$dir/.dtrain-emu" ]]; then
  emu_say "$dir holds files this script did not make (no .dtrain-emu): give an empty or new folder"; exit 1
fi
"$here/stop.sh" "$dir" 2>/dev/null || true
mkdir -p "$dir"
touch "$dir/.dtrain-emu"
trap 'emu_say "start failed; cleaning up"; "$here/stop.sh" "$dir" || true' ERR

emu_make_network "$dir" "$nodes" "$rate"
emu_write_site_config "$dir"
for ((i = 1; i <= nodes; ++i)); do emu_start_node "$dir" "$i"; done
emu_write_env "$dir" "$nodes"
[[ $slurm -eq 1 ]] && "$here/slurm.sh" "$dir"
echo "$shape" >"$dir/shape"
trap - ERR
emu_say "up in $dir: $(emu_node_names "$nodes") on $EMU_SUBNET.0/24, link ${rate:-unlimited}; source $dir/env.sh"

#!/usr/bin/env bash
# A multi-node SLURM on the running emulated cluster (start.sh --slurm calls it): munged with its
# socket in the shared folder, slurmctld on the first node, one slurmd per node (`slurmd -N NODE`
# inside it, its pid file and PMIx client folders in the node's own /var/tmp). Submit from a node:
#   source DIR/env.sh; cluster/emulate/on.sh emu1 sbatch -N 2 ...
# usage: cluster/emulate/slurm.sh DIR | --stop DIR     (DTRAIN_EMU_SLURM_PORT, default 16837)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"
source "$here/../slurm/local/lib.sh"
stop=0
[[ "${1:-}" == --stop ]] && { stop=1; shift; }
[[ "${1:-}" == --wait-idle ]] && { slurm_local_wait_idle "$2" $(cat "$3/node-names"); exit; }
dir=${1:?usage: slurm.sh DIR | --stop DIR}
slurm=$dir/slurm
nodes=$(tr "\n" " " <"$dir/node-names")
nodes=${nodes% }
export DTRAIN_EMU_DIR=$dir SLURM_CONF=$slurm/slurm.conf
first=${nodes%% *}

if ((stop)); then
  "$here/on.sh" "$first" scancel --full --quiet --user=root 2>/dev/null || true
  for node in $nodes; do slurm_local_kill "$(emu_node_dir "$dir" "$node")/var-tmp/slurmd.pid"; done
  slurm_local_kill "$slurm/slurmctld.pid" "$slurm/munged.pid"
  exit 0
fi

for b in munged slurmctld slurmd sbatch sinfo scontrol; do
  command -v "$b" >/dev/null 2>&1 || { emu_say "$b not found (apt-get install slurmctld slurmd munge)"; exit 77; }
done
specs=()
i=1
for node in $nodes; do specs+=("$node:$EMU_SUBNET.$i"); i=$((i + 1)); done
slurm_local_write_conf "$slurm" "${DTRAIN_EMU_SLURM_PORT:-16837}" "$first($EMU_SUBNET.1)" /var/tmp/slurmd.pid "${specs[@]}"
fail() {
  emu_say "SLURM: $1"
  for f in "$slurm"/log/*.log; do echo "== $f"; tail -20 "$f"; done >&2
  exit 1
}
slurm_local_start_munge "$slurm" || fail "munged did not start"
"$here/on.sh" "$first" slurmctld -f "$SLURM_CONF" </dev/null || fail "slurmctld did not start"
for node in $nodes; do
  "$here/on.sh" "$node" slurmd -f "$SLURM_CONF" -N "$node" </dev/null >/dev/null 2>&1 || fail "slurmd on $node did not start"
done
"$here/on.sh" "$first" "$0" --wait-idle "${DTRAIN_EMU_SLURM_TIMEOUT:-60}" "$dir" || fail "the nodes did not become idle"
echo "export SLURM_CONF=$SLURM_CONF" >>"$dir/env.sh"
emu_say "SLURM up: slurmctld on $first, slurmd on $nodes"

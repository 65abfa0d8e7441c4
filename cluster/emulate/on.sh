#!/usr/bin/env bash
# Runs a command on a node of the emulated cluster, as ssh would: the words after the node are
# joined into one command line for sh, run in the node's namespaces (network, hostname, mounts)
# with this environment. mpirun uses it as its rsh agent (--mca plm_rsh_agent).
# usage: cluster/emulate/on.sh NODE|ADDRESS COMMAND...   (cluster folder: $DTRAIN_EMU_DIR or /tmp/dtrain-emu)
set -euo pipefail
dir=${DTRAIN_EMU_DIR:-/tmp/dtrain-emu}
[[ $# -ge 2 ]] || { echo "usage: on.sh NODE COMMAND..." >&2; exit 2; }
node=$1
shift
if [[ ! -f "$dir/nodes/$node/pid" ]]; then
  # An address: the node whose name /etc/hosts of the cluster gives it.
  name=$(awk -v a="$node" '$1 == a { print $2 }' "$dir/hosts" 2>/dev/null || true)
  [[ -n "$name" ]] && node=$name
fi
pid=$(cat "$dir/nodes/$node/pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null ||
  { echo "emulate: no running node '$node' in $dir" >&2; exit 255; }
exec nsenter -t "$pid" --net --uts --mount -- sh -c "$*"

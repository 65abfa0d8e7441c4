#!/usr/bin/env bash
# Stops the emulated cluster started by start.sh: its SLURM if any, every process inside its
# nodes, the nodes' and the switch's network namespaces; removes DIR (DTRAIN_EMU_KEEP=1 keeps it).
# Safe to run again, or on a half-started cluster.
# usage: cluster/emulate/stop.sh [DIR]   (default $DTRAIN_EMU_DIR or /tmp/dtrain-emu)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:-${DTRAIN_EMU_DIR:-/tmp/dtrain-emu}}
source "$here/lib.sh"
[[ -f "$dir/slurm/slurm.conf" ]] && "$here/slurm.sh" --stop "$dir"

nodes=$(cat "$dir/node-names" 2>/dev/null || true)
for node in $nodes; do
  # Every process in the node's network namespace (ranks, orted, slurmd, the holder).
  pids=$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ')
  [[ -n "${pids// /}" ]] && kill -KILL $pids 2>/dev/null
done
for node in $nodes; do ip netns del "$node" 2>/dev/null; done
ip netns del "$EMU_SWITCH" 2>/dev/null
[[ "${DTRAIN_EMU_KEEP:-0}" == "1" || ! -f "$dir/.dtrain-emu" ]] || rm -rf "$dir"  # only a folder start.sh made
[[ -n "$nodes" ]] && emu_say "stopped ($dir)"
exit 0

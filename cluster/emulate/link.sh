#!/usr/bin/env bash
# Changes a node's link on the running emulated cluster: a rate (tc token bucket, both
# directions), no limit, or the link down (the node drops off the network; its processes live on)
# and up again.
# usage: cluster/emulate/link.sh NODE RATE|none|down|up   (e.g. emu2 100mbit; folder: $DTRAIN_EMU_DIR)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"
[[ $# -eq 2 ]] || { echo "usage: link.sh NODE RATE|none|down|up" >&2; exit 2; }
node=$1
ip netns pids "$node" >/dev/null 2>&1 || { emu_say "no node '$node'"; exit 2; }
case "$2" in
  down | up) ip -n "$node" link set eth0 "$2" ;;
  *) emu_set_rate "$node" "$2" ;;
esac
emu_say "$node link: $2"

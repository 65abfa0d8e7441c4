#!/usr/bin/env bash
# Stops the one-node SLURM started by start.sh: cancels its jobs, then ends slurmd, slurmctld and
# munged by the process ids in their pid files, and removes the folder (only one start.sh made).
# usage: cluster/slurm/local/stop.sh [DIR]   (same default as start.sh); DTRAIN_SLURM_KEEP=1 keeps DIR
set -uo pipefail
dir=${1:-${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}}
[[ -d "$dir" ]] || exit 0
if [[ -f "$dir/slurm.conf" ]]; then SLURM_CONF=$dir/slurm.conf scancel --full --quiet --user="$(id -un)" 2>/dev/null; fi
source "$(dirname "$0")/lib.sh"
slurm_local_kill "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"
# Only a folder start.sh made (its marker) is removed.
[[ "${DTRAIN_SLURM_KEEP:-0}" == "1" || ! -f "$dir/.dtrain-slurm-local" ]] || rm -rf "$dir"
echo "slurm-local: stopped ($dir)" >&2

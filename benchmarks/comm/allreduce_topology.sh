#!/usr/bin/env bash
# The topology-aware allreduce against Open MPI, side by side (dtrain bench allreduce alternates
# the algorithms and raw MPI_Allreduce iteration by iteration, so every row sees the same load):
#   1. one node, 2 ranks: --allreduce mpi,shm,auto against Open MPI's default MPI_Allreduce;
#   2. an emulated cluster of 2 nodes x 2 ranks (cluster/emulate, root only) at each link rate:
#      --allreduce mpi,hier,auto against Open MPI's default (flat tuned) MPI_Allreduce, then
#      --allreduce hier against Open MPI's hierarchical component (--mca coll_han_priority 100).
# Tables go to OUT/*.txt, the f32 busBw ratios at 64 MiB to stdout.
# usage: benchmarks/comm/allreduce_topology.sh [--dtrain BIN] [--out DIR] [--rates 1gbit,10gbit]
#        [--max-bytes 64M] [--iters N]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build/dtrain out=$root/runs/allreduce-topology rates=1gbit,10gbit max=64M iters=10
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dtrain) bin=$(realpath "$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --max-bytes) max=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    *) echo "allreduce_topology.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(realpath "$out")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bench=(bench allreduce -b 64K -e "$max" -f 4 --iters "$iters" --warmup 2 --check)
summary() { grep -E '^# f32 busBw|dtrain bench allreduce:' "$1" | sed "s|^|$2: |"; }

mpirun -n 2 --bind-to core "$bin" "${bench[@]}" --allreduce mpi,shm,auto >"$out/one-node.txt"
summary "$out/one-node.txt" "1 node x 2 ranks, vs Open MPI default"

emulate=$root/cluster/emulate
export DTRAIN_EMU_DIR=$out/emu
if ! "$emulate/start.sh" --nodes 2 "$DTRAIN_EMU_DIR" >"$out/emulate.log" 2>&1; then
  echo "the emulated cluster cannot start here (root and network namespaces needed): $out/emulate.log"
  exit 0
fi
trap '"$emulate/stop.sh" "$DTRAIN_EMU_DIR" >/dev/null 2>&1 || true' EXIT
# The emulated nodes share this host's cores: with more ranks than cores, waiting ranks must yield
# (Open MPI does so by itself only when it knows it oversubscribes). Without it every algorithm ran
# 1.6-2x slower at 10gbit, TCP starved by the spinning ranks, and HAN 20-35x.
hosts=(--host emu1:2,emu2:2 -n 4 --bind-to none --mca mpi_yield_when_idle 1)
for rate in ${rates//,/ }; do
  for node in emu1 emu2; do "$emulate/link.sh" "$node" "$rate" >/dev/null; done
  "$emulate/on.sh" emu1 mpirun "${hosts[*]}" "$bin" "${bench[*]}" --allreduce mpi,hier,auto \
    >"$out/two-nodes-$rate.txt"
  summary "$out/two-nodes-$rate.txt" "2 nodes x 2 ranks at $rate, vs Open MPI default"
  "$emulate/on.sh" emu1 mpirun "${hosts[*]}" --mca coll_han_priority 100 "$bin" "${bench[*]}" --allreduce hier \
    >"$out/two-nodes-$rate-han.txt"
  summary "$out/two-nodes-$rate-han.txt" "2 nodes x 2 ranks at $rate, vs Open MPI HAN"
done

#!/usr/bin/env bash
# ZeRO-3 across nodes against ZeRO-3 sharded within each node (--shard-scope node), on an emulated
# cluster of 2 nodes x 2 ranks whose links run at RATE (default 1gbit). Across nodes every unit's
# all-gathers and reduce-scatters cross the link; within the node only each block's average between
# the nodes does. The GPT on the fortunes corpus, the same steps in both runs, alternating over
# ROUNDS rounds, each layout's best kept. Root only (network namespaces). Prints a markdown table
# with tokens/s, the ratio, the final loss and each rank's model state.
# usage: benchmarks/zero/shard_scope.sh [--dtrain BIN] [--out DIR] [--rate 1gbit] [--model 6x512]
#        [--steps 12] [--rounds 2]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build/dtrain out=$root/runs/shard-scope rate=1gbit model=6x512 steps=12 rounds=2
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dtrain) bin=$(realpath "$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "shard_scope.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(realpath "$out")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f $out/tokens/train.h5 ]] || "$bin" convert text --inputs /usr/share/games/fortunes --out "$out/tokens" >/dev/null

emulate=$root/cluster/emulate
export DTRAIN_EMU_DIR=$out/emu
"$emulate/start.sh" --nodes 2 --rate "$rate" "$DTRAIN_EMU_DIR" >"$out/emulate.log" 2>&1 ||
  { echo "the emulated cluster cannot start here (root and network namespaces needed): $out/emulate.log"; exit 1; }
trap '"$emulate/stop.sh" "$DTRAIN_EMU_DIR" >/dev/null 2>&1 || true' EXIT

layers=${model%x*} width=${model#*x}
args="train --model gpt --data $out/tokens --layers $layers --width $width --heads $((width / 64)) --context 64"
args+=" --batch-size 4 --steps $steps --eval-every 0 --log-every $steps --warmup-steps 1 --threads 1 --progress off"
args+=" --zero 3 --memory-report true"
declare -A best loss state
for ((round = 0; round < rounds; ++round)); do
  for scope in all node; do
    log=$out/$scope-$round.log
    # The emulated nodes share the host's cores: the ranks yield while they wait, or the spinning
    # ones starve TCP (as in benchmarks/comm/).
    "$emulate/on.sh" emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none --mca mpi_yield_when_idle 1 \
      "$bin" $args --shard-scope "$scope" >"$log" 2>&1 || { cat "$log"; exit 1; }
    tps=$(grep -o '[0-9.]* tokens/s, first step' "$log" | grep -o '^[0-9.]*')
    awk -v a="$tps" -v b="${best[$scope]:-0}" 'BEGIN { exit !(a > b) }' && best[$scope]=$tps
    loss[$scope]=$(grep -o "^step $steps/$steps loss [0-9.]*" "$log" | grep -o '[0-9.]*$')
    state[$scope]=$(grep -o 'memory of rank 0 (MiB): model state [0-9.]*' "$log" | grep -o '[0-9.]*$')
  done
done
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); 2 emulated nodes x 2 ranks, links at $rate;"
echo "GPT $model, batch 4 x context 64 per rank, $steps steps, best of $rounds alternating rounds"
echo
echo "| --shard-scope | tokens/s | x across nodes | final loss | model state rank 0 MiB |"
echo "| --- | --- | --- | --- | --- |"
for scope in all node; do
  ratio=$(awk -v a="${best[$scope]}" -v b="${best[all]}" 'BEGIN { printf "%.3f", a / b }')
  echo "| $scope | ${best[$scope]} | $ratio | ${loss[$scope]} | ${state[$scope]} |"
done

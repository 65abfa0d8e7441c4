#!/usr/bin/env bash
# Time to a test accuracy with and without gradient compression between nodes, on an emulated
# cluster of 2 nodes x 2 ranks whose links run at RATE (default 100mbit), for a model whose
# gradient exchange dominates the step (an MLP of 1024,1024 hidden units: 7.5 MB of gradients).
# Runs: none (the exact hierarchical allreduce), then each compressor with --compression-scope
# inter-node (exact within a node, compressed between nodes). Every run trains on a 20,000-sample
# part of Fashion-MNIST's training set, so its "epoch" (78 steps of 256) ends with a full test-set
# evaluation; the time to the target is the trainer's train_time_s (evaluation excluded) at the
# first evaluation that reaches it. Root only (network namespaces). Prints a markdown table.
# usage: benchmarks/comm/compression_scope.sh [--dtrain BIN] [--out DIR] [--rate 100mbit]
#        [--target 84] [--epochs 5] [--compressors topk:0.01,powersgd:4]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build/dtrain out=$root/runs/compression-scope rate=100mbit target=84 epochs=5
compressors=topk:0.01,powersgd:4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dtrain) bin=$(realpath "$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --target) target=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --compressors) compressors=$2; shift 2 ;;
    *) echo "compression_scope.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(realpath "$out")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The data: Fashion-MNIST in shards of 10,000; two training shards make the short epoch.
data=$out/data
if [[ ! -f $data/test/shard-00000.h5 ]]; then
  "$bin" convert fashion-mnist --out "$data/full" --shard-size 10000 >/dev/null
  mkdir -p "$data/train"
  ln -sf "$data/full/train/shard-00000.h5" "$data/full/train/shard-00001.h5" "$data/train/"
  ln -sfn "$data/full/test" "$data/test"
fi

emulate=$root/cluster/emulate
export DTRAIN_EMU_DIR=$out/emu
"$emulate/start.sh" --nodes 2 --rate "$rate" "$DTRAIN_EMU_DIR" >"$out/emulate.log" 2>&1 ||
  { echo "the emulated cluster cannot start here (root and network namespaces needed): $out/emulate.log"; exit 0; }
trap '"$emulate/stop.sh" "$DTRAIN_EMU_DIR" >/dev/null 2>&1 || true' EXIT

args="train --model mlp --hidden 1024,1024 --data $data/train --test-data $data/test --epochs $epochs"
args+=" --batch-size 64 --optimizer sgd --lr 0.05 --momentum 0.9 --lr-schedule constant --normalize true"
args+=" --threads 1 --progress off --log-every 50 --seed 42 --compression-warmup 10"
echo "| exchange | time to ${target} % (s) | s/step | final test accuracy | bytes sent/rank/step |"
echo "| --- | --- | --- | --- | --- |"
for c in none ${compressors//,/ }; do
  name=${c//:/-}
  extra="--compression $c"
  [[ $c != none ]] && extra+=" --compression-scope inter-node"
  # A finished run (its metrics end with the summary) is kept: delete OUT/NAME.jsonl to rerun it.
  if ! grep -q '"summary"' "$out/$name.jsonl" 2>/dev/null; then
    rm -f "$out/$name.jsonl"
    # The emulated nodes share the host's cores: the 4 ranks yield while they wait (as in
    # allreduce_topology.sh), or the spinning ones starve TCP.
    "$emulate/on.sh" emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none --mca mpi_yield_when_idle 1 "$bin" $args $extra \
      --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
  fi
  /usr/bin/python3 - "$out/$name.jsonl" "$target" "$c" <<'EOF'
import json, sys
path, target, name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(path) if l.strip()]
evals = [r for r in rows if "test_accuracy" in r and "train_time_s" in r]
hit = next((r for r in evals if 100 * r["test_accuracy"] >= target), None)
last = evals[-1]
per_step = last["train_time_s"] / last["step"]
logged = [r["bytes_sent_per_step"] for r in rows if "bytes_sent_per_step" in r]
sent = logged[-1] if logged else "-"
t = f"{hit['train_time_s']:.1f}" if hit else "not reached"
print(f"| {name} | {t} | {per_step:.3f} | {100 * last['test_accuracy']:.2f} % | {sent} |")
EOF
done

#!/usr/bin/env bash
# benchmarks/scaling/scaling.py on the emulated cluster (cluster/emulate, label multinode): the MLP
# weak-scaled 1 -> 2 (one rank per node) -> 4 ranks (two per node) over a 1 Gbit/s link, the intra-
# and inter-node benchmarks, the algorithm check and the two-level model. Checks each run's
# placement, that the link's rate bounds the inter-node fit, and that the model predicts every
# 2-node run (its error is printed: a figure for the benchmark, which load moves). Exit 77 (skipped) where the cluster cannot run (not root, no network namespaces) or
# without python3 and numpy; DTRAIN_REQUIRE_MULTINODE=1 makes the first a failure.
# usage: scaling_multinode.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
[[ -x $py ]] && $py -c 'import numpy' 2>/dev/null || { echo "SKIP: no /usr/bin/python3 with numpy"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
# Its own node names and subnet, so that it cannot meet another emulated cluster on this host.
export DTRAIN_EMU_PREFIX=${DTRAIN_EMU_PREFIX:-scl} DTRAIN_EMU_SUBNET=${DTRAIN_EMU_SUBNET:-10.213.8}
rm -rf "$work"
rc=0
$py "$root/benchmarks/scaling/scaling.py" all --dtrain "$bin" --out "$work" --emulate-nodes 2 --link-rates 1gbit \
  --ranks 1,2,4 --models mlp --mode weak --batch-sizes 64 --steps 200 --log-every 20 --overlap-model "" \
  --bench-max-bytes 1M --bench-iters 30 "--launcher-args=--oversubscribe --bind-to none --mca mpi_yield_when_idle 1" ||
  rc=$?
if [[ $rc -eq 77 ]]; then
  [[ "${DTRAIN_REQUIRE_MULTINODE:-0}" == "1" ]] && fail "the emulated cluster cannot run here"
  echo "SKIP: the emulated cluster cannot run here"
  exit 77
fi
[[ $rc -eq 0 ]] || fail "scaling.py all on the emulated cluster failed (status $rc)"
ip netns list | grep -q "^${DTRAIN_EMU_PREFIX}1\b" && fail "the emulated cluster was not stopped"
cat "$work/RESULTS.md"

# Placement: the rows say where each run was, and dtrain agrees.
for r in "1,1,1" "2,2,1" "4,2,2"; do
  grep -q "^weak,mlp,$r,1gbit," "$work/results.csv" || fail "results.csv: no run with ranks,nodes,ranks per node = $r"
done
for n in 2 4; do
  grep -q "dtrain: $n ranks on 2 nodes" "$work"/metrics/run*-1gbit-weak-mlp-n$n-*.jsonl.log ||
    fail "the $n-rank run was not on 2 nodes"
done

# The link governs: the inter-node fit cannot pass the link's 0.125 GB/s (whatever else runs on this
# host: load only slows it), and it is slower than the intra-node fit. How long the 2-node runs wait
# for the link depends on how much the token bucket banked during compute, which load changes, so
# it is printed, not checked.
$py - "$work" <<'EOF' || fail "the link's rate does not bound the inter-node fit"
import csv, json, sys
out = sys.argv[1]
rows = {int(r["ranks"]): r for r in csv.DictReader(open(f"{out}/results.csv"))}
levels = json.load(open(f"{out}/model.json"))["levels"]
bw, intra = levels["inter-1gbit"]["bandwidth_GBps"], levels["intra"]["bandwidth_GBps"]
wait = 1e3 * float(rows[2]["comm_wait_s"])
print(f"2 nodes x 1 rank: comm wait {wait:.2f} ms per step; fits: inter-node at 1gbit {bw:.3f} GB/s, intra {intra:.3f} GB/s")
sys.exit(0 if 0 < bw < 0.2 and bw < intra else 1)
EOF

# The two-level model: the fits, the algorithm check against the forced algorithms, and a
# prediction for every 2-node run. How close the prediction comes is a figure of the benchmark
# (benchmarks/scaling/RESULTS.md: -0 to +4 % on an idle host), not a check: another process on
# this host's two cores once moved a 4-rank step by 27 %. The test checks that each prediction exists.
grep -Eq '^- inter-1gbit \(1 rank on each of 2 nodes, over the link; .*alpha = [0-9.]+ us, 1/beta = [0-9.]+ GB/s' \
  "$work/report.md" || fail "no inter-node fit"
grep -Eq '^- intra \(2 ranks on one node; .*alpha = [0-9.]+ us, 1/beta = [0-9.]+ GB/s' "$work/report.md" ||
  fail "no intra-node fit"
grep -Eq '^\| 1gbit \| 2x2 \| 1048576 \| [0-9]+ \| [0-9]+ \| [0-9]+ \| [0-9]+ \(' "$work/report.md" ||
  fail "no algorithm check row at 1 MiB with the forced ring and Rabenseifner"
grep -Eq '^Mean absolute error at sizes from 65536 B: ring [0-9.]+ %, rabenseifner [0-9.]+ %, ompi [0-9.]+ %' \
  "$work/report.md" || fail "no algorithm check summary"
grep -Eq '^\| contended \| 1gbit \| 2 \| ' "$work/report.md" || fail "no contended error row for the 1gbit runs"
$py - "$work" <<'EOF' || fail "the two-level model did not predict every 2-node run"
import csv, math, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/model.csv")))
for r in rows:
    err = float(r["contended_step_error"])
    print(f"{r['ranks']} ranks on {r['nodes']} nodes: measured {1e3 * float(r['measured_step_s']):.2f} ms, "
          f"contended {1e3 * float(r['contended_step_s']):.2f} ms ({100 * err:+.0f} %)")
ok = [r for r in rows if int(r["nodes"]) == 2 and 0 < float(r["contended_step_s"]) < math.inf]
sys.exit(0 if len(ok) == 2 else 1)
EOF
if $py -c 'import matplotlib' 2>/dev/null; then
  for p in speedup efficiency breakdown model; do [[ -s "$work/$p.png" ]] || fail "no $p.png"; done
fi
echo "PASS"

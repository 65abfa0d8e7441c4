#!/usr/bin/env bash
# benchmarks/scaling/scaling.py end to end (`all`) on 1 and 2 ranks with tiny runs: the sweep writes
# results.csv, report.md and plots; the model fits alpha-beta, predicts every 2-rank step with its
# variants and reports their errors; the batch sweep trains on a small learnable set with a held-out
# test split and reports time to a target test accuracy. Skipped (77) without python3 and numpy.
# usage: scaling_harness.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
[[ -x $py ]] && $py -c 'import numpy' 2>/dev/null || { echo "SKIP: no /usr/bin/python3 with numpy"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
num='[0-9]+(\.[0-9]+)?'
rm -rf "$work"
launch="--launcher-args=--oversubscribe --bind-to none --mca mpi_yield_when_idle 1"
$py "$root/benchmarks/scaling/scaling.py" all --dtrain "$bin" --out "$work" --ranks 1,2 --mode strong,weak \
  --batch-sizes 64 --steps 40 --log-every 10 --bench-max-bytes 256K "$launch" \
  --overlap-model resnet20 --overlap-batch 8 --overlap-steps 10 \
  --dataset blobs --train-samples 1024 --test-samples 256 --batch-ranks 2 --epochs 3 \
  --batch-batch-sizes 32,128 --target-accuracy 0.5 --base-lr 0.05 --base-batch 32
[[ $(wc -l <"$work/results.csv") -eq 7 ]] || fail "results.csv should hold 6 runs"
grep -q "^| weak | resnet20 | 2 | 8 |" "$work/report.md" || fail "no 2-rank resnet20 (overlap) row in report.md"
grep -q '^| strong | mlp | 2 | 32 | 64 |' "$work/report.md" || fail "no 2-rank strong-scaling row in report.md"
grep -q '^## Performance model' "$work/report.md" || fail "no performance model in report.md"
grep -Eq "alpha = $num us, 1/beta = $num GB/s" "$work/report.md" || fail "no alpha-beta fit"
for v in serial calibrated contended slowest; do
  grep -Eq "^\| $v \| 3 \| $num % \| $num % \| $num % \| $num % \|" "$work/report.md" || fail "no error row for $v"
  grep -q "\"$v\"" "$work/model.json" || fail "no $v in model.json"
done
grep -q calibrated_step_s "$work/model.csv" && grep -q "^slowest,3," "$work/model_errors.csv" || fail "no model.csv or model_errors.csv"
grep -Eq '^\| 1024 \| 128 \| [0-9.]+ \| [0-9.]+ \| [0-9]+ % \| [0-9]+ % \| [0-9.]+ \|' "$work/report.md" ||
  fail "no ring/hierarchical projection to 1024 ranks"
grep -q 'held-out TEST accuracy' "$work/report.md" || fail "no batch-size sweep on test accuracy"
# Each batch row: time to target in seconds or "not reached"; at least one reaches it on this easy set.
[[ $(grep -Ec '^\| (32|128) \| ' "$work/report.md") -eq 2 ]] || fail "batch sweep should hold 2 rows"
grep -Eq '^\| (32|128) \| [^|]+ \| [^|]+ \| [^|]+ \| [^|]+ \| [0-9.]+ \| [0-9]+ \|' "$work/report.md" ||
  fail "no batch size reached the target test accuracy"
grep -q 'time_to_target_s' "$work/batch.csv" || fail "no batch.csv"
grep -q 'Produced by' "$work/RESULTS.md" || fail "no RESULTS.md"
if $py -c 'import matplotlib' 2>/dev/null; then
  for p in speedup efficiency breakdown batch_tta; do [[ -s "$work/$p.png" ]] || fail "no $p.png"; done
fi
cat "$work/RESULTS.md"
echo "PASS"

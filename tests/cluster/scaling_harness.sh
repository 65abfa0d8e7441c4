#!/usr/bin/env bash
# benchmarks/scaling/scaling.py end to end on 1 and 2 ranks (tiny runs): the sweep writes
# results.csv and report.md (and plots where matplotlib is installed), the model fits the
# alpha-beta parameters and appends its tables. Skipped (77) without python3 and numpy.
# usage: scaling_harness.sh DTRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
[[ -x $py ]] && $py -c 'import numpy' 2>/dev/null || { echo "SKIP: no /usr/bin/python3 with numpy"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work"
launch="--launcher-args=--oversubscribe --bind-to none"
$py "$root/benchmarks/scaling/scaling.py" sweep --dtrain "$bin" --out "$work" --ranks 1,2 --mode strong,weak \
  --batch-sizes 64 --steps 60 --log-every 10 "$launch"
$py "$root/benchmarks/scaling/scaling.py" model --dtrain "$bin" --out "$work" --results "$work/results.csv" \
  --bench-max-bytes 1M "$launch"
[[ $(wc -l <"$work/results.csv") -eq 5 ]] || fail "results.csv should hold 4 runs"
grep -q '^| strong | mlp | 2 | 32 | 64 |' "$work/report.md" || fail "no 2-rank strong-scaling row in report.md"
grep -q '^## Performance model' "$work/report.md" || fail "no performance model in report.md"
grep -q '^| 1024 | 128 |' "$work/report.md" || fail "no projection to 1024 ranks"
grep -q '"alpha_s"' "$work/model.json" || fail "no model.json"
if $py -c 'import matplotlib' 2>/dev/null; then
  for p in speedup efficiency breakdown; do [[ -s "$work/$p.png" ]] || fail "no $p.png"; done
fi
cat "$work/report.md"
echo "PASS"

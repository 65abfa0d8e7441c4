#!/usr/bin/env bash
# `dtrain train --trace FILE` on 2 ranks: one valid Chrome trace JSON holding both ranks' data wait,
# forward+backward, communication wait and optimizer spans for exactly --trace-steps steps; and a
# part one rank cannot write fails the job on every rank, naming it.
# usage: trace_test.sh DTRAIN_BIN WORK_DIR   (skipped, 77, without /usr/bin/python3 to read the JSON)
set -euo pipefail
bin=$1 work=$2
[[ -x /usr/bin/python3 ]] || { echo "SKIP: no /usr/bin/python3"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
# check_trace FILE: both ranks' four spans for exactly 25 steps, and no per-rank part left behind.
check_trace() {
  ls "$1".rank* 2>/dev/null && { echo "FAIL: per-rank parts left behind"; exit 1; }
  /usr/bin/python3 - "$1" <<'PY'
import collections, json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
spans = [e for e in events if e["ph"] == "X"]
count = collections.Counter((e["pid"], e["name"]) for e in spans)
for rank in (0, 1):
    for name in ("data wait", "forward+backward", "communication wait", "optimizer"):
        assert count[(rank, name)] == 25, (rank, name, count[(rank, name)])
assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}
print("PASS:", sys.argv[1], len(spans), "spans")
PY
}
mpiexec -n 2 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp --steps 40 --trace-steps 25 \
  --threads 1 --progress off --trace "$work/trace.json"
check_trace "$work/trace.json"
# The GPT's loop records the same spans (here with compressed gradients and accumulation).
mkdir -p "$work/text"
for i in $(seq 300); do echo "a line of text, number $((i % 13)), for a small GPT."; done >"$work/text/a.txt"
"$bin" convert text --inputs "$work/text" --out "$work/tok" >/dev/null
mpiexec -n 2 --oversubscribe --bind-to none "$bin" train --model gpt --data "$work/tok" --layers 1 --heads 2 \
  --width 16 --context 16 --batch-size 2 --accumulate 2 --compression powersgd:2 --steps 40 --eval-batches 2 \
  --threads 1 --trace-steps 25 --trace "$work/gpt-trace.json"
check_trace "$work/gpt-trace.json"

# A part only rank 1 cannot write (its name is taken by a directory): every rank exits non-zero
# within the time limit, the message names the part, and no merged trace appears.
rm -rf "$work" && mkdir -p "$work/trace.json.rank1"
set +e
out=$(timeout 60 mpiexec -n 2 --oversubscribe --bind-to none "$bin" train --synthetic --model mlp --steps 10 \
  --threads 1 --progress off --trace "$work/trace.json" 2>&1)
rc=$?
set -e
[[ $rc -ne 0 && $rc -ne 124 ]] || { echo "FAIL: exit $rc (124: hung) with rank 1's part unwritable"; echo "$out"; exit 1; }
grep -q "trace.json.rank1" <<<"$out" || { echo "FAIL: the message does not name rank 1's part"; echo "$out"; exit 1; }
[[ ! -e "$work/trace.json" ]] || { echo "FAIL: a merged trace without rank 1's part"; exit 1; }
echo "PASS: rank 1's unwritable part fails the job: $(grep -m1 'error' <<<"$out")"

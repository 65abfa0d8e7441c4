#!/usr/bin/env bash
# The standing GPU check: run it first whenever a GPU is at hand, and put its table in
# benchmarks/gpu/RESULTS.md with the date and the card. It builds nothing on the GPU host: it runs the
# build made on a CPU host and carried as benchmarks/gpu/pack.sh packs it (source OUT/env.sh first,
# which sets DTRAIN_EXE, MPIRUN and the libraries). Two parts:
#   1. the CUDA tests (test_kernels_cuda: every Engine op against the CPU engine);
#   2. the matrix: dp, tp 2, pp 2 (GPipe and 1F1B), ZeRO-1/2/3, each compressor, SyncBatchNorm,
#      distillation, and the Llama (tp, pp, LoRA, recompute, distillation), on one GPU with 1 rank
#      and with 2 or 4 ranks sharing it (--comm auto takes the MPI backend's host staging there),
#      in fp32, bf16 and fp16; each run 20 steps with --device cuda against the same run on CPU
#      ranks: the last step's loss within the precision's tolerance.
# Prints one table (also written to OUT_DIR/check_all.txt) and exits non-zero when a row fails.
#   benchmarks/gpu/check_all.sh [OUT_DIR]     (DTRAIN_CHECK_QUICK=1: fp32 only; on an H200 machine of 16
#   cores, 2026-11-29, 50 rows took about 8 minutes at DTRAIN_CHECK_JOBS=4, mostly the CPU references)
# DTRAIN_CHECK_ONLY=REGEX runs only the rows whose NAME/PRECISION matches (a rerun of some);
# DTRAIN_CHECK_SKIP_TESTS=1 skips part 1.
# DTRAIN_CHECK_DEVICE=sim runs the same matrix on the simulated device (CPU ranks through the device
# code path): how the script itself is checked on a machine without a GPU.
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/dtrain-check}}
mkdir -p "$OUT_DIR"
DTRAIN=${DTRAIN_EXE:-build/dtrain}
TESTS=${DTRAIN_CUDA_TESTS:-$(dirname "$DTRAIN")/test_kernels_cuda}
MPIRUN=${MPIRUN:-mpirun}
DATA=${DTRAIN_CHECK_DATA:-$(dirname "$DTRAIN")/../data/fortunes}
DEVICE=${DTRAIN_CHECK_DEVICE:-cuda}
WORK=$(mktemp -d /tmp/dtrain-check.XXXXXX)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
table="$OUT_DIR/check_all.txt"
failed=0
: >"$table"
say() { echo "$*" | tee -a "$table"; }

say "# dtrain check_all.sh, $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
say "## 1. CUDA tests ($TESTS)"
if [[ ${DTRAIN_CHECK_SKIP_TESTS:-0} == 1 ]]; then
  say "cuda tests: not run (DTRAIN_CHECK_SKIP_TESTS=1)"
elif timeout 300 "$TESTS" >"$WORK/cuda_tests.log" 2>&1; then
  say "cuda tests: passed: $(grep -oE 'PASSED[^0-9]*[0-9]+ tests?' "$WORK/cuda_tests.log" | grep -oE '[0-9]+') passed," \
    "$(grep -oE 'SKIPPED[^0-9]*[0-9]+ tests?' "$WORK/cuda_tests.log" | head -1 | grep -oE '[0-9]+' || echo 0) skipped"
else
  failed=1
  say "cuda tests: FAILED (see cuda_tests.log)"
  grep -E "FAILED|Failure|error" "$WORK/cuda_tests.log" | head -20 | tee -a "$table"
fi
cp "$WORK/cuda_tests.log" "$OUT_DIR/" 2>/dev/null

# The last step's loss of one run: "... step 20/20 loss X ...".
last_loss() { grep -oE 'step 20/20 loss [0-9.eE+-]+' "$1" | tail -1 | awk '{print $4}'; }

# row NAME RANKS PRECISION TOLERANCE ARGS...: the run on the GPU and on CPU ranks; prints one table
# row (the error lines of a failed run below it) and keeps a failed run's logs in $WORK/failed.
row() {
  local name=$1 ranks=$2 prec=$3 tol=$4
  shift 4
  # --threads: dtrain's default (the node's cores over its ranks; OMP_NUM_THREADS is not read)
  # oversubscribes the cores when several rows run at once, the likely cause of CPU references of
  # 13-126 s on a GPU host of 16 cores where this 2-core machine takes 1-3 s.
  local common=(train --steps 20 --log-every 20 --progress off --precision "$prec" --seed 7 --threads "$OMP_NUM_THREADS"
    "$@")
  local launch=("$MPIRUN" -n "$ranks" --oversubscribe --bind-to none)
  local g="$WORK/$name-$ranks-$prec-$DEVICE.log" c="$WORK/$name-$ranks-$prec-cpu.log"
  local t0=$SECONDS
  timeout 120 "${launch[@]}" "$DTRAIN" "${common[@]}" --device "$DEVICE" >"$g" 2>&1
  local gpu_s=$((SECONDS - t0))
  # fp16 and tf32 are GPU precisions; the CPU reference of fp16 rounds GEMM operands the same way.
  t0=$SECONDS
  timeout 180 "${launch[@]}" "$DTRAIN" "${common[@]}" --device cpu >"$c" 2>&1
  local cpu_s=$((SECONDS - t0))
  local lg lc verdict rel comm
  lg=$(last_loss "$g")
  lc=$(last_loss "$c")
  comm=$(sed -n 's/^dtrain: .*, comm \(.*\)$/\1/p' "$g" | head -1)
  if [[ -z $lg || -z $lc ]]; then
    verdict=FAIL
    rel=-
  else
    rel=$(awk -v a="$lg" -v b="$lc" 'BEGIN { d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b; printf "%.2e", d / (m > 1e-12 ? m : 1) }')
    verdict=$(awk -v r="$rel" -v t="$tol" 'BEGIN { print (r <= t ? "ok" : "FAIL") }')
  fi
  printf "| %-34s | %d | %-4s | %-17s | %10s | %10s | %8s | %6s | %4ss | %4ss | %-4s |\n" "$name" "$ranks" "$prec" \
    "${comm:--}" "${lg:--}" "${lc:--}" "$rel" "$tol" "$gpu_s" "$cpu_s" "$verdict"
  if [[ $verdict != ok ]]; then
    mkdir -p "$WORK/failed" && cp "$g" "$c" "$WORK/failed/"
    grep -hE "error|Error" "$g" "$c" | head -3 | sed 's/^/    /'
  fi
}

# run ROW-ARGS...: one row of the matrix (those DTRAIN_CHECK_ONLY matches), DTRAIN_CHECK_JOBS at a
# time (default 1; with more, a row's device time includes its share of the GPU and the cores).
JOBS=${DTRAIN_CHECK_JOBS:-1}
rows=0
# Stopped (by a timeout, say): the rows still running stop too, and nothing outlives the script.
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null
}
trap 'for p in $(pgrep -P $$); do kill_tree "$p"; done; exit 124' TERM INT
run() {
  [[ $1/$3 =~ ${DTRAIN_CHECK_ONLY:-.} ]] || return 0
  rows=$((rows + 1))
  local out
  out=$WORK/row-$(printf %03d "$rows")
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
  row "$@" | tee "$out" &
  ((JOBS > 1)) || wait
}

# Image runs: synthetic 1x28x28 batches (the same on both devices for one seed).
IMG=(--synthetic --synthetic-shape 1,28,28 --batch-size 32)
SGD=(--optimizer sgd --momentum 0.9 --lr 0.02)
LM=(--model gpt --data "$DATA" --layers 2 --width 64 --heads 4 --context 64 --batch-size 8 --eval-every 0
  --lr 0.002 --warmup-steps 2)
LLAMA=(--model llama --data "$DATA" --layers 2 --width 64 --heads 4 --kv-heads 2 --context 64 --batch-size 8
  --eval-every 0 --lr 0.002 --warmup-steps 2)
say "## 2. The matrix: 20 steps each, --device $DEVICE against --device cpu, last-step loss"
say "| run | ranks | prec | comm | loss $DEVICE | loss cpu | rel diff | tol | $DEVICE time | cpu time | |"
say "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"

# A teacher for distillation: a small MLP trained on the CPU, read by both students.
timeout 120 "$DTRAIN" train --model mlp --hidden 64 "${IMG[@]}" "${SGD[@]}" --steps 20 --progress off --seed 3 \
  --checkpoint-dir "$WORK/teacher" >"$WORK/teacher.log" 2>&1 || say "teacher: FAILED to train ($WORK/teacher.log)"
timeout 120 "$DTRAIN" train "${LLAMA[@]}" --steps 20 --progress off --seed 3 --checkpoint-dir "$WORK/teacher-llama" \
  >"$WORK/teacher-llama.log" 2>&1 || say "llama teacher: FAILED to train ($WORK/teacher-llama.log)"

precisions=(fp32 bf16 fp16)
[[ ${DTRAIN_CHECK_QUICK:-0} == 1 ]] && precisions=(fp32)
for prec in "${precisions[@]}"; do
  case $prec in fp32) tol=2e-3 ;; bf16) tol=3e-2 ;; fp16) tol=1e-2 ;; esac
  run dp-simple_cnn 1 "$prec" "$tol" --model simple_cnn "${IMG[@]}" "${SGD[@]}"
  run dp-simple_cnn 2 "$prec" "$tol" --model simple_cnn "${IMG[@]}" "${SGD[@]}"
  run zero1-adamw 2 "$prec" "$tol" --model simple_cnn "${IMG[@]}" --optimizer adamw --lr 0.003 --zero1 true
  run tp2-gpt 2 "$prec" "$tol" "${LM[@]}" --tp 2
  run pp2-gpipe-gpt 2 "$prec" "$tol" "${LM[@]}" --pp 2 --schedule gpipe
  run pp2-1f1b-gpt 2 "$prec" "$tol" "${LM[@]}" --pp 2 --schedule 1f1b
  run pp2-1f1b-simple_cnn 2 "$prec" "$tol" --model simple_cnn "${IMG[@]}" "${SGD[@]}" --pp 2 --schedule 1f1b
  run zero3-gpt 2 "$prec" "$tol" "${LM[@]}" --zero 3
  run llama 1 "$prec" "$tol" "${LLAMA[@]}"
  run tp2-llama 2 "$prec" "$tol" "${LLAMA[@]}" --tp 2
done
# The sharded stages (fp32; their precisions are the rows above's): ZeRO-2, ZeRO-3 with and
# without prefetch and resharding, bf16 all-gathers, with tp and pp, and on an image model.
run zero2-adamw 2 fp32 2e-3 --model simple_cnn "${IMG[@]}" --optimizer adamw --lr 0.003 --zero 2
run zero3-adamw 2 fp32 2e-3 --model simple_cnn "${IMG[@]}" --optimizer adamw --lr 0.003 --zero 3
run zero3-noprefetch-keep-gpt 2 fp32 2e-3 "${LM[@]}" --zero 3 --zero-prefetch false --reshard-after-forward false
run zero3-bf16gather-gpt 2 fp32 3e-2 "${LM[@]}" --zero 3 --zero-gather-dtype bf16
run zero3-tp2-gpt 4 fp32 2e-3 "${LM[@]}" --zero 3 --tp 2
run zero2-pp2-gpt 4 fp32 2e-3 "${LM[@]}" --zero 2 --pp 2 --schedule 1f1b
run zero3-topk-simple_cnn 2 fp32 3e-2 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --zero 3 --compression topk:0.05 \
  --compression-warmup 5
# The Llama's other layouts and recipes.
run pp2-llama 2 fp32 2e-3 "${LLAMA[@]}" --pp 2 --schedule 1f1b
run lora-llama 2 fp32 2e-3 "${LLAMA[@]}" --lora-rank 4 --lora-targets q,k,v,o
run ckpt-act-llama 2 fp32 2e-3 "${LLAMA[@]}" --checkpoint-activations true
run distill-tp2-llama 2 fp32 2e-3 "${LLAMA[@]}" --tp 2 --teacher "$WORK/teacher-llama" --distill-weight 0.5
# Every compressor, SyncBatchNorm and distillation in fp32 (their arithmetic is the precision's
# own elsewhere); lossy exchanges get the wider tolerance: a selection can flip on a rounding edge.
for c in fp16 bf16 topk:0.05 powersgd:2 onebit qsgd:16; do
  run "compress-$c" 2 fp32 3e-2 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --compression "$c" --compression-warmup 5
done
run compress-powersgd-zero1 2 fp32 3e-2 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --compression powersgd:2 --zero1 true \
  --compression-warmup 5
run syncbn-resnet20 2 fp32 2e-3 --model resnet20 --synthetic --synthetic-shape 3,16,16 --batch-size 16 --lr 0.002 \
  --sync-batchnorm true
run distill-simple_cnn 2 fp32 2e-3 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --teacher "$WORK/teacher" --distill-weight 0.5
# With two GPUs or more, the data-parallel gradients over NCCL too (one GPU a rank).
if [[ $DEVICE == cuda && $(nvidia-smi -L 2>/dev/null | wc -l) -ge 2 ]]; then
  run nccl-dp 2 fp32 2e-3 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --comm nccl
  run nccl-zero1-clip 2 fp32 2e-3 --model simple_cnn "${IMG[@]}" --optimizer adamw --lr 0.003 --zero1 true \
    --clip-grad-norm 1 --comm nccl
  for c in topk:0.05 powersgd:2 onebit qsgd:16; do
    run "nccl-$c" 2 fp32 3e-2 --model simple_cnn "${IMG[@]}" "${SGD[@]}" --compression "$c" --compression-warmup 5 \
      --comm nccl
  done
  run nccl-tp2-dp2-gpt 4 fp32 2e-3 "${LM[@]}" --tp 2 --comm auto
fi

wait
cat "$WORK"/row-* 2>/dev/null >>"$table"  # in the matrix's order (printed above as they ended)
grep -q "| FAIL" "$WORK"/row-* 2>/dev/null && failed=1
# A failed row's logs, in one file (a few files come back from a GPU host).
[[ -d $WORK/failed ]] && tar -czf "$OUT_DIR/failed-logs.tgz" -C "$WORK" failed
if ((failed)); then say "RESULT: FAILED (logs of the failed rows in $OUT_DIR/failed-logs.tgz)"; else say "RESULT: all passed"; fi
rm -rf "$WORK"
exit $failed

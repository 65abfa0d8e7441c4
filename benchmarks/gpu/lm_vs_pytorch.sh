#!/usr/bin/env bash
# Language models at real sizes on one GPU in bf16, dtrain (--device cuda) against the GPU host's
# PyTorch (benchmarks/peers/torch_gpt.py with F.scaled_dot_product_attention, fused AdamW and
# torch.compile where that PyTorch has them and the model compiles), side by side in one run:
#   gpt2-124m   GPT-2 small: 12 x 768, 12 heads, context 1024, vocabulary 50257
#   llama-1b    16 x 2048, 32 heads over 8 kv heads, MLP 8192, context 2048, vocabulary 128256
# Both train on the byte tokens of DATA (ids below every vocabulary: a throughput run, the same
# windows for both frameworks' validation). Prints a markdown table: tokens/s, MFU
# ((6 N + 12 L C T) FLOPs a token against PEAK_TFLOPS, the dense bf16 peak: 989 for H100/H200 SXM),
# peak GPU memory, and the validation loss after the same steps (8 batches of DATA/val.h5).
#   benchmarks/gpu/lm_vs_pytorch.sh [MODELS]   (MODELS: "gpt2-124m llama-1b", the default; DEVICE=cpu
#   benchmarks/gpu/lm_vs_pytorch.sh tiny checks the script itself where no GPU is)
#   DTRAIN=path/to/dtrain PYTHON=python3 DATA=data/fortunes STEPS=40 PEAK_TFLOPS=989
#   GPT_BATCH=16 LLAMA_BATCH=4 (windows a step); source the pack's env.sh first (benchmarks/gpu/pack.sh)
set -euo pipefail
MODELS=${1:-gpt2-124m llama-1b}
DTRAIN=${DTRAIN:-${DTRAIN_EXE:-build/dtrain}}
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/fortunes}
STEPS=${STEPS:-40}
PEAK=${PEAK_TFLOPS:-989}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu MODELS=tiny: a dry run of the script on a machine without a GPU
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d /tmp/dtrain-lm.XXXXXX)
[[ -f $DATA/train.h5 ]] || "$DTRAIN" convert text --inputs /usr/share/games/fortunes --out "$DATA" >/dev/null
# PyTorch reads the .npy copies of the tokens where pack.sh wrote them (a host without h5py).
npy_or_h5() { if [[ -f $DATA/$1.npy ]]; then echo "$DATA/$1.npy"; else echo "$DATA/$1.h5"; fi; }
TOKENS=${TOKENS:-$(npy_or_h5 train)}
VAL_TOKENS=${VAL_TOKENS:-$(npy_or_h5 val)}

shape_of() {  # shape_of MODEL: the options both frameworks share, then the batch
  case $1 in
    gpt2-124m) echo "--model gpt --layers 12 --width 768 --heads 12 --context 1024 --vocab 50257|${GPT_BATCH:-16}" ;;
    llama-1b)
      echo "--model llama --layers 16 --width 2048 --heads 32 --kv-heads 8 --mlp-width 8192 --context 2048 --vocab 128256|${LLAMA_BATCH:-4}"
      ;;
    tiny) echo "--model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --context 64 --vocab 1000|4" ;;  # the script's own check
    *) echo "unknown model '$1' (gpt2-124m, llama-1b, tiny)" >&2 && exit 2 ;;
  esac
}
opt() { echo "$1" | grep -oE -- "--$2 [0-9]+" | awk '{print $2}'; }

echo "| model | framework | tokens/s | MFU | peak GPU MiB | val loss after $STEPS steps |"
echo "| --- | --- | ---: | ---: | ---: | ---: |"
for m in $MODELS; do
  IFS='|' read -r shape batch <<<"$(shape_of "$m")"
  layers=$(opt "$shape" layers) width=$(opt "$shape" width) ctx=$(opt "$shape" context)
  # dtrain: the tokens/s of the log rows after the first (warm-up) tenth of the steps.
  every=$((STEPS / 4))
  # shellcheck disable=SC2086
  "$DTRAIN" train $shape --data "$DATA" --batch-size "$batch" --steps "$STEPS" --log-every "$every" --eval-every 0 \
    --eval-batches 8 --warmup-steps 5 --device "$DEVICE" --precision bf16 --progress off --metrics "$WORK/$m.jsonl" \
    >"$WORK/$m.dtrain.log" 2>&1 || { echo "| $m | dtrain | failed: $(tail -1 "$WORK/$m.dtrain.log") | | | |"; continue; }
  read -r d_tps d_val < <("$PYTHON" - "$WORK/$m.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "tokens_per_s" in r and "loss" in r][1:]
summary = [r for r in rows if "summary" in r]
print(sum(r["tokens_per_s"] for r in steps) / max(len(steps), 1), summary[-1].get("val_loss", "nan") if summary else "nan")
EOF
  )
  params=$(grep -oE '[0-9]+ parameters on rank 0' "$WORK/$m.dtrain.log" | awk '{print $1}')
  d_peak=$(grep -oE 'peak [0-9.]+ MiB\)' "$WORK/$m.dtrain.log" | head -1 | grep -oE '[0-9.]+' || true)  # GPUs only
  flops=$(awk -v n="$params" -v l="$layers" -v c="$width" -v t="$ctx" 'BEGIN { print 6 * n + 12 * l * c * t }')
  mfu() { awk -v r="$1" -v f="$flops" -v p="$PEAK" 'BEGIN { printf "%.1f %%", 100 * r * f / (p * 1e12) }'; }
  echo "| $m ($params parameters, batch $batch) | dtrain bf16 | $(printf %.0f "$d_tps") | $(mfu "$d_tps") | ${d_peak:--} | $d_val |"
  # PyTorch: every fast path this host has; torch.compile dropped where it fails.
  fast=()
  "$PYTHON" -c 'import torch.nn.functional as F; assert hasattr(F, "scaled_dot_product_attention")' 2>/dev/null &&
    fast+=(--sdpa --fused-adamw)
  for extra in "--compile" ""; do
    if "$PYTHON" -c 'import torch; assert hasattr(torch, "compile")' 2>/dev/null || [[ -z $extra ]]; then
      # shellcheck disable=SC2086
      if "$PYTHON" "$HERE/../peers/torch_gpt.py" $shape "${fast[@]}" $extra \
        --device "$DEVICE" --precision bf16 --batch "$batch" --steps "$STEPS" --warmup 5 --tokens "$TOKENS" \
        --val-batches 8 --val-tokens "$VAL_TOKENS" >"$WORK/$m.torch.log" 2>&1; then
        break
      fi
    fi
  done
  read -r p_tps p_peak p_val p_label < <("$PYTHON" - "$WORK/$m.torch.log" <<'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
if not lines:
    print("nan nan nan failed")
else:
    r = json.loads(lines[-1])
    label = r["framework"] + ("+sdpa" if r["sdpa"] else "") + ("+compile" if r["compiled"] else "")
    print(r["tokens_per_s"], r["peak_gpu_mib"], r["val_loss"], label.replace(" ", "_"))
EOF
  )
  echo "| $m | $p_label bf16 autocast | $(printf %.0f "$p_tps") | $(mfu "$p_tps") | $(printf %.0f "$p_peak") | $p_val |"
done
echo
echo "$("$DTRAIN" info 2>/dev/null | head -1); logs in $WORK"

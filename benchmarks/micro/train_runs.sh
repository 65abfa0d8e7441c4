# Sourced by the side-by-side benchmarks of this folder (long_context.sh, lm_head.sh): one training
# run's figures and the medians over repeats.
# median: the median of the numbers on stdin, one a line (nothing for none).
median() { sort -n | awk '{v[NR] = $1} END {if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
# train_run BINARY ARGS...: prints "tokens/s peak-RSS-MiB" of `BINARY train ARGS...` (GNU time's
# maximum RSS), or "- -" with the run's last lines on stderr when it fails.
train_run() {
  local bin=$1 out rate rss
  shift
  out=$(/usr/bin/time -f 'maxrss %M' "$bin" train "$@" 2>&1) || {
    echo "run failed: $bin train $*" >&2
    echo "$out" | tail -5 >&2
    echo "- -"
    return
  }
  rate=$(echo "$out" | grep -oE 'done: [0-9]+ steps, [0-9.]+ tokens/s' | awk '{print $4}')
  rss=$(echo "$out" | awk '/^maxrss/ {printf "%.0f", $2 / 1024}')
  echo "$rate $rss"
}
# ratio A B: B / A to two places, or "-" when either is missing.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "") print "-"; else printf "%.2f", b / a }'; }

#!/usr/bin/env bash
# Writes the checkpoint fixtures: one folder per layout, each holding the sets of steps 2 and 4 of
# a 4-step run on 2 ranks, written by the binary given (the layouts: plain data parallelism, ZeRO-1,
# ZeRO-3, tp 2, pp 2 and top-k compression, with a small GPT). They are kept in the tree as
# the landed binary wrote them, so that a change to how state is saved and loaded is tested against
# sets written before it (fixture_test.sh); regenerate them only for a new checkpoint format.
# usage: make.sh DTRAIN_BIN OUT_DIR
set -euo pipefail
bin=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mkdir -p "$out"
# The GPT's text: 300 short sentences, converted into byte tokens beside the sets.
if [[ ! -d $out/tok ]]; then
  mkdir -p "$out/text"
  for i in $(seq 0 299); do printf 'a small text, %d times over. ' $((i % 10)); done >"$out/text/a.txt"
  "$bin" convert text --inputs "$out/text" --out "$out/tok"
  rm -r "$out/text"
fi
for layout in $("$here/layouts.sh" names); do
  rm -rf "${out:?}/$layout"
  # shellcheck disable=SC2046
  mpirun -n 2 --oversubscribe --bind-to none "$bin" train $("$here/layouts.sh" args "$layout" "$out/tok") \
    --steps 4 --checkpoint-every 2 --keep-checkpoints 2 --checkpoint-dir "$out/$layout" >"$out/$layout.log" 2>&1 || {
    cat "$out/$layout.log"
    exit 1
  }
  rm "$out/$layout.log"
  echo "$layout: $(ls "$out/$layout" | tr '\n' ' ')"
done
git -C "$here" rev-parse HEAD >"$out/WRITTEN_BY"

#!/usr/bin/env bash
# Whose finding is a fuzz target's report? Prints "hdf5" when the crash, memory error or hang lies
# inside libhdf5 on memory libhdf5 allocated (HDF5 1.10.8 misreads some malformed files on its own:
# a bug outside dtrain's reach), else "dtrain".
#   triage.sh LOG REPOSITORY_ROOT BINARY
# The stack of the report's first error is read from its top: frames of the sanitizer runtime and
# libFuzzer (code of BINARY without a source line: interceptors such as strdup) and of libc are
# passed over; the first frame after them decides. A write inside libhdf5 into memory allocated,
# freed or on the stack of dtrain's code (a frame with a source line under the repository in the
# report's "allocated by", "freed by" or "located in stack") is dtrain's: dtrain gave HDF5 a buffer
# too small. (HDF5's wild reads land anywhere, dtrain's freed memory included; the readers hand HDF5
# no buffer to read from but names.) Out of memory is HDF5's when most of the live heap (the report's
# largest allocation context, over half of it) was allocated by libhdf5: HDF5 1.10.8 allocates
# without bound while it opens an object of some malformed files (a plain C H5Dopen2 of such a file
# grows to any limit). Leaks, other out-of-memory and anything unclear are dtrain's.
set -euo pipefail
log=$1 root=$2 binary=$3
awk -v root="$root" -v binary="$binary" '
  /ERROR: (AddressSanitizer|libFuzzer): / && !seen_error {
    seen_error = 1
    if ($0 ~ /leak|malloc limit/) { verdict = "dtrain"; exit }
    oom = $0 ~ /out-of-memory/
    in_stack = !oom; next
  }
  # Out of memory: the stack of the largest live allocation context decides, when it holds most of the heap.
  oom && !oom_context && /^ *[0-9]+ byte\(s\) \([0-9]+%\) in [0-9]+ allocation/ {
    oom_context = 1
    match($0, /\([0-9]+%\)/)
    if (substr($0, RSTART + 1, RLENGTH - 3) + 0 > 50) in_stack = 1; else { verdict = "dtrain"; exit }
    next
  }
  seen_error && in_stack && /^ *#[0-9]+ / {
    if (decided) next
    if ($0 ~ /__interceptor_|__asan|__sanitizer|__ubsan|fuzzer::|libc\.so|\/sysdeps\/|compiler-rt|libclang_rt/) next
    if (index($0, "(" binary "+0x") > 0) next
    decided = 1
    verdict = ($0 ~ /libhdf5/) ? "hdf5" : "dtrain"
    next
  }
  seen_error && in_stack && decided && !/^ *#[0-9]+ / { in_stack = 0 }
  seen_error && /^(READ|WRITE) of size/ && !access { access = $1 }
  seen_error && /allocated by thread|freed by thread|is located in stack of thread/ { in_alloc = 1; next }
  in_alloc && /^ *#[0-9]+ / { if (match($0, root "/[^ ]+[.](cpp|h):[0-9]+")) dtrain_alloc = 1; next }
  in_alloc && !/^ *#[0-9]+ / { in_alloc = 0 }
  END {
    if (verdict == "hdf5" && !(access == "WRITE" && dtrain_alloc)) print "hdf5"; else print "dtrain"
  }
' "$log"

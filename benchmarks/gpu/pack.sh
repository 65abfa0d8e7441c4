#!/usr/bin/env bash
# Packs this machine's dtrain build for a GPU host that has CUDA's libraries (through its PyTorch)
# but not the Debian ones dtrain links: the binaries (dtrain, the CUDA tests, Open MPI's mpirun and
# orted for runs of several ranks), those libraries, Open MPI's plugins, and the fortunes tokens
# (HDF5, and .npy for a PyTorch without h5py), into OUT (default .gpu, which .git/info/exclude
# should list). On the GPU host, from the repository root: source OUT/env.sh, then
# benchmarks/gpu/check_all.sh (the standing check).
#   benchmarks/gpu/pack.sh [OUT]
set -euo pipefail
OUT=${1:-.gpu}
mkdir -p "$OUT/bin" "$OUT/data" /tmp/dtrain-pack/lib /tmp/dtrain-pack/lib2
cp build/dtrain build/tests/kernels/test_kernels_cuda "$OUT/bin/"
cp -L "$(readlink -f /usr/bin/mpirun)" "$OUT/bin/mpirun"
orted=$(command -v orted) || { echo "pack.sh: no orted on the PATH (Open MPI 4's daemon)" >&2; exit 1; }
cp -L "$orted" "$OUT/bin/orted"
keep() { awk '/=>/{print $3}' | sort -u |
  grep -v -E "/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so|/usr/local/cuda|ld-linux"; }
ldd build/dtrain build/tests/kernels/test_kernels_cuda "$OUT/bin/mpirun" "$OUT/bin/orted" | keep >/tmp/dtrain-pack/libs.txt
ompi=/usr/lib/x86_64-linux-gnu/openmpi pmix=/usr/lib/x86_64-linux-gnu/pmix2
for f in "$ompi"/lib/openmpi3/*.so "$pmix"/lib/pmix/*.so; do ldd "$f"; done 2>/dev/null | keep >/tmp/dtrain-pack/plugin-libs.txt
cp -L $(cat /tmp/dtrain-pack/libs.txt) /tmp/dtrain-pack/lib/
cp -L $(comm -13 /tmp/dtrain-pack/libs.txt /tmp/dtrain-pack/plugin-libs.txt) /tmp/dtrain-pack/lib2/
tar -cJf "$OUT/libs.tar.xz" -C /tmp/dtrain-pack lib
tar -cJf "$OUT/extra.tar.xz" -C /tmp/dtrain-pack lib2 -C / "${ompi#/}" "${pmix#/}" usr/share/openmpi etc/openmpi
rm -rf /tmp/dtrain-pack
build/dtrain convert text --inputs /usr/share/games/fortunes --out "$OUT/data/fortunes"
for split in train val; do
  /usr/bin/python3 -c "import h5py, numpy, sys; numpy.save(sys.argv[2], h5py.File(sys.argv[1])['tokens'][:])" \
    "$OUT/data/fortunes/$split.h5" "$OUT/data/fortunes/$split.npy"
done
cp benchmarks/gpu/gpu_host_env.sh "$OUT/env.sh"
du -sh "$OUT"

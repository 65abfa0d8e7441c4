#!/usr/bin/env bash
# Installs exactly the Debian 12 packages dtrain needs to build, test and run its quick start;
# DTRAIN_DEPS=run: only what building dtrain and training on Fashion-MNIST need (the quick start).
# Idempotent: packages already present are left alone and apt-get is not called at all.
set -euo pipefail

# What building dtrain and its main job need (the quick start: DTRAIN_DEPS=run installs only these).
PACKAGES=(
  build-essential cmake pkg-config
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev
  libboost-program-options-dev
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev opencl-c-headers  # dnnl-config.cmake looks for OpenCL
  zlib1g-dev
  libxxhash-dev  # checkpoint checksums (XXH3)
  libjpeg62-turbo-dev libpng-dev  # dtrain convert images
  libsentencepiece-dev  # dtrain convert text --tokenizer bpe
  libpcre2-dev  # GPT-2's byte-level BPE (its pre-tokenising pattern)
  dataset-fashion-mnist
)
# What the tests add: HDF5's tools, GoogleTest, the micro-benchmarks, the fuzz and sanitizer
# builds (clang), the GPT example's text.
if [[ ${DTRAIN_DEPS:-all} != run ]]; then
  PACKAGES+=(
    hdf5-tools
    libgtest-dev libbenchmark-dev
    clang libclang-rt-14-dev libomp-dev  # the fuzz targets (scripts/fuzz.sh): libFuzzer, ASan/UBSan, OpenMP for clang
    fortunes  # English text for the GPT example (examples/gpt_fortunes.ini)
    iproute2  # the emulated nodes of the multinode tests (cluster/emulate: ip netns, tc)
    ccache  # the three builds of the suite (build/, build-fuzz/, build-tsan/) compile unchanged files from its cache
  )
fi
# The side-by-side peer benchmarks need PyTorch; the tests do not.
if [[ "${DTRAIN_WITH_PEERS:-0}" == "1" ]]; then
  PACKAGES+=(python3-torch python3-torchvision python3-h5py python3-numpy time)
fi

# A real one-node SLURM for the `slurm` tests (cluster/slurm/local/start.sh). Only as root by
# default: the daemons need it, and the tests skip themselves elsewhere. DTRAIN_WITH_SLURM=0|1 decides.
# Installed on its own so that a machine where they cannot be installed still gets the rest.
OPTIONAL=()
if [[ ${DTRAIN_DEPS:-all} != run && "${DTRAIN_WITH_SLURM:-$([[ $(id -u) -eq 0 ]] && echo 1 || echo 0)}" == "1" ]]; then
  OPTIONAL+=(slurmctld slurmd slurm-client munge)
fi
# The scaling harness (benchmarks/scaling/) and its test: numpy, and matplotlib for the plots; h5py for the
# test that reads a converted shard with an independent HDF5 reader.
# PIL for the test that checks dtrain convert images against it.
if [[ ${DTRAIN_DEPS:-all} != run && "${DTRAIN_WITH_PLOTS:-1}" == "1" ]]; then OPTIONAL+=(python3-numpy python3-matplotlib python3-h5py python3-pil); fi
# SentencePiece's Python module: the independent encoder the pretrained-tokenizer test compares with.
if [[ ${DTRAIN_DEPS:-all} != run ]]; then OPTIONAL+=(python3-sentencepiece python3-regex); fi
# PyTorch (Debian's 1.13, CPU) for the export test (tests/cli/export_pytorch.sh: dtrain's exports loaded
# by PyTorch): about a minute to install, two to run. DTRAIN_WITH_PYTORCH=0 leaves it out (the test
# then says "skipped: no PyTorch").
if [[ ${DTRAIN_DEPS:-all} != run && "${DTRAIN_WITH_PYTORCH:-1}" == "1" ]]; then
  OPTIONAL+=(python3-torch python3-torchvision python3-numpy python3-h5py)
fi

missing=()
missing_optional=()
for p in "${OPTIONAL[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing_optional+=("$p")
  fi
done
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0 && ${#missing_optional[@]} == 0)); then
  echo "install-deps: all $((${#PACKAGES[@]} + ${#OPTIONAL[@]})) packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
if ((${#missing[@]} > 0)); then
  echo "install-deps: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ((${#missing_optional[@]} > 0)); then
  echo "install-deps: installing ${missing_optional[*]} (optional: the slurm and scaling tests skip without them)"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing_optional[@]}" ||
    echo "install-deps: warning: could not install ${missing_optional[*]}; the slurm and scaling tests will be skipped"
fi

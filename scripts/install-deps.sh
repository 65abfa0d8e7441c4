#!/usr/bin/env bash
# Installs exactly the Debian 12 packages dtrain needs to build, test and run its quick start.
# Idempotent: packages already present are left alone and apt-get is not called at all.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev hdf5-tools
  libboost-program-options-dev
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev opencl-c-headers  # dnnl-config.cmake looks for OpenCL
  zlib1g-dev
  libgtest-dev libbenchmark-dev
  dataset-fashion-mnist
)
# The side-by-side peer benchmarks need PyTorch; the tests do not.
if [[ "${DTRAIN_WITH_PEERS:-0}" == "1" ]]; then
  PACKAGES+=(python3-torch python3-h5py python3-numpy time)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

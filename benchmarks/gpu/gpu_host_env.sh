# Sourced on a GPU host from the repository root (benchmarks/gpu/pack.sh copies it to .gpu/env.sh):
# the Debian libraries dtrain links (carried), Open MPI's plugins at their built-in paths, and the
# CUDA libraries of the host's PyTorch; MPI starts as a singleton without orted.
set +e
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/dl/lib ]; then
  mkdir -p /tmp/dl && tar -xJf "$here/libs.tar.xz" -C /tmp/dl && tar -xJf "$here/extra.tar.xz" -C /tmp/dl && mv /tmp/dl/lib2/* /tmp/dl/lib/
  for d in usr/lib/x86_64-linux-gnu/openmpi usr/lib/x86_64-linux-gnu/pmix2 usr/share/openmpi etc/openmpi; do
    [ -e /$d ] || { mkdir -p /$(dirname $d) && cp -a /tmp/dl/$d /$d; }
  done
fi
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libcublas.so.13 libcudnn.so.9 libnccl.so.2; do
  f=$(find /opt /usr/local /usr/lib -name $n 2>/dev/null | head -1); [ -n "$f" ] && dirname "$f"; done | sort -u | paste -sd:)
export LD_LIBRARY_PATH=/tmp/dl/lib:$CUDALIBS
# Open MPI's and PMIx's plugins from the carried tree: a host with its own Open MPI (another PMIx)
# has plugins at the same paths that the carried libpmix cannot load.
export OMPI_MCA_mca_base_component_path=/tmp/dl/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
export PMIX_MCA_mca_base_component_path=/tmp/dl/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix
export OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_mca_base_component_show_load_errors=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 DTRAIN_EXE=$here/bin/dtrain
# Several ranks: the carried mpirun starts them on this host (orted on the PATH for its helpers).
export MPIRUN=$here/bin/mpirun PATH=$here/bin:$PATH DTRAIN_CHECK_DATA=$here/data/fortunes
# A host without ssh/rsh: mpirun looks for a remote agent at start even for local ranks.
command -v ssh >/dev/null || export OMPI_MCA_plm_rsh_agent=false
echo "CUDA libraries from: $CUDALIBS"
ldd "$here/bin/dtrain" | grep "not found"

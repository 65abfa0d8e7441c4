// dtrain info: what was compiled in and what this rank sees.
#include <H5public.h>
#include <boost/program_options.hpp>
#include <boost/version.hpp>
#include <iostream>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/kernels/engine.h"

#if defined(DTRAIN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace po = boost::program_options;

namespace dtrain::cli {

int cmd_info(int argc, char** argv) {
  po::options_description opts("usage: dtrain info [--all-ranks]");
  opts.add_options()("help,h", "print this help")("all-ranks", "print every rank's view of the topology");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  } catch (const po::error& e) {
    throw InputError(e.what());
  }
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  comm::Runtime& rt = comm::Runtime::get();
  const comm::Topology& t = rt.topology();
  std::string table = rt.topology_table();  // collective
  if (vm.count("all-ranks")) {
    // Each rank prints its own view, in rank order.
    for (int r = 0; r < t.size; ++r) {
      if (r == t.rank) std::printf("rank %d: %s\n", t.rank, t.describe().c_str()), std::fflush(stdout);
      if (t.size > 1) MPI_Barrier(MPI_COMM_WORLD);
    }
  }
  if (t.rank != 0) return 0;
  std::printf("dtrain %s\n", DTRAIN_VERSION);
  std::printf("  compiled in : CPU engine (oneDNN %s, %s)\n", onednn_version().c_str(), blas_info().c_str());
#if defined(DTRAIN_WITH_CUDA)
  int rt_ver = 0, drv_ver = 0, ndev = 0;
  cudaRuntimeGetVersion(&rt_ver);
  cudaDriverGetVersion(&drv_ver);
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
  std::printf("  CUDA        : runtime %d.%d, driver %d.%d, %d device(s)\n", rt_ver / 1000, (rt_ver % 1000) / 10,
              drv_ver / 1000, (drv_ver % 1000) / 10, ndev);
  for (int i = 0; i < ndev; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) == cudaSuccess)
      std::printf("    cuda:%d  %s, %.1f GiB, sm_%d%d\n", i, p.name, p.totalGlobalMem / 1073741824.0, p.major, p.minor);
  }
#else
  std::printf("  CUDA        : not compiled in\n");
#endif
#if defined(DTRAIN_WITH_CUDNN)
  std::printf("  cuDNN       : compiled in\n");
#else
  std::printf("  cuDNN       : not compiled in\n");
#endif
#if defined(DTRAIN_WITH_NCCL)
  std::printf("  NCCL        : compiled in\n");
#else
  std::printf("  NCCL        : not compiled in\n");
#endif
  std::printf("  HDF5        : %s (parallel build: %s)\n", data::h5::library_version().c_str(),
#if defined(H5_HAVE_PARALLEL)
              "yes"
#else
              "no"
#endif
  );
  std::printf("  MPI         : %s (thread level %s)\n", t.mpi_library.c_str(), comm::thread_level_name(t.mpi_thread_level));
  std::printf("  Boost       : %d.%d.%d\n", BOOST_VERSION / 100000, BOOST_VERSION / 100 % 1000, BOOST_VERSION % 100);
  std::printf("  devices     : cpu (%d cores on this node, %d bound to rank 0)\n", t.node_cores, t.bound_cores);
  std::printf("%s", table.c_str());
  return 0;
}

}  // namespace dtrain::cli

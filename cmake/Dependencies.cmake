# System packages dtrain builds on. Included by the top-level CMakeLists.txt and by the installed
# dtrainConfig.cmake, so that a consumer's find_package(dtrain) finds the same imported targets.
find_package(MPI REQUIRED COMPONENTS CXX C)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)
set(HDF5_PREFER_PARALLEL ON)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(WARNING "dtrain: the HDF5 found is not the parallel (MPI) build; install libhdf5-openmpi-dev")
endif()
find_package(Boost REQUIRED COMPONENTS program_options)
find_package(dnnl REQUIRED)
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_package(ZLIB REQUIRED)
find_package(JPEG REQUIRED)  # dtrain convert images: libjpeg-turbo
find_package(PNG REQUIRED)
find_package(PkgConfig REQUIRED)  # SentencePiece ships a .pc file only
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET GLOBAL sentencepiece)
# GPT-2's pre-tokenising pattern needs Unicode classes (\p{L}, \p{N}) and a look-ahead: PCRE2.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET GLOBAL libpcre2-8)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET GLOBAL libxxhash)  # checkpoint checksums (XXH3)
find_path(DTRAIN_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas openblas-pthread REQUIRED)

# HDF5's variables become one imported target.
if(NOT TARGET dtrain_hdf5)
  add_library(dtrain_hdf5 INTERFACE IMPORTED GLOBAL)
  set_target_properties(dtrain_hdf5 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${HDF5_INCLUDE_DIRS}"
                                               INTERFACE_LINK_LIBRARIES "${HDF5_C_LIBRARIES};MPI::MPI_C"
                                               INTERFACE_COMPILE_DEFINITIONS "${HDF5_DEFINITIONS}")
endif()

# CUDA is optional: DTRAIN_CUDA=AUTO builds the CUDA engine when the toolkit is found.
if(NOT DEFINED DTRAIN_CUDA)
  set(DTRAIN_CUDA OFF)
endif()
set(DTRAIN_HAVE_CUDA OFF)
set(DTRAIN_HAVE_CUDNN OFF)
set(DTRAIN_HAVE_NCCL OFF)
if(NOT DTRAIN_CUDA STREQUAL "OFF")
  if(DTRAIN_CUDA STREQUAL "ON")
    find_package(CUDAToolkit REQUIRED)
  else()
    find_package(CUDAToolkit QUIET)
  endif()
  if(CUDAToolkit_FOUND)
    set(DTRAIN_HAVE_CUDA ON)
    find_library(DTRAIN_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(DTRAIN_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(DTRAIN_CUDNN_LIBRARY AND DTRAIN_CUDNN_INCLUDE_DIR)
      set(DTRAIN_HAVE_CUDNN ON)
    endif()
    find_library(DTRAIN_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(DTRAIN_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(DTRAIN_NCCL_LIBRARY AND DTRAIN_NCCL_INCLUDE_DIR)
      set(DTRAIN_HAVE_NCCL ON)
    endif()
  endif()
endif()

#pragma once
// DT_MPI_CHECK: the error domain for MPI calls. The runtime installs MPI_ERRORS_RETURN on every
// communicator it makes, so a failing call returns here and becomes a dtrain::Error naming the
// call, the rank and host, and MPI's own error string.
#include <mpi.h>

#include <string>

#include "dtrain/core/error.h"

namespace dtrain::comm {

// "MPI_ERR_ROOT: invalid root" for an MPI return code.
std::string mpi_error_string(int code);

namespace detail {
[[noreturn]] void throw_mpi_error(const char* call, int code, const char* file, int line);
}  // namespace detail
}  // namespace dtrain::comm

#define DT_MPI_CHECK(call)                                                                                         \
  do {                                                                                                             \
    int dt_mpi_rc_ = (call);                                                                                       \
    if (dt_mpi_rc_ != MPI_SUCCESS) ::dtrain::comm::detail::throw_mpi_error(#call, dt_mpi_rc_, __FILE__, __LINE__); \
  } while (0)

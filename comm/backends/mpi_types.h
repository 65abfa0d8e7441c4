#pragma once
// dtrain dtypes and reduce ops as MPI datatypes and ops. MPI has no bf16/f16, so half types travel
// as 16-bit words and are reduced by user-defined ops that widen to fp32, combine, and round back
// once per combining step.
#include <mpi.h>

#include <cstdint>

#include "dtrain/comm/communicator.h"
#include "dtrain/core/dtype.h"

namespace dtrain::comm::detail {

MPI_Datatype mpi_datatype(DType t);
// The MPI op that implements `op` on `t` (Avg is a Sum followed by divide_by()).
MPI_Op mpi_op(ReduceOp op, DType t);
// x[i] /= n for n elements of dtype t (integers truncate toward zero).
void divide_by(void* data, int64_t count, DType t, int n);

void create_user_ops();  // after MPI_Init
void free_user_ops();    // before MPI_Finalize

}  // namespace dtrain::comm::detail

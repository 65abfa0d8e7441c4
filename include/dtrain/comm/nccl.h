#pragma once
// NCCL backend: device buffers, its own CUDA stream, the unique id broadcast with MPI. Compiled
// whenever CUDA and NCCL are found (DTRAIN_WITH_NCCL); without them the factory throws.
#include <memory>
#include <string>

#include "dtrain/comm/communicator.h"

namespace dtrain::comm {

bool nccl_compiled();     // built with NCCL
std::string nccl_version();  // "2.28.3", or "" without NCCL
int cuda_device_count();  // 0 without CUDA, driver or GPU

// Collective over `bootstrap` (an MPI-backend communicator): every rank passes the CUDA device it
// drives. Rank 0 makes the unique id; MPI_Bcast carries it; ncclCommInitRank joins.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device,
                                                     const std::string& name = "nccl");

// The NCCL communicator's stream as a cudaStream_t (void* keeps cuda_runtime.h out of this header).
// Work on it is ordered after work already queued on `stream` by set_input_stream.
void* nccl_stream(Communicator& c);
void nccl_set_input_stream(Communicator& c, void* stream);

}  // namespace dtrain::comm

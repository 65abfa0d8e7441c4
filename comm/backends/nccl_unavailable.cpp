// Built when CUDA or NCCL was not found: the NCCL entry points say so.
#include "dtrain/comm/nccl.h"

namespace dtrain::comm {

bool nccl_compiled() { return false; }
std::string nccl_version() { return ""; }
int cuda_device_count() { return 0; }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, int, const std::string&) {
  DT_CHECK(false, "this dtrain was built without NCCL (CUDA toolkit or nccl.h/libnccl not found at configure time)");
  __builtin_unreachable();
}

void* nccl_stream(Communicator&) {
  DT_CHECK(false, "this dtrain was built without NCCL");
  __builtin_unreachable();
}

void nccl_set_input_stream(Communicator&, void*) { DT_CHECK(false, "this dtrain was built without NCCL"); }

}  // namespace dtrain::comm

#include "backends/mpi_types.h"

#include <algorithm>
#include <cstring>

#include "dtrain/comm/mpi_check.h"

namespace dtrain::comm::detail {
namespace {

// Half words <-> float for the two 16-bit formats.
struct Bf16 {
  static float load(uint16_t h) { return bf16_to_float(h); }
  static uint16_t store(float f) { return float_to_bf16(f); }
};
struct F16 {
  static float load(uint16_t h) { return f16_to_float(h); }
  static uint16_t store(float f) { return float_to_f16(f); }
};
struct AddF {
  static float apply(float a, float b) { return a + b; }
};
struct MaxF {
  static float apply(float a, float b) { return std::max(a, b); }
};
struct MinF {
  static float apply(float a, float b) { return std::min(a, b); }
};

// MPI_User_function: inout[i] = in[i] (op) inout[i], computed in fp32. `len` counts 16-bit words.
template <class Fmt, class Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Fmt::store(Op::apply(Fmt::load(a[i]), Fmt::load(b[i])));
}

// [format][op]: format 0 = bf16, 1 = f16; op 0 = sum, 1 = max, 2 = min.
MPI_Op g_half_ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};

}  // namespace

void create_user_ops() {
  if (g_half_ops[0][0] != MPI_OP_NULL) return;
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<Bf16, AddF>, 1, &g_half_ops[0][0]));
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<Bf16, MaxF>, 1, &g_half_ops[0][1]));
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<Bf16, MinF>, 1, &g_half_ops[0][2]));
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<F16, AddF>, 1, &g_half_ops[1][0]));
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<F16, MaxF>, 1, &g_half_ops[1][1]));
  DT_MPI_CHECK(MPI_Op_create(&half_reduce<F16, MinF>, 1, &g_half_ops[1][2]));
}

void free_user_ops() {
  for (auto& row : g_half_ops)
    for (MPI_Op& op : row)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
}

MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
    case DType::F16:
      return MPI_UINT16_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::U8:
      return MPI_UINT8_T;
  }
  DT_CHECK(false, "no MPI datatype for dtype " << static_cast<int>(t));
  __builtin_unreachable();
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  int which = op == ReduceOp::Max ? 1 : op == ReduceOp::Min ? 2 : 0;
  if (t == DType::BF16 || t == DType::F16) {
    MPI_Op o = g_half_ops[t == DType::F16 ? 1 : 0][which];
    DT_CHECK(o != MPI_OP_NULL, "half-precision reduce ops are not created: call Runtime::init() first");
    return o;
  }
  return which == 1 ? MPI_MAX : which == 2 ? MPI_MIN : MPI_SUM;
}

void divide_by(void* data, int64_t count, DType t, int n) {
  if (n == 1) return;
  switch (t) {
    case DType::F32: {
      auto* p = static_cast<float*>(data);
      float d = static_cast<float>(n);
      for (int64_t i = 0; i < count; ++i) p[i] /= d;
      return;
    }
    case DType::BF16:
    case DType::F16: {
      auto* p = static_cast<uint16_t*>(data);
      float d = static_cast<float>(n);
      bool bf = t == DType::BF16;
      for (int64_t i = 0; i < count; ++i)
        p[i] = bf ? float_to_bf16(bf16_to_float(p[i]) / d) : float_to_f16(f16_to_float(p[i]) / d);
      return;
    }
    case DType::I32: {
      auto* p = static_cast<int32_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      return;
    }
    case DType::I64: {
      auto* p = static_cast<int64_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      return;
    }
    case DType::U8: {
      auto* p = static_cast<uint8_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] = static_cast<uint8_t>(p[i] / n);
      return;
    }
  }
}

}  // namespace dtrain::comm::detail

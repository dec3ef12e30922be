// CLAMP: clamp(x, out_min, out_max) in the input's I8/U8 dtype (docs/qgraph.md §4.1).
#include <algorithm>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct ClampParams : OpParams {
  int64_t lo = 0, hi = 0;
};

}  // namespace

Status PrepareClamp(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  OP_CHECK(IsInt8(x.dtype) && out.dtype == x.dtype, "CLAMP keeps its I8/U8 dtype");
  int64_t lo, hi;
  DTypeRange(out.dtype, &lo, &hi);
  OP_CHECK(A.at("out_min").i >= lo && A.at("out_max").i <= hi && A.at("out_min").i <= A.at("out_max").i,
           "out_min/out_max outside the dtype");
  auto p = std::make_shared<ClampParams>();
  p->lo = A.at("out_min").i;
  p->hi = A.at("out_max").i;
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunClamp(RunCtx& c, const GraphOp& op) {
  const ClampParams& p = ParamsOf<ClampParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t lo = p.lo, hi = p.hi;
  ParallelRanges(n, /*chunk=*/16384, /*work=*/n * 8, [&](int64_t i0, int64_t i1) {
    if (xd == kU8) {  // per-dtype loops the compiler vectorizes
      const uint8_t l = static_cast<uint8_t>(ClampI64(lo, 0, 255)), h = static_cast<uint8_t>(ClampI64(hi, 0, 255));
      for (int64_t i = i0; i < i1; ++i) y[i] = std::min(std::max(x[i], l), h);
    } else if (xd == kI8) {
      const int8_t l = static_cast<int8_t>(ClampI64(lo, -128, 127)), h = static_cast<int8_t>(ClampI64(hi, -128, 127));
      const int8_t* s8 = reinterpret_cast<const int8_t*>(x);
      int8_t* d8 = reinterpret_cast<int8_t*>(y);
      for (int64_t i = i0; i < i1; ++i) d8[i] = std::min(std::max(s8[i], l), h);
    } else {
      for (int64_t i = i0; i < i1; ++i) y[i] = static_cast<uint8_t>(ClampI64(LoadValue(x, xd, i), lo, hi));
    }
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kClampDef = {PrepareClamp, RunClamp, ValueRange::kClamp};

}  // namespace qdsl

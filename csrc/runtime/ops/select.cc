// SELECT (38): one index along one axis, the axis dropped (qdsl/graph/ops/select.py): a
// strided copy of that slice, any activation dtype.
#include <cstring>

#include "runtime/ops/op.h"

namespace qdsl {
namespace {

struct SelectParams : OpParams {
  int axis = 0;
  int64_t index = 0;
};

Status PrepareSelect(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(out.dtype == x.dtype && (IsInt8(x.dtype) || x.dtype == kI32 || x.dtype == kF32),
           "SELECT keeps its dtype (I8/U8/I32/F32)");
  OP_CHECK(x.dims.size() >= 2 && x.dims.size() <= 6, "SELECT input must have rank 2..6");
  const int64_t axis = op.attrs.at("axis").i, at = op.attrs.at("index").i;
  OP_CHECK(axis >= 0 && axis < static_cast<int64_t>(x.dims.size()), "axis out of range");
  OP_CHECK(x.dims[axis] >= 1 && at >= 0 && at < x.dims[axis], "index out of range (or a batched axis)");
  auto p = std::make_shared<SelectParams>();
  p->axis = static_cast<int>(axis);
  p->index = at;
  shape->erase(shape->begin() + axis);
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunSelect(RunCtx& c, const GraphOp& op) {
  const SelectParams& p = ParamsOf<SelectParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int xd = c.DType(xi);
  const size_t es = (xd == kF32 || xd == kI32) ? 4 : 1;
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < p.axis; ++k) outer *= xs[k];
  for (size_t k = p.axis + 1; k < xs.size(); ++k) inner *= xs[k];
  const int64_t dim = xs[p.axis];
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(y + o * inner * es, x + (o * dim + p.index) * inner * es, static_cast<size_t>(inner) * es);
  return Status::Ok();
}

}  // namespace

// The op table's entry (op_schema.h names it by opcode); the values are the input's.
const OpDef kSelectDef = {PrepareSelect, RunSelect, ValueRange::kInput};

}  // namespace qdsl

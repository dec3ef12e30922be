// RESHAPE of the non-batch dims (docs/qgraph.md §4.1): a copy of the buffer.
#include "runtime/ops/op.h"

namespace qdsl {

Status PrepareReshape(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(out.dtype == x.dtype, "RESHAPE keeps its dtype");
  const auto& s = op.attrs.at("shape").ints;
  OP_CHECK(s.size() <= 7, "RESHAPE shape too long");
  std::vector<int64_t> ns = {(*shape)[0]};
  int64_t n_new = 1, n_old = 1;
  for (int64_t v : s) {
    OP_CHECK(v >= 1 && v <= (int64_t{1} << 36), "RESHAPE entries must be >= 1");
    n_new *= v;
    OP_CHECK(n_new <= (int64_t{1} << 36), "RESHAPE too large");
    ns.push_back(v);
  }
  for (size_t i = 1; i < shape->size(); ++i) n_old *= (*shape)[i];
  OP_CHECK(n_new == n_old, "RESHAPE changes the element count (%lld -> %lld)", (long long)n_old, (long long)n_new);
  *shape = ns;
  op.prepared = std::make_shared<OpParams>();  // nothing to keep: the shapes say it all
  return Status::Ok();
}

Status RunReshape(RunCtx& c, const GraphOp& op) {
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int xd = c.DType(xi);
  const int64_t n = Numel(c.Shape(xi));
  std::memcpy(c.Buf(yi), c.Buf(xi), static_cast<size_t>(n) * ((xd == kF32 || xd == kI32) ? 4 : 1));
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kReshapeDef = {PrepareReshape, RunReshape, ValueRange::kInput};

}  // namespace qdsl

// RESHAPE of the non-batch dims (docs/qgraph.md §4.1): the bytes do not change.  When the
// input is read by no other op and is no graph output (attention's head split and merge), the
// run hands the input's buffer to the output (a swap of the two equal-sized buffers, O(1)):
// nothing reads the input afterwards, and its buffer is written again (by its producer, or by
// the executor for a graph input) before it is read in the next run.  Otherwise a copy.
#include <utility>

#include "runtime/ops/op.h"

namespace qdsl {
namespace {

struct ReshapeParams : OpParams {
  bool move = false;  // the input dies here: swap its buffer into the output's
};

}  // namespace

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
  auto p = std::make_shared<ReshapeParams>();
  const uint32_t xi = op.inputs[0];
  // the batch dims agree too (both -1, or the input's static one carried over), so the
  // two buffers always have the same size
  p->move = !x.is_constant && x.dims[0] == out.dims[0];
  for (uint32_t t : g->outputs) p->move = p->move && t != xi;
  for (size_t k = 0; k < g->ops.size() && p->move; ++k) {
    if (static_cast<int>(k) == index) continue;
    for (uint32_t t : g->ops[k].inputs) p->move = p->move && t != xi;
  }
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunReshape(RunCtx& c, const GraphOp& op) {
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  if (ParamsOf<ReshapeParams>(op).move && c.g->buffers[xi].size() == c.g->buffers[yi].size()) {
    std::swap(c.g->buffers[xi], c.g->buffers[yi]);
    return Status::Ok();
  }
  const int xd = c.DType(xi);
  const int64_t n = Numel(c.Shape(xi));
  std::memcpy(c.Buf(yi), c.Buf(xi), static_cast<size_t>(n) * ((xd == kF32 || xd == kI32) ? 4 : 1));
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kReshapeDef = {PrepareReshape, RunReshape, ValueRange::kInput};

}  // namespace qdsl

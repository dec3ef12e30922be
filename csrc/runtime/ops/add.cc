// ADD: elementwise sum of two quantized tensors, each rescaled, then an output stage
// (docs/qgraph.md §4.4).  Vector kernels from dispatch (SelectAddKernel); AddRef is the
// scalar rule they equal bit for bit.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/add.h"
#include "threads/thread_pool.h"

namespace qdsl {

void AddRef(const AddParams& p, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y) {
  const int pre = p.pre_shift;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = 0;
    for (int k = 0; k < 2; ++k) {
      const Rescale& r = p.in[k].stage.rescale;
      const int64_t d =
          static_cast<int64_t>(k == 0 ? LoadValue(x0, d0, i) : LoadValue(x1, d1, i)) - p.in[k].stage.zero_point;
      // numpy's int64 '<<' wraps; so does a uint64 shift (only reachable with I32 operands)
      const int64_t v = static_cast<int64_t>(static_cast<uint64_t>(d) << pre);
      t += RescaleOne(v, r.kind, r.multiplier[0], r.shift[0], r.rounding);
    }
    y[i] = static_cast<uint8_t>(ApplyStage(Sat32(t), p.out.stage, 0));
  }
}

void AddRange(const AddParams& p, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y,
              bool y_signed, uint32_t path) {
  if (const AddKernel vec = path == kPathRef ? nullptr : SelectAddKernel(path)) {
    const OutputStage in2[2] = {p.in[0].stage, p.in[1].stage};
    if (vec(x0, d0, x1, d1, n, in2, p.pre_shift, p.out.stage, y, y_signed)) return;
    // the AVX2 kernel takes every ADD the format allows; paths above AVX2 have it too
    const AddKernel general = path > kPathAvx2 ? SelectAddKernel(kPathAvx2) : nullptr;
    if (general != nullptr && general != vec && general(x0, d0, x1, d1, n, in2, p.pre_shift, p.out.stage, y, y_signed)) {
      return;
    }
  }
  AddRef(p, x0, d0, x1, d1, n, y);
}

Status PrepareAdd(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  auto p = std::make_shared<AddParams>();
  QDSL_RETURN_IF_ERROR(ReadInputRescales(g, op, index, /*concat=*/false, shape, &p->in));
  const int64_t pre = op.attrs.at("pre_shift").i;
  OP_CHECK(pre >= 0 && pre <= 31, "pre_shift outside [0, 31]");
  p->pre_shift = static_cast<int>(pre);
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, g->tensors[op.outputs[0]].dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "ADD rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunAdd(RunCtx& c, const GraphOp& op) {
  const AddParams& p = ParamsOf<AddParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const uint8_t* x = c.Buf(xi);
  const uint8_t* x1 = c.Buf(op.inputs[1]);
  uint8_t* y = c.Buf(yi);
  const int xd = c.DType(xi), xd1 = c.DType(op.inputs[1]), yd = c.DType(yi);
  const int64_t e0 = xd == kI32 ? 4 : 1, e1 = xd1 == kI32 ? 4 : 1;
  // chunks of 8K elements over the pool: the op streams its inputs once.  A FIXED_SINGLE
  // rescale (64-bit products, rounded in 64-bit lanes on AVX2) costs about three times a
  // FIXED or POT one per element: weigh the work by it, so a 32K-element ADD with one such
  // input (0.08 ms alone) takes both cores.
  int64_t weight = 1;
  for (int k = 0; k < 2; ++k) weight += p.in[k].stage.rescale.kind == RescaleKind::kFixedSingle ? 2 : 0;
  weight += p.out.stage.rescale.kind == RescaleKind::kFixedSingle ? 2 : 0;
  ParallelRanges(n, FineChunk(n, /*chunk=*/8192, /*min_chunk=*/1024, n * 64 * weight), /*work=*/n * 64 * weight, [&](int64_t i0, int64_t i1) {
    AddRange(p, x + i0 * e0, xd, x1 + i0 * e1, xd1, i1 - i0, y + i0, yd == kI8, c.path);
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kAddDef = {PrepareAdd, RunAdd, ValueRange::kStage};

}  // namespace qdsl

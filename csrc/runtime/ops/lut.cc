// LUT: y = table[x - min(x's dtype)], an I8/U8 -> I8/U8 byte gather over 256 entries
// (docs/qgraph.md §4.4).  The table is stored as the output's bytes once, at prepare.
#include <algorithm>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct LutParams : OpParams {
  uint8_t table[256] = {};  // indexed by the input byte (an I8 code's two's complement byte)
};

}  // namespace

Status PrepareLut(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype), "LUT input must be I8/U8");
  OP_CHECK(IsInt8(out.dtype), "LUT output must be I8/U8");
  const std::vector<int64_t>& t = op.attrs.at("table").ints;
  OP_CHECK(t.size() == 256, "attribute 'table' must have 256 entries (one per input code), got %zu", t.size());
  int64_t lo, hi, in_lo, in_hi;
  DTypeRange(out.dtype, &lo, &hi);
  DTypeRange(x.dtype, &in_lo, &in_hi);
  auto p = std::make_shared<LutParams>();
  for (int i = 0; i < 256; ++i) {
    OP_CHECK(t[i] >= lo && t[i] <= hi, "table entry %d = %lld outside the output dtype [%lld, %lld]", i,
             static_cast<long long>(t[i]), static_cast<long long>(lo), static_cast<long long>(hi));
    // entry i is input code in_lo + i; its byte is that code's low 8 bits
    p->table[static_cast<uint8_t>(in_lo + i)] = static_cast<uint8_t>(t[i]);
  }
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunLut(RunCtx& c, const GraphOp& op) {
  const LutParams& p = ParamsOf<LutParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  ParallelRanges(n, /*chunk=*/16384, /*work=*/n * 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = p.table[x[i]];
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kLutDef = {PrepareLut, RunLut, ValueRange::kStage};  // no out_min/max: the dtype's range

}  // namespace qdsl

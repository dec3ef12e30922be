// LUT: y = table[x - min(x's dtype)], an I8/U8 -> I8/U8 byte gather over 256 entries;
// LUT_CHANNEL: y = table[256·c + x - min(x's dtype)], one such table per channel (axis 1)
// (docs/qgraph.md §4.4).  The tables are stored as the output's bytes once, at prepare.
// The scalar gather is the reference; paths with a LutKernel (dispatch.h) run it instead.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct LutParams : OpParams {
  uint8_t table[256] = {};  // indexed by the input byte (an I8 code's two's complement byte)
};

struct LutChannelParams : OpParams {
  std::vector<uint8_t> table;  // [channel][input byte]
};

// Checks `count` tables of 256 entries and stores entry (k, i) at dst[k·256 + byte of code in_lo + i].
Status ReadTables(const Graph* g, const GraphOp& op, int index, int64_t count, uint8_t* dst) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype), "LUT input must be I8/U8");
  OP_CHECK(IsInt8(out.dtype), "LUT output must be I8/U8");
  const std::vector<int64_t>& t = op.attrs.at("table").ints;
  OP_CHECK(static_cast<int64_t>(t.size()) == 256 * count,
           "attribute 'table' must have %lld entries (256 per input code%s), got %zu",
           static_cast<long long>(256 * count), count > 1 ? " and channel" : "", t.size());
  int64_t lo, hi, in_lo, in_hi;
  DTypeRange(out.dtype, &lo, &hi);
  DTypeRange(x.dtype, &in_lo, &in_hi);
  for (int64_t k = 0; k < count; ++k) {
    for (int i = 0; i < 256; ++i) {
      const int64_t v = t[k * 256 + i];
      OP_CHECK(v >= lo && v <= hi, "table entry %lld = %lld outside the output dtype [%lld, %lld]",
               static_cast<long long>(k * 256 + i), static_cast<long long>(v), static_cast<long long>(lo),
               static_cast<long long>(hi));
      // entry i is input code in_lo + i; its byte is that code's low 8 bits
      dst[k * 256 + static_cast<uint8_t>(in_lo + i)] = static_cast<uint8_t>(v);
    }
  }
  return Status::Ok();
}

}  // namespace

Status PrepareLut(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  auto p = std::make_shared<LutParams>();
  QDSL_RETURN_IF_ERROR(ReadTables(g, op, index, 1, p->table));
  op.prepared = std::move(p);
  return Status::Ok();
}

Status PrepareLutChannel(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  OP_CHECK(shape->size() >= 2 && (*shape)[1] >= 1, "LUT_CHANNEL needs a channel axis");
  auto p = std::make_shared<LutChannelParams>();
  p->table.assign(static_cast<size_t>(256 * (*shape)[1]), 0);
  QDSL_RETURN_IF_ERROR(ReadTables(g, op, index, (*shape)[1], p->table.data()));
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunLut(RunCtx& c, const GraphOp& op) {
  const LutParams& p = ParamsOf<LutParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const LutKernel kernel = c.path == kPathRef ? nullptr : SelectLutKernel(c.path);
  ParallelRanges(n, /*chunk=*/16384, /*work=*/n * 4, [&](int64_t i0, int64_t i1) {
    if (kernel != nullptr) {
      kernel(p.table, x + i0, i1 - i0, y + i0);
      return;
    }
    for (int64_t i = i0; i < i1; ++i) y[i] = p.table[x[i]];
  });
  return Status::Ok();
}

Status RunLutChannel(RunCtx& c, const GraphOp& op) {
  const LutChannelParams& p = ParamsOf<LutChannelParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = Numel(xs), channels = xs[1], inner = n / std::max<int64_t>(xs[0] * channels, 1);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t planes = xs[0] * channels;
  const LutKernel kernel = c.path == kPathRef ? nullptr : SelectLutKernel(c.path);
  ParallelFor(static_cast<int>(planes), [&](int pl) {
    const uint8_t* table = p.table.data() + (pl % channels) * 256;
    const int64_t o = pl * inner;
    if (kernel != nullptr) {
      kernel(table, x + o, inner, y + o);
      return;
    }
    for (int64_t i = 0; i < inner; ++i) y[o + i] = table[x[o + i]];
  }, /*work=*/n * 4);
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kLutDef = {PrepareLut, RunLut, ValueRange::kStage};  // no out_min/max: the dtype's range
const OpDef kLutChannelDef = {PrepareLutChannel, RunLutChannel, ValueRange::kStage};

}  // namespace qdsl

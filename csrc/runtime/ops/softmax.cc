// SOFTMAX along the last axis of an I8/U8 input (docs/qgraph.md §4.4): per row,
//   E_i = table[x_i - max(x) + 255],  S = Σ E_i (int64),  Q_i = floor(E_i · 2^30 / S),
//   y_i = clamp(rescale(Q_i) + out_zp, out_min, out_max).
// Entries are in [0, 2^24] with table[255] >= 1, so S >= 1 and E_i · 2^30 < 2^54; E_i <= S
// keeps Q_i in [0, 2^30] (an int32 accumulator for the stage).
//
// Reference path: those lines as written.  Optimized paths, the same values: the row's max
// over typed bytes, E_i from an int32 copy of the table, Q_i by the exact vector division
// (FloorDivScaledKernel; portable: FloorDivByReciprocal), no int64 division per element, and
// the vectorized output stage (RequantKernel) over Q.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/last_axis.h"
#include "runtime/ops/softmax_row.h"

namespace qdsl {
namespace {

struct SoftmaxParams : OpParams {
  int64_t table[256] = {};
  int32_t table32[256] = {};  // the same entries (<= 2^24) for the optimized rows
  StageData out;
};

}  // namespace

Status PrepareSoftmax(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype) && IsInt8(out.dtype), "SOFTMAX input and output must be I8/U8");
  OP_CHECK(shape->size() >= 2, "SOFTMAX needs an axis besides the batch");
  const std::vector<int64_t>& t = op.attrs.at("table").ints;
  OP_CHECK(t.size() == 256, "attribute 'table' must have 256 entries, got %zu", t.size());
  auto p = std::make_shared<SoftmaxParams>();
  for (int i = 0; i < 256; ++i) {
    OP_CHECK(t[i] >= 0 && t[i] <= (int64_t{1} << 24), "table entry %d = %lld outside [0, 2^24]", i, (long long)t[i]);
    p->table[i] = t[i];
    p->table32[i] = static_cast<int32_t>(t[i]);
  }
  OP_CHECK(t[255] >= 1, "table[255] (exp(0)) must be >= 1");
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "SOFTMAX rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

namespace {

struct SoftmaxScratch {
  std::vector<int64_t> e;
  std::vector<int32_t> q;
};

}  // namespace

Status RunSoftmax(RunCtx& c, const GraphOp& op) {
  const SoftmaxParams& p = ParamsOf<SoftmaxParams>(op);
  const int dt = c.DType(op.inputs[0]);
  const bool out_signed = c.DType(op.outputs[0]) == kI8;
  const OutputStage& st = p.out.stage;
  if (c.path == kPathRef) {
    ForEachLastAxisRow<SoftmaxScratch>(c, op, 4 * kSoftmaxCost, [&](SoftmaxScratch& sc, const uint8_t* x, uint8_t* y, int64_t n) {
      sc.e.resize(static_cast<size_t>(n));
      int64_t* e = sc.e.data();
      int32_t mx = LoadValue(x, dt, 0);
      for (int64_t i = 1; i < n; ++i) mx = std::max(mx, LoadValue(x, dt, i));
      int64_t s = 0;
      for (int64_t i = 0; i < n; ++i) s += e[i] = p.table[LoadValue(x, dt, i) - mx + 255];
      for (int64_t i = 0; i < n; ++i) y[i] = static_cast<uint8_t>(ApplyStage((e[i] << 30) / s, st, 0));
    });
    return Status::Ok();
  }
  const RequantKernel requant = SelectRequantKernel(c.path);
  // S <= n · 2^24 must stay below 2^52 for the vector division (n < 2^28: any real row)
  const FloorDivScaledKernel div = SelectFloorDivScaledKernel(c.path);
  ForEachLastAxisRow<SoftmaxScratch>(c, op, kSoftmaxCost, [&](SoftmaxScratch& sc, const uint8_t* x, uint8_t* y, int64_t n) {
    sc.q.resize(static_cast<size_t>(2 * n));
    int32_t* e = sc.q.data() + n;
    if (dt == kU8) {
      SoftmaxRowFast(p.table32, x, static_cast<const uint8_t*>(nullptr), n, div, e, sc.q.data());
    } else {
      SoftmaxRowFast(p.table32, reinterpret_cast<const int8_t*>(x), static_cast<const uint8_t*>(nullptr), n, div, e,
                     sc.q.data());
    }
    requant(sc.q.data(), 1, n, n, st, 0, y, n, out_signed);
  });
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kSoftmaxDef = {PrepareSoftmax, RunSoftmax, ValueRange::kStage};

}  // namespace qdsl

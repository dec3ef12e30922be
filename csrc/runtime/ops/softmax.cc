// SOFTMAX along the last axis of an I8/U8 input (docs/qgraph.md §4.4): per row,
//   E_i = table[x_i - max(x) + 255],  S = Σ E_i (int64),  Q_i = floor(E_i · 2^30 / S),
//   y_i = clamp(rescale(Q_i) + out_zp, out_min, out_max).
// Entries are in [0, 2^24] with table[255] >= 1, so S >= 1 and E_i · 2^30 < 2^54; E_i <= S
// keeps Q_i in [0, 2^30] (an int32 accumulator for the stage).
#include <algorithm>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct SoftmaxParams : OpParams {
  int64_t table[256] = {};
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
  }
  OP_CHECK(t[255] >= 1, "table[255] (exp(0)) must be >= 1");
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "SOFTMAX rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunSoftmax(RunCtx& c, const GraphOp& op) {
  const SoftmaxParams& p = ParamsOf<SoftmaxParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int64_t n = xs.back(), rows = Numel(xs) / std::max<int64_t>(n, 1);
  const uint8_t* x = c.Buf(op.inputs[0]);
  const int dt = c.DType(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const OutputStage& st = p.out.stage;
  ParallelRanges(rows, /*chunk=*/16, /*work=*/rows * n * 16, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> e(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * n;
      int32_t mx = LoadValue(x, dt, o);
      for (int64_t i = 1; i < n; ++i) mx = std::max(mx, LoadValue(x, dt, o + i));
      int64_t s = 0;
      for (int64_t i = 0; i < n; ++i) s += e[i] = p.table[LoadValue(x, dt, o + i) - mx + 255];
      for (int64_t i = 0; i < n; ++i) y[o + i] = static_cast<uint8_t>(ApplyStage((e[i] << 30) / s, st, 0));
    }
  });
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kSoftmaxDef = {PrepareSoftmax, RunSoftmax, ValueRange::kStage};

}  // namespace qdsl

// MUL: y = clamp(rescale((x0 - zp0) * (x1 - zp1)) + out_zp, out_min, out_max), with numpy
// broadcasting of same-rank operands (docs/qgraph.md §4.4).  Each difference is in
// [-255, 255], so the product (|p| <= 65025) is exact in int32 and the stage reads it as an
// accumulator.
//
// The broadcast is planned once at prepare: dimensions of output size 1 are dropped and
// neighbours that both operands step through alike (each either along with the output or
// not at all) are merged, so squeeze-excitation's (N,C,H,W) * (N,C,1,1) is rows of H*W
// elements times one gate value each, and equal shapes are one flat row.  The run cuts the
// output's flat index range into chunks over the pool; each chunk walks its rows with a
// row kernel: a vector one from dispatch (SelectMulKernel) where the path has it, else
// MulRowRef, the exact scalar rule it equals bit for bit.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

// One merged dimension: its size (0 for the batch, known at run time) and whether each
// operand steps along it (else that operand is broadcast over it).
struct MulDim {
  int64_t size;
  bool step[2];
};

struct MulParams : OpParams {
  int32_t zp[2] = {0, 0};
  std::vector<MulDim> dims;  // outermost first; never empty (the batch is one)
  StageData out;
};

// The exact scalar rule over one row of n outputs; input k advances by step[k] (0 or 1).
void MulRowRef(const uint8_t* x0, int d0, int64_t s0, const uint8_t* x1, int d1, int64_t s1, int64_t n,
               int32_t zp0, int32_t zp1, const OutputStage& st, uint8_t* y) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = static_cast<int64_t>(LoadValue(x0, d0, i * s0) - zp0) * (LoadValue(x1, d1, i * s1) - zp1);
    y[i] = static_cast<uint8_t>(ApplyStage(p, st, 0));
  }
}

}  // namespace

Status PrepareMul(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x0 = g->tensors[op.inputs[0]];
  const GraphTensor& x1 = g->tensors[op.inputs[1]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(!x0.is_constant && !x1.is_constant && IsInt8(x0.dtype) && IsInt8(x1.dtype),
           "MUL inputs must be I8/U8 activations");
  OP_CHECK(IsInt8(out.dtype), "MUL output must be I8/U8");
  const std::vector<int64_t>& zp = op.attrs.at("in_zp").ints;
  OP_CHECK(zp.size() == 2, "attribute 'in_zp' needs 2 entries, got %zu", zp.size());
  auto p = std::make_shared<MulParams>();
  for (int k = 0; k < 2; ++k) {
    int64_t lo, hi;
    DTypeRange(k == 0 ? x0.dtype : x1.dtype, &lo, &hi);
    OP_CHECK(zp[k] >= lo && zp[k] <= hi, "in_zp %lld outside the dtype of input %d", (long long)zp[k], k);
    p->zp[k] = static_cast<int32_t>(zp[k]);
  }
  const std::vector<int64_t>& a = x0.dims;
  const std::vector<int64_t>& b = x1.dims;
  OP_CHECK(a.size() == b.size() && !a.empty() && a[0] == b[0],
           "MUL operands must have the same rank and batch (numpy broadcasting of the other dimensions)");
  shape->assign(a.begin(), a.end());
  p->dims.push_back({0, {true, true}});  // the batch: both operands step along it
  for (size_t d = 1; d < a.size(); ++d) {
    OP_CHECK(a[d] == b[d] || a[d] == 1 || b[d] == 1, "MUL operand dims %lld and %lld (dim %zu) do not broadcast",
             (long long)a[d], (long long)b[d], d);
    const int64_t n = std::max(a[d], b[d]);
    (*shape)[d] = n;
    if (n == 1) continue;  // no extent: neither operand moves
    const MulDim dim = {n, {a[d] == n, b[d] == n}};
    MulDim& last = p->dims.back();
    // row-major neighbours stepped alike are one dimension (not the batch: its size comes at run time)
    if (last.size != 0 && last.step[0] == dim.step[0] && last.step[1] == dim.step[1]) {
      last.size *= n;
    } else {
      p->dims.push_back(dim);
    }
  }
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "MUL rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunMul(RunCtx& c, const GraphOp& op) {
  const MulParams& p = ParamsOf<MulParams>(op);
  const uint8_t* x[2] = {c.Buf(op.inputs[0]), c.Buf(op.inputs[1])};
  const int dt[2] = {c.DType(op.inputs[0]), c.DType(op.inputs[1])};
  uint8_t* y = c.Buf(op.outputs[0]);
  const bool y_signed = c.DType(op.outputs[0]) == kI8;
  // sizes with the batch filled in, each operand's element stride per dimension (0: broadcast)
  const size_t nd = p.dims.size();
  std::vector<int64_t> size(nd), stride[2] = {std::vector<int64_t>(nd), std::vector<int64_t>(nd)};
  for (size_t d = 0; d < nd; ++d) size[d] = p.dims[d].size == 0 ? c.batch : p.dims[d].size;
  for (int k = 0; k < 2; ++k) {
    int64_t s = 1;
    for (size_t d = nd; d-- > 0;) {
      stride[k][d] = p.dims[d].step[k] ? s : 0;
      if (p.dims[d].step[k]) s *= size[d];
    }
  }
  int64_t total = 1;
  for (int64_t s : size) total *= s;
  const int64_t inner = size[nd - 1];
  const int64_t step0 = stride[0][nd - 1], step1 = stride[1][nd - 1];
  const MulKernel vec = c.path == kPathRef ? nullptr : SelectMulKernel(c.path);
  const OutputStage& st = p.out.stage;
  // the row kernel: one vector kernel call (false: parameters it does not take) or the rule
  auto row = [&](const uint8_t* a, const uint8_t* b, int64_t n, uint8_t* out) {
    if (vec != nullptr && vec(a, dt[0], step0, b, dt[1], step1, n, p.zp[0], p.zp[1], st, out, y_signed)) return;
    MulRowRef(a, dt[0], step0, b, dt[1], step1, n, p.zp[0], p.zp[1], st, out);
  };
  const int64_t weight = st.rescale.kind == RescaleKind::kFixedSingle ? 3 : 1;  // 64-bit lanes cost more
  ParallelRanges(total, /*chunk=*/8192, /*work=*/total * 64 * weight, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      // the operands' offsets of output element i (row-major over the merged dims)
      int64_t rest = i / inner, off0 = (i % inner) * step0, off1 = (i % inner) * step1;
      for (size_t d = nd - 1; d-- > 0;) {
        const int64_t idx = rest % size[d];
        rest /= size[d];
        off0 += idx * stride[0][d];
        off1 += idx * stride[1][d];
      }
      const int64_t n = std::min(i1 - i, inner - i % inner);
      row(x[0] + off0, x[1] + off1, n, y + i);  // 8-bit inputs: element offsets are byte offsets
      i += n;
    }
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kMulDef = {PrepareMul, RunMul, ValueRange::kStage};

}  // namespace qdsl

// RESIZE: separable two-tap interpolation along the 1 or 2 spatial axes (docs/qgraph.md §4.4).
// Output position j of axis d reads i0 = index[j] and i1 = min(i0 + 1, L_d - 1) with weights
// 2^F - weight[j] and weight[j]; the taps multiply across axes, the exact int64 sum of
// w·(x - in_zp) goes through one output stage (the wide rescale, which equals the int32 one
// for the int32-range sums of an I8/U8 input).  Nearest is F = 0, weights 0.  Scalar: an
// upsample moves little data next to the convolutions around it.
#include <algorithm>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct Taps {
  std::vector<int64_t> i0, i1, w0, w1;
};

struct ResizeParams : OpParams {
  Taps y, x;  // rank 1: y is one row with weight 1 (the 1-D sum unchanged)
  int32_t in_zp = 0;
  bool wide = false;  // an I32 input: sums beyond int32
  StageData out;
};

}  // namespace

Status PrepareResize(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape_out) {
  std::vector<int64_t>& shape = *shape_out;
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  const int rank = static_cast<int>(shape.size()) - 2;
  OP_CHECK((IsInt8(x.dtype) || x.dtype == kI32) && IsInt8(out.dtype),
           "RESIZE needs an I8/U8 (or I32) input and an I8/U8 output");
  OP_CHECK(rank == 1 || rank == 2, "RESIZE needs 1 or 2 spatial dims, got rank %d", rank + 2);
  OP_CHECK(x.dtype != kI32 || kHasWideRescale, "RESIZE of an I32 input needs a compiler with 128-bit integers");
  const int64_t f = A.at("frac_bits").i;
  OP_CHECK(f >= 0 && f <= 11, "frac_bits %lld outside [0, 11]", static_cast<long long>(f));
  const auto& size = A.at("size").ints;
  const auto& idx = A.at("index").ints;
  const auto& wt = A.at("weight").ints;
  OP_CHECK(static_cast<int>(size.size()) == rank, "attribute 'size' needs %d entries", rank);
  int64_t total = 0;
  for (int64_t s : size) {
    OP_CHECK(s >= 1 && s <= (int64_t{1} << 24), "output size %lld out of range", static_cast<long long>(s));
    total += s;
  }
  OP_CHECK(static_cast<int64_t>(idx.size()) == total && static_cast<int64_t>(wt.size()) == total,
           "attributes 'index' and 'weight' need %lld entries (the sum of 'size')", static_cast<long long>(total));
  auto p = std::make_shared<ResizeParams>();
  const int64_t one = int64_t{1} << f;
  int64_t start = 0;
  for (int d = 0; d < rank; ++d) {
    const int64_t in_len = shape[2 + d];
    Taps& t = (rank == 2 && d == 0) ? p->y : p->x;
    for (int64_t j = 0; j < size[d]; ++j) {
      const int64_t i = idx[start + j], w = wt[start + j];
      OP_CHECK(i >= 0 && i < in_len, "index %lld of spatial axis %d outside [0, %lld)", static_cast<long long>(i), d,
               static_cast<long long>(in_len));
      OP_CHECK(w >= 0 && w <= one, "weight %lld outside [0, 2^frac_bits]", static_cast<long long>(w));
      t.i0.push_back(i);
      t.i1.push_back(std::min(i + 1, in_len - 1));
      t.w0.push_back(one - w);
      t.w1.push_back(w);
    }
    start += size[d];
    shape[2 + d] = size[d];
  }
  if (rank == 1) p->y = Taps{{0}, {0}, {1}, {0}};  // one row, weight 1: the 1-D sum unchanged
  int64_t lo, hi;
  DTypeRange(x.dtype, &lo, &hi);
  OP_CHECK(A.at("in_zp").i >= lo && A.at("in_zp").i <= hi, "in_zp outside the input dtype");
  p->in_zp = static_cast<int32_t>(A.at("in_zp").i);
  p->wide = x.dtype == kI32;
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, shape[1], out.dtype, &p->out));
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunResize(RunCtx& c, const GraphOp& op) {
  const ResizeParams& p = ParamsOf<ResizeParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi), ys = c.Shape(yi);
  const int rank = static_cast<int>(xs.size()) - 2;
  const int64_t H = rank == 2 ? xs[2] : 1, W = xs.back(), OH = rank == 2 ? ys[2] : 1, OW = ys.back();
  const int64_t channels = xs[1], planes = xs[0] * xs[1];
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t zp = p.in_zp;
  const OutputStage& st = p.out.stage;
  auto row = [&](auto tag, int64_t pl, int64_t oy) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x) + pl * H * W;
    const T* r0 = src + p.y.i0[oy] * W;
    const T* r1 = src + p.y.i1[oy] * W;
    const int64_t a0 = p.y.w0[oy], a1 = p.y.w1[oy];
    uint8_t* dst = y + (pl * OH + oy) * OW;
    for (int64_t ox = 0; ox < OW; ++ox) {
      const int64_t c0 = p.x.i0[ox], c1 = p.x.i1[ox], b0 = p.x.w0[ox], b1 = p.x.w1[ox];
      // the reference's order: along H first, then W (every product exact in int64)
      const int64_t v0 = a0 * (r0[c0] - zp) + a1 * (r1[c0] - zp);
      const int64_t v1 = a0 * (r0[c1] - zp) + a1 * (r1[c1] - zp);
      dst[ox] = static_cast<uint8_t>(ApplyStage(b0 * v0 + b1 * v1, st, pl % channels, p.wide));
    }
  };
  ParallelFor(static_cast<int>(planes * OH), [&](int task) {
    const int64_t pl = task / OH, oy = task % OH;
    if (xd == kU8) {
      row(uint8_t{}, pl, oy);
    } else if (xd == kI32) {
      row(int32_t{}, pl, oy);
    } else {
      row(int8_t{}, pl, oy);
    }
  }, /*work=*/planes * OH * OW * 8);
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kResizeDef = {PrepareResize, RunResize, ValueRange::kStage};

}  // namespace qdsl

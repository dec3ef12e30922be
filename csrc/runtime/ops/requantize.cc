// REQUANTIZE: y = stage(x - in_zp), per tensor or per channel along axis 1 (docs/qgraph.md
// §4.1); the input is I8/U8, or I32 with in_zp 0 (a wide activation: LAYERNORM's I32 output).
// Segments of one channel (a plane, or 16K-element chunks of a per-tensor stage) run over the
// pool; I8/U8 inputs (and I32 with in_zp 0) go through the path's vector output stage
// (dispatch.h SelectRequantKernel) on int32 rows, else the scalar ApplyStage rule.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct RequantizeParams : OpParams {
  int32_t in_zp = 0;
  StageData out;
};

}  // namespace

Status PrepareRequantize(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK((IsInt8(x.dtype) || x.dtype == kI32) && IsInt8(out.dtype), "input must be I8/U8/I32, output I8/U8");
  int64_t lo, hi;
  DTypeRange(x.dtype, &lo, &hi);
  if (x.dtype == kI32) lo = hi = 0;  // a wide activation (LAYERNORM's I32 output): x - in_zp stays int32
  const int64_t in_zp = op.attrs.at("in_zp").i;
  OP_CHECK(in_zp >= lo && in_zp <= hi, "in_zp outside the input dtype");
  auto p = std::make_shared<RequantizeParams>();
  p->in_zp = static_cast<int32_t>(in_zp);
  // the stage may be per channel (axis 1)
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, shape->size() >= 2 ? (*shape)[1] : 1, out.dtype, &p->out));
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunRequantize(RunCtx& c, const GraphOp& op) {
  const RequantizeParams& p = ParamsOf<RequantizeParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = Numel(xs);
  const int64_t C = xs.size() >= 2 ? xs[1] : 1, inner = xs.size() >= 2 ? n / (xs[0] * C) : 1;
  const int32_t in_zp = p.in_zp;
  const OutputStage& st = p.out.stage;
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int xd = c.DType(xi), yd = c.DType(yi);
  const bool per_tensor = st.rescale.channels == 1;
  const int64_t chunk = 16384;
  // segments: per tensor, chunks of the flat tensor; per channel, chunks of each plane
  const int64_t seg = per_tensor ? chunk : std::min(inner, chunk);
  const int64_t per_plane = per_tensor ? 0 : (inner + seg - 1) / seg;
  const int64_t segs = per_tensor ? (n + seg - 1) / seg : (n / inner) * per_plane;
  const RequantKernel vec = c.path == kPathRef ? nullptr : SelectRequantKernel(c.path);
  const bool vec_ok = vec != nullptr && (yd == kI8 || yd == kU8) && (xd != kI32 || in_zp == 0) && seg >= 16;
  ParallelFor(static_cast<int>(segs), [&](int si) {
    int64_t i0, len, ch = 0;
    if (per_tensor) {
      i0 = si * seg;
      len = std::min(seg, n - i0);
    } else {
      const int64_t plane = si / per_plane, part = si % per_plane;
      ch = plane % C;
      i0 = plane * inner + part * seg;
      len = std::min(seg, inner - part * seg);
    }
    if (!vec_ok) {  // the scalar reference
      for (int64_t i = i0; i < i0 + len; ++i)
        y[i] = static_cast<uint8_t>(ApplyStage(LoadValue(x, xd, i) - in_zp, st, ch));
      return;
    }
    OutputStage one = st;  // this segment's channel as a per-tensor stage
    one.rescale.multiplier += ch;
    one.rescale.shift += ch;
    one.rescale.channels = 1;
    thread_local std::vector<int32_t> tmp;
    const int32_t* src;
    if (xd == kI32) {
      src = reinterpret_cast<const int32_t*>(x) + i0;
    } else {
      tmp.resize(static_cast<size_t>(len));
      if (xd == kU8) {
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(x[i0 + j]) - in_zp;
      } else {
        const int8_t* xs8 = reinterpret_cast<const int8_t*>(x);
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(xs8[i0 + j]) - in_zp;
      }
      src = tmp.data();
    }
    vec(src, 1, len, len, one, 0, y + i0, len, yd == kI8);
  }, /*work=*/n * 32);
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kRequantizeDef = {PrepareRequantize, RunRequantize, ValueRange::kStage};

}  // namespace qdsl

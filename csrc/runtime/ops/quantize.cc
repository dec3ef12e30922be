// QUANTIZE (F32 -> I8/U8) and DEQUANTIZE (I8/U8/BIN/I32 -> F32), docs/qgraph.md §4.1.
// QUANTIZE's vector kernel comes from dispatch (SelectQuantizeF32Kernel); QuantizeRef is
// the scalar rule it equals bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct QuantizeParams : OpParams {
  float inv = 1.f;  // f32(1 / scale): the reference multiplies by it in binary32
  int32_t zp = 0, qmin = 0, qmax = 0;
  int rounding = 0;
};

struct DequantizeParams : OpParams {
  float scale = 1.f;
  int64_t zp = 0;
};

double RoundF(double v, int mode) {
  switch (mode) {
    case 1: return std::rint(v);  // half even (default FE_TONEAREST)
    case 0: return v < 0 ? -std::floor(-v + 0.5) : (v > 0 ? std::floor(v + 0.5) : v);
    case 3: return std::floor(v + 0.5);
    default: return std::floor(v);
  }
}

// The scalar reference of QUANTIZE over n elements.
void QuantizeRef(const float* xf, int64_t n, const QuantizeParams& p, uint8_t* y) {
  const int64_t zp = p.zp, lo = p.qmin, hi = p.qmax;
  for (int64_t i = 0; i < n; ++i) {
    const float v = xf[i] * p.inv;  // binary32 multiply, as the reference
    int64_t q;
    if (std::isnan(v)) {
      q = ClampI64(zp, lo, hi);
    } else {
      const double r = RoundF(static_cast<double>(v), p.rounding) + static_cast<double>(zp);
      q = r < static_cast<double>(lo) ? lo : (r > static_cast<double>(hi) ? hi : static_cast<int64_t>(r));
    }
    y[i] = static_cast<uint8_t>(q);
  }
}

}  // namespace

Status PrepareQuantize(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  OP_CHECK(x.dtype == kF32 && IsInt8(out.dtype), "QUANTIZE maps F32 to I8/U8");
  int64_t lo, hi;
  DTypeRange(out.dtype, &lo, &hi);
  OP_CHECK(A.at("qmin").i >= lo && A.at("qmax").i <= hi && A.at("qmin").i <= A.at("qmax").i,
           "qmin/qmax outside the output dtype");
  OP_CHECK(std::isfinite(A.at("scale").f) && A.at("scale").f > 0, "scale must be finite and > 0");
  OP_CHECK(A.at("rounding").i >= 0 && A.at("rounding").i <= 3, "unknown rounding");
  OP_CHECK(std::llabs(A.at("zero_point").i) <= (1 << 20), "zero_point out of range");
  auto p = std::make_shared<QuantizeParams>();
  p->inv = 1.0f / A.at("scale").f;
  p->zp = static_cast<int32_t>(A.at("zero_point").i);
  p->qmin = static_cast<int32_t>(A.at("qmin").i);
  p->qmax = static_cast<int32_t>(A.at("qmax").i);
  p->rounding = static_cast<int>(A.at("rounding").i);
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunQuantize(RunCtx& c, const GraphOp& op) {
  const QuantizeParams& p = ParamsOf<QuantizeParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const int yd = c.DType(yi);
  const float* xf = reinterpret_cast<const float*>(c.Buf(xi));
  uint8_t* y = c.Buf(yi);
  const QuantizeF32Kernel vec = IsInt8(yd) ? SelectQuantizeF32Kernel(c.path) : nullptr;
  ParallelRanges(n, /*chunk=*/16384, /*work=*/(vec != nullptr ? n * 16 : n * 64), [&](int64_t i0, int64_t i1) {
    if (vec != nullptr) {
      vec(xf + i0, i1 - i0, p.inv, p.zp, p.qmin, p.qmax, p.rounding, y + i0, yd == kI8);
    } else {
      QuantizeRef(xf + i0, i1 - i0, p, y + i0);
    }
  });
  return Status::Ok();
}

Status PrepareDequantize(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  OP_CHECK((IsInt8(x.dtype) || x.dtype == kBin || x.dtype == kI32) && out.dtype == kF32,
           "DEQUANTIZE maps I8/U8/BIN/I32 to F32");
  OP_CHECK(std::isfinite(A.at("scale").f), "scale must be finite");
  OP_CHECK(std::llabs(A.at("zero_point").i) <= (1 << 20), "zero_point out of range");
  auto p = std::make_shared<DequantizeParams>();
  p->scale = A.at("scale").f;
  p->zp = A.at("zero_point").i;
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunDequantize(RunCtx& c, const GraphOp& op) {
  const DequantizeParams& p = ParamsOf<DequantizeParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  float* yf = reinterpret_cast<float*>(c.Buf(yi));
  ParallelRanges(n, /*chunk=*/16384, /*work=*/n * 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      yf[i] = static_cast<float>(static_cast<int64_t>(LoadValue(x, xd, i)) - p.zp) * p.scale;
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kQuantizeDef = {PrepareQuantize, RunQuantize, ValueRange::kQuantize};
const OpDef kDequantizeDef = {PrepareDequantize, RunDequantize, ValueRange::kStage};  // F32 output

}  // namespace qdsl

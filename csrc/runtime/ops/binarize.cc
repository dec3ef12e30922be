// BINARIZE: I8/U8/F32 -> BIN, -1 where x < zero_point else +1 (docs/qgraph.md §4.1).
// BINARIZE_CHANNEL: I8/U8 -> BIN, -1 where x < thresholds[c] else +1, c the channel
// (axis 1): a learned per-channel binarisation threshold on the producer's 8-bit grid.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "runtime/ops/op.h"

namespace qdsl {
namespace {

struct BinarizeParams : OpParams {
  int64_t zp = 0;
};

struct BinarizeChannelParams : OpParams {
  std::vector<int32_t> thresholds;  // per channel, within [min(dtype), max(dtype) + 1]
};

}  // namespace

Status PrepareBinarize(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK((IsInt8(x.dtype) || x.dtype == kF32) && out.dtype == kBin, "BINARIZE maps F32/I8/U8 to BIN");
  OP_CHECK(std::llabs(op.attrs.at("zero_point").i) <= (1 << 20), "zero_point out of range");
  auto p = std::make_shared<BinarizeParams>();
  p->zp = op.attrs.at("zero_point").i;
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunBinarize(RunCtx& c, const GraphOp& op) {
  const int64_t zp = ParamsOf<BinarizeParams>(op).zp;
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  for (int64_t i = 0; i < n; ++i) {
    bool neg;
    if (xd == kF32) {
      const float v = reinterpret_cast<const float*>(x)[i];
      neg = v < static_cast<float>(zp);  // NaN compares false: +1
    } else {
      neg = LoadValue(x, xd, i) < zp;
    }
    y[i] = static_cast<uint8_t>(static_cast<int8_t>(neg ? -1 : 1));
  }
  return Status::Ok();
}

Status PrepareBinarizeChannel(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype) && out.dtype == kBin, "BINARIZE_CHANNEL maps I8/U8 to BIN");
  OP_CHECK(shape->size() >= 2 && (*shape)[1] >= 1, "BINARIZE_CHANNEL needs a channel axis");
  const std::vector<int64_t>& t = op.attrs.at("thresholds").ints;
  OP_CHECK(static_cast<int64_t>(t.size()) == (*shape)[1], "attribute 'thresholds' must have %lld entries, got %zu",
           static_cast<long long>((*shape)[1]), t.size());
  const int64_t lo = x.dtype == kI8 ? -128 : 0, hi = x.dtype == kI8 ? 128 : 256;
  auto p = std::make_shared<BinarizeChannelParams>();
  for (int64_t v : t) {
    OP_CHECK(v >= lo && v <= hi, "threshold %lld out of range [%lld, %lld]", static_cast<long long>(v),
             static_cast<long long>(lo), static_cast<long long>(hi));
    p->thresholds.push_back(static_cast<int32_t>(v));
  }
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunBinarizeChannel(RunCtx& c, const GraphOp& op) {
  const BinarizeChannelParams& p = ParamsOf<BinarizeChannelParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = Numel(xs), channels = xs[1];
  const int64_t planes = xs[0] * channels, inner = n / std::max<int64_t>(planes, 1);
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  for (int64_t pl = 0; pl < planes; ++pl) {
    const int64_t t = p.thresholds[static_cast<size_t>(pl % channels)];
    for (int64_t i = pl * inner, e = i + inner; i < e; ++i) {
      y[i] = static_cast<uint8_t>(static_cast<int8_t>(LoadValue(x, xd, i) < t ? -1 : 1));
    }
  }
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kBinarizeDef = {PrepareBinarize, RunBinarize, ValueRange::kStage};  // BIN output
const OpDef kBinarizeChannelDef = {PrepareBinarizeChannel, RunBinarizeChannel, ValueRange::kStage};

}  // namespace qdsl

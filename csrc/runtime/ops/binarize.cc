// BINARIZE: I8/U8/F32 -> BIN, -1 where x < zero_point else +1 (docs/qgraph.md §4.1).
#include <cstdlib>

#include "runtime/ops/op.h"

namespace qdsl {
namespace {

struct BinarizeParams : OpParams {
  int64_t zp = 0;
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

// The op table's entries (op_schema.h names them by opcode).
const OpDef kBinarizeDef = {PrepareBinarize, RunBinarize, ValueRange::kStage};  // BIN output

}  // namespace qdsl

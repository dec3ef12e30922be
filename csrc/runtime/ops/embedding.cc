// EMBEDDING: y[..., :] = T[id, :] for every I32 token id, where T is the constant table
// requantized once at prepare, row by row:
//   T[v, d] = clamp(rescale(table[v, d] - w_zp, row v) + out_zp, out_min, out_max)
// (docs/qgraph.md §4.4; one rescale per tensor or one per row).  Run is a bounds-checked
// row copy: an id outside [0, V) returns kInvalidArgument naming the op, the id and its
// position, and nothing is read outside the table.
#include <cstring>

#include "qdsl/requant.h"
#include "runtime/ops/op.h"

namespace qdsl {
namespace {

struct EmbeddingParams : OpParams {
  int64_t rows = 0, dim = 0;
  std::vector<uint8_t> table;  // [rows][dim] output bytes (I8 as its two's complement byte)
};

}  // namespace

Status PrepareEmbedding(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& ids = g->tensors[op.inputs[0]];
  const GraphTensor& t = g->tensors[op.inputs[1]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(ids.dtype == kI32, "ids '%s' must be I32", ids.name.c_str());
  OP_CHECK(t.is_constant && IsInt8(t.dtype), "table '%s' must be an I8/U8 constant", t.name.c_str());
  OP_CHECK(t.dims.size() == 2 && t.dims[0] >= 1 && t.dims[1] >= 1, "table '%s' must be [V, D]", t.name.c_str());
  OP_CHECK(IsInt8(out.dtype), "output must be I8/U8");
  int64_t lo, hi;
  DTypeRange(t.dtype, &lo, &hi);
  const int64_t w_zp = op.attrs.at("w_zp").i;
  OP_CHECK(w_zp >= lo && w_zp <= hi, "w_zp %lld outside the table dtype", static_cast<long long>(w_zp));
  auto p = std::make_shared<EmbeddingParams>();
  p->rows = t.dims[0];
  p->dim = t.dims[1];
  StageData sd;
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, p->rows, out.dtype, &sd));  // the stage's channels are the rows
  p->table.resize(static_cast<size_t>(p->rows * p->dim));
  const bool per_row = sd.stage.rescale.channels > 1;
  for (int64_t v = 0; v < p->rows; ++v) {
    for (int64_t d = 0; d < p->dim; ++d) {
      const int64_t i = v * p->dim + d;
      p->table[i] = static_cast<uint8_t>(ApplyStage(t.values[i] - w_zp, sd.stage, per_row ? v : 0));
    }
  }
  shape->push_back(p->dim);  // ids.shape + (D,)
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunEmbedding(RunCtx& c, const GraphOp& op) {
  const EmbeddingParams& p = ParamsOf<EmbeddingParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const int64_t n = Numel(c.Shape(xi));
  const uint8_t* ids = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  for (int64_t i = 0; i < n; ++i) {
    int32_t id;
    std::memcpy(&id, ids + 4 * i, 4);
    QDSL_CHECK_ARG(id >= 0 && id < p.rows, "EMBEDDING '%s': token id %d at flat index %lld is outside [0, %lld)",
                   op.name.c_str(), id, static_cast<long long>(i), static_cast<long long>(p.rows));
    std::memcpy(y + i * p.dim, p.table.data() + id * p.dim, static_cast<size_t>(p.dim));
  }
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kEmbeddingDef = {PrepareEmbedding, RunEmbedding, ValueRange::kStage};

}  // namespace qdsl

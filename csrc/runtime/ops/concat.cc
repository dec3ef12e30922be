// CONCAT along `axis` with a per-input rescale, then out_zp and the clamp (docs/qgraph.md
// §4.4).  One task per (input, outer index) row; I8/U8 rows through the path's vector
// output stage (dispatch.h SelectRequantKernel), else the scalar rule.
#include <algorithm>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct ConcatParams : OpParams {
  std::vector<StageData> in;  // stage.zero_point = the input's zero point
  int64_t axis = 1;
  int64_t zp = 0, lo = 0, hi = 0;
};

}  // namespace

Status PrepareConcat(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  auto p = std::make_shared<ConcatParams>();
  QDSL_RETURN_IF_ERROR(ReadInputRescales(g, op, index, /*concat=*/true, shape, &p->in));
  const auto& A = op.attrs;
  int64_t lo, hi;
  DTypeRange(g->tensors[op.outputs[0]].dtype, &lo, &hi);
  OP_CHECK(A.at("out_zp").i >= lo && A.at("out_zp").i <= hi && A.at("out_min").i >= lo &&
               A.at("out_max").i <= hi && A.at("out_min").i <= A.at("out_max").i,
           "out_zp/out_min/out_max outside the output dtype");
  if (g->tensors[op.outputs[0]].dtype == kBin) {  // signs concatenated: nothing may move a ±1
    for (const StageData& sd : p->in)
      OP_CHECK(sd.stage.zero_point == 0 && sd.stage.rescale.kind == RescaleKind::kPot &&
                   sd.multiplier[0] == 1 && sd.shift[0] == 0,
               "a BIN CONCAT takes in_zp 0 and identity rescales (POT, 1, 0)");
    OP_CHECK(A.at("out_zp").i == 0 && A.at("out_min").i == -1 && A.at("out_max").i == 1,
             "a BIN CONCAT takes out_zp 0 and the clamp [-1, 1]");
  }
  p->axis = A.at("axis").i;
  p->zp = A.at("out_zp").i;
  p->lo = A.at("out_min").i;
  p->hi = A.at("out_max").i;
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunConcat(RunCtx& c, const GraphOp& op) {
  const ConcatParams& p = ParamsOf<ConcatParams>(op);
  const uint32_t yi = op.outputs[0];
  uint8_t* y = c.Buf(yi);
  const int yd = c.DType(yi);
  const std::vector<int64_t> ys = c.Shape(yi);
  const int64_t axis = p.axis;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= ys[d];
  for (size_t d = axis + 1; d < ys.size(); ++d) inner *= ys[d];
  const int64_t zp = p.zp, lo = p.lo, hi = p.hi;
  std::vector<int64_t> offsets(op.inputs.size() + 1, 0);
  for (size_t k = 0; k < op.inputs.size(); ++k) offsets[k + 1] = offsets[k] + c.Shape(op.inputs[k])[axis] * inner;
  const int64_t nin = static_cast<int64_t>(op.inputs.size());
  const RequantKernel vec = c.path == kPathRef ? nullptr : SelectRequantKernel(c.path);
  ParallelFor(static_cast<int>(nin * outer), [&](int task) {
    const int64_t k = task / outer, o = task % outer;
    const uint32_t ti = op.inputs[k];
    const int64_t len = offsets[k + 1] - offsets[k];
    const uint8_t* xs = c.Buf(ti);
    const int xdk = c.DType(ti);
    const Rescale& r = p.in[k].stage.rescale;
    const int32_t in_zp = p.in[k].stage.zero_point;
    uint8_t* dst = y + o * offsets[nin] + offsets[k];
    if (vec != nullptr && (xdk == kI8 || xdk == kU8) && (yd == kI8 || yd == kU8) && len >= 16) {
      OutputStage st;
      st.rescale = r;
      st.zero_point = static_cast<int32_t>(zp);
      st.qmin = static_cast<int32_t>(lo);
      st.qmax = static_cast<int32_t>(hi);
      thread_local std::vector<int32_t> tmp;
      tmp.resize(static_cast<size_t>(len));
      const uint8_t* src = xs + o * len;
      if (xdk == kU8) {
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(src[j]) - in_zp;
      } else {
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(static_cast<int8_t>(src[j])) - in_zp;
      }
      vec(tmp.data(), 1, len, len, st, 0, dst, len, yd == kI8);
      return;
    }
    for (int64_t j = 0; j < len; ++j) {  // the scalar reference
      const int64_t v = LoadValue(xs, xdk, o * len + j) - in_zp;
      dst[j] = static_cast<uint8_t>(ClampI64(RescaleOne(v, r.kind, r.multiplier[0], r.shift[0], r.rounding) + zp, lo, hi));
    }
  }, /*work=*/Numel(ys) * 32);
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kConcatDef = {PrepareConcat, RunConcat, ValueRange::kStage};

}  // namespace qdsl

// The graph runtime's op interface (larq compute-engine style): every op, or family of
// ops, has its own files under runtime/ops/ with
//
//   Status Prepare<Op>(Graph*, GraphOp&, int index, std::vector<int64_t>* shape)
//       checks the op against docs/qgraph.md (dtypes, attribute values; arity and the
//       attribute set were checked from op_schema.h), infers the output shape in *shape,
//       and stores a typed params struct (an OpParams) in GraphOp::prepared;
//   Status Run<Op>(RunCtx&, const GraphOp&)
//       executes it from those params alone (no attribute lookups by name at run time).
//
// The op's .cc registers the pair as `const OpDef k<Op>Def` (see the end of this file);
// the generated op_schema.h lists those by opcode (kOpDefs), OpDefFor reads it, and
// PrepareGraph (prepare.cc) and RunGraph (executor.cc) are loops over that table.  Where an op has a vector kernel
// (chosen through dispatch.h) its scalar reference sits beside it in the same file.
#ifndef QDSL_RUNTIME_OPS_OP_H_
#define QDSL_RUNTIME_OPS_OP_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "qdsl/gemm.h"
#include "qdsl/graph.h"
#include "runtime/ops/op_schema.h"

namespace qdsl {

// Base of every op's checked, precomputed parameters (GraphOp::prepared).
struct OpParams {
  virtual ~OpParams() = default;
};

// The typed params of an op prepared by the table entry that stores P.
template <class P>
const P& ParamsOf(const GraphOp& op) {
  return static_cast<const P&>(*op.prepared);
}

// A stage's arrays copied out of the attribute map (OutputStage points into them).
struct StageData {
  std::vector<int32_t> multiplier, shift;
  OutputStage stage;
  bool present = false;
};

// Graph::nhwc for runs on kernel path `path` (runtime/prepare.cc).
void PlanNhwc(Graph* g, uint32_t path);
// Graph::segments for runs of `batch` images with a cache budget of `budget` bytes (0: none),
// and the budget the environment asks for (QDSL_SEGMENT, QDSL_SEGMENT_KB; runtime/segment.cc).
void PlanSegments(Graph* g, int64_t batch, int64_t budget);
int64_t SegmentBudgetFromEnv();

// One graph run: the graph, its batch size and the resolved kernel path.
struct RunCtx {
  Graph* g;
  int64_t batch;
  uint32_t path;  // one resolved path bit (ResolvePath)
  size_t index;   // the running op's index
  uint8_t* Buf(uint32_t t) const { return g->buffers[t].data(); }
  std::vector<int64_t> Shape(uint32_t t) const { return ShapeFor(g->tensors[t], batch); }
  int DType(uint32_t t) const { return g->tensors[t].dtype; }
};

using PrepareFn = Status (*)(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape);
using RunFn = Status (*)(RunCtx& c, const GraphOp& op);

// The proven value range of an op's I8/U8 output (GraphTensor::value_min/max).
enum class ValueRange {
  kStage,     // out_min/out_max when the op has them (every output stage, CONCAT), else the dtype's
  kQuantize,  // qmin/qmax
  kClamp,     // the input's range clamped to out_min/out_max (monotone)
  kInput,     // the input's range (ops that only move values; padding never wins a max pool)
};

struct OpDef {
  PrepareFn prepare;
  RunFn run;
  ValueRange range;
};

// The table entry of a loaded opcode (1..kMaxOpcode: the loader admits no other).
const OpDef& OpDefFor(int opcode);

// ---- helpers shared by the ops' Prepare functions ----

// A failed check in a Prepare function (needs `op` and `index` in scope).
#define OP_CHECK(cond, ...)                                                                                      \
  do {                                                                                                           \
    if (!(cond)) {                                                                                               \
      const Status _s = MakeStatus(StatusCode::kFormatError, __VA_ARGS__);                                      \
      return MakeStatus(StatusCode::kFormatError, "op %d '%s': %s", index, op.name.c_str(), _s.message().c_str()); \
    }                                                                                                            \
  } while (0)

inline bool IsInt8(int d) { return d == kI8 || d == kU8; }
// Smallest and largest logical value of a dtype (F32/I32: the int32 range).
void DTypeRange(int d, int64_t* lo, int64_t* hi);
// Reads an output stage (rq_* and out_* attributes) for `channels` channels into *sd.
Status ReadStage(const GraphOp& op, int index, int64_t channels, int out_dtype, StageData* sd);
// ADD / CONCAT: checks the inputs and reads their per-input rescales (in_* attributes);
// CONCAT also infers the output shape along `axis`.
Status ReadInputRescales(Graph* g, const GraphOp& op, int index, bool concat, std::vector<int64_t>* shape,
                         std::vector<StageData>* in);

// ---- helpers shared by the ops' Run functions ----

inline int32_t LoadValue(const uint8_t* b, int dtype, int64_t i) {
  if (dtype == kI32) {
    int32_t v;
    std::memcpy(&v, b + 4 * i, 4);
    return v;
  }
  return dtype == kU8 ? static_cast<int32_t>(b[i]) : static_cast<int32_t>(static_cast<int8_t>(b[i]));
}
inline int64_t ClampI64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

inline int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// ---- the ops ----
// Each op's .cc defines its Prepare and Run and its table entry `const OpDef k<Op>Def`
// (the name op_schema.h's generated kOpDefs expects, from csrc/gen_op_schema.py); nothing
// here changes per op.  Families share a header (conv.h, add.h).

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_OP_H_

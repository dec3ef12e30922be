// ADD's params and element loop, shared with the AMX conv that computes a fused residual
// ADD in its epilogue (ConvParams::fused_add).
#ifndef QDSL_RUNTIME_OPS_ADD_H_
#define QDSL_RUNTIME_OPS_ADD_H_

#include <vector>

#include "runtime/ops/op.h"

namespace qdsl {

struct AddParams : OpParams {
  std::vector<StageData> in;  // per-input rescale (per tensor); stage.zero_point = the input's zero point
  int pre_shift = 0;
  StageData out;
};

// ADD (docs/qgraph.md §4.4) over elements [0, n) of flat inputs x0 (dtype d0), x1 (d1) into
// y: the path's vector kernel where it handles the parameters, else AddRef.
void AddRange(const AddParams& p, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y,
              bool y_signed, uint32_t path);
// The exact scalar rule.
void AddRef(const AddParams& p, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y);

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_ADD_H_

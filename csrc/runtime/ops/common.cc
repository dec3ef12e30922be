// Prepare-time helpers shared by the ops: dtype ranges and output stages read from the
// attributes (docs/qgraph.md §4.1).
#include <cstdlib>

#include "runtime/ops/op.h"

namespace qdsl {

void DTypeRange(int d, int64_t* lo, int64_t* hi) {
  switch (d) {
    case kI8: *lo = -128; *hi = 127; return;
    case kU8: *lo = 0; *hi = 255; return;
    case kI4: *lo = -8; *hi = 7; return;
    case kU4: *lo = 0; *hi = 15; return;
    case kI2: *lo = -2; *hi = 1; return;
    case kU2: *lo = 0; *hi = 3; return;
    case kBin: *lo = -1; *hi = 1; return;
    default: *lo = INT32_MIN; *hi = INT32_MAX; return;
  }
}

Status ReadStage(const GraphOp& op, int index, int64_t channels, int out_dtype, StageData* sd) {
  const auto& a = op.attrs;
  sd->multiplier.assign(a.at("rq_multiplier").ints.begin(), a.at("rq_multiplier").ints.end());
  sd->shift.assign(a.at("rq_shift").ints.begin(), a.at("rq_shift").ints.end());
  const auto& m = a.at("rq_multiplier").ints;
  const auto& s = a.at("rq_shift").ints;
  OP_CHECK(m.size() == s.size() && (m.size() == 1 || static_cast<int64_t>(m.size()) == channels),
           "rq_multiplier/rq_shift lengths %zu/%zu do not match 1 or %lld channels", m.size(), s.size(),
           (long long)channels);
  for (size_t i = 0; i < m.size(); ++i) {
    OP_CHECK(m[i] >= INT32_MIN && m[i] <= INT32_MAX && s[i] >= -64 && s[i] <= 64, "rescale value out of range");
  }
  const int64_t kind = a.at("rq_kind").i, rounding = a.at("rq_rounding").i;
  OP_CHECK(kind >= 0 && kind <= 2, "unknown rq_kind %lld", (long long)kind);
  OP_CHECK(rounding >= 0 && rounding <= 3, "unknown rq_rounding %lld", (long long)rounding);
  OutputStage& st = sd->stage;
  st.rescale.kind = static_cast<RescaleKind>(kind);
  st.rescale.rounding = static_cast<Rounding>(rounding);
  st.rescale.multiplier = sd->multiplier.data();
  st.rescale.shift = sd->shift.data();
  st.rescale.channels = static_cast<int64_t>(m.size());
  const Status v = ValidateRescale(st.rescale, st.rescale.channels);
  OP_CHECK(v.ok(), "%s", v.message().c_str());
  int64_t lo, hi;
  DTypeRange(out_dtype, &lo, &hi);
  const int64_t zp = a.at("out_zp").i, omin = a.at("out_min").i, omax = a.at("out_max").i;
  OP_CHECK(zp >= lo && zp <= hi, "out_zp %lld outside the output dtype", (long long)zp);
  OP_CHECK(omin >= lo && omax <= hi && omin <= omax, "out_min/out_max [%lld, %lld] outside the output dtype",
           (long long)omin, (long long)omax);
  st.zero_point = static_cast<int32_t>(zp);
  st.qmin = static_cast<int32_t>(omin);
  st.qmax = static_cast<int32_t>(omax);
  sd->present = true;
  return Status::Ok();
}

}  // namespace qdsl

namespace qdsl {

Status ReadInputRescales(Graph* g, const GraphOp& op, int index, bool concat, std::vector<int64_t>* shape,
                         std::vector<StageData>* in) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  // CONCAT may concatenate signs: BIN inputs (held one ±1 int8 each) into a BIN output
  const bool bin = concat && out.dtype == kBin;
  OP_CHECK(IsInt8(out.dtype) || bin, "output must be I8/U8 (CONCAT: or BIN)");
  const size_t n = op.inputs.size();
  for (const char* key : {"in_zp", "in_kind", "in_multiplier", "in_shift", "in_rounding"})
    OP_CHECK(A.at(key).ints.size() == n, "attribute '%s' needs %zu entries", key, n);
  const int64_t axis = concat ? A.at("axis").i : 0;
  if (concat) OP_CHECK(axis >= 1 && axis < static_cast<int64_t>(shape->size()), "bad concat axis");
  if (concat) (*shape)[axis] = 0;
  for (size_t i = 0; i < n; ++i) {
    const GraphTensor& xi = g->tensors[op.inputs[i]];
    OP_CHECK(!xi.is_constant && (bin ? xi.dtype == kBin : (IsInt8(xi.dtype) || (!concat && xi.dtype == kI32))),
             "inputs must be I8/U8 activations (ADD: or I32; a BIN CONCAT: BIN)");
    OP_CHECK(xi.dims.size() == x.dims.size(), "input ranks differ");
    for (size_t d = 0; d < x.dims.size(); ++d)
      OP_CHECK(static_cast<int64_t>(d) == axis || xi.dims[d] == x.dims[d], "input shapes differ");
    if (concat) (*shape)[axis] += xi.dims[axis];
    int64_t lo, hi;
    DTypeRange(xi.dtype, &lo, &hi);
    OP_CHECK(A.at("in_zp").ints[i] >= lo && A.at("in_zp").ints[i] <= hi, "in_zp outside the input dtype");
    StageData sd;
    sd.multiplier = {static_cast<int32_t>(A.at("in_multiplier").ints[i])};
    sd.shift = {static_cast<int32_t>(A.at("in_shift").ints[i])};
    OP_CHECK(A.at("in_multiplier").ints[i] >= 0 && A.at("in_multiplier").ints[i] <= INT32_MAX &&
                 std::llabs(A.at("in_shift").ints[i]) <= 64 && A.at("in_kind").ints[i] >= 0 &&
                 A.at("in_kind").ints[i] <= 2 && A.at("in_rounding").ints[i] >= 0 && A.at("in_rounding").ints[i] <= 3,
             "per-input rescale %zu out of range", i);
    sd.stage.rescale.kind = static_cast<RescaleKind>(A.at("in_kind").ints[i]);
    sd.stage.rescale.rounding = static_cast<Rounding>(A.at("in_rounding").ints[i]);
    sd.stage.zero_point = static_cast<int32_t>(A.at("in_zp").ints[i]);  // the input zero point
    in->push_back(sd);
  }
  for (StageData& sd : *in) {  // pointers into the final vectors
    sd.stage.rescale.multiplier = sd.multiplier.data();
    sd.stage.rescale.shift = sd.shift.data();
    const Status v = ValidateRescale(sd.stage.rescale, 1);
    OP_CHECK(v.ok(), "%s", v.message().c_str());
  }
  return Status::Ok();
}

}  // namespace qdsl

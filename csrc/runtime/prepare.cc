// Graph validation after parsing (docs/qgraph.md §3-§5): op arity, exactly the listed
// attributes with their types and ranges, dtypes, topological order, and every declared
// output shape equal to the inferred one.  Also packs the weights of conv/linear ops
// once.  After PrepareGraph succeeds, the executor's index arithmetic is in bounds.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>

#include "runtime/ops.h"

namespace qdsl {
namespace {

#define OP_CHECK(cond, ...)                                                                          \
  do {                                                                                               \
    if (!(cond)) {                                                                                   \
      const Status _s = MakeStatus(StatusCode::kFormatError, __VA_ARGS__);                          \
      return MakeStatus(StatusCode::kFormatError, "op %d '%s': %s", index, op.name.c_str(), _s.message().c_str()); \
    }                                                                                                \
  } while (0)

enum { INT = 1, FLOAT = 2, INTS = 3 };

struct Schema {
  int min_in, max_in;  // max_in -1 = unbounded
  std::vector<std::pair<const char*, int>> attrs;
  bool stage;
};

const std::vector<std::pair<const char*, int>>& StageAttrs() {
  static const std::vector<std::pair<const char*, int>> a = {{"rq_kind", INT}, {"rq_multiplier", INTS},
      {"rq_shift", INTS}, {"rq_rounding", INT}, {"out_zp", INT}, {"out_min", INT}, {"out_max", INT}};
  return a;
}

const Schema& GetSchema(int opcode) {
  using V = std::vector<std::pair<const char*, int>>;
  const V acc = {{"acc_bits", INT}, {"overflow", INT}};
  const V spatial = {{"stride", INTS}, {"padding", INTS}, {"dilation", INTS}, {"groups", INT}};
  auto cat = [](V a, const V& b) { a.insert(a.end(), b.begin(), b.end()); return a; };
  const V in_rq = {{"in_zp", INTS}, {"in_kind", INTS}, {"in_multiplier", INTS}, {"in_shift", INTS},
                   {"in_rounding", INTS}};
  const V pool = {{"kernel", INTS}, {"stride", INTS}, {"padding", INTS}};
  static const std::vector<Schema> table = {
      {0, 0, {}, false},
      {1, 1, {{"scale", FLOAT}, {"zero_point", INT}, {"qmin", INT}, {"qmax", INT}, {"rounding", INT}}, false},
      {1, 1, {{"scale", FLOAT}, {"zero_point", INT}}, false},
      {1, 1, cat({{"in_zp", INT}}, StageAttrs()), false},
      {2, 3, cat(cat(spatial, acc), {{"in_zp", INT}, {"w_zp", INTS}}), true},
      {2, 3, cat(cat(spatial, acc), {{"in_zp", INT}, {"w_zp", INTS}}), true},
      {2, 3, cat(acc, {{"in_zp", INT}, {"w_zp", INTS}}), true},
      {2, 3, cat(spatial, acc), true},
      {2, 3, cat(spatial, acc), true},
      {2, 3, acc, true},
      {2, 2, cat(cat(in_rq, {{"pre_shift", INT}}), StageAttrs()), false},
      {1, -1, cat(in_rq, {{"axis", INT}, {"out_zp", INT}, {"out_min", INT}, {"out_max", INT}}), false},
      {1, 1, {{"out_min", INT}, {"out_max", INT}}, false},
      {1, 1, cat(pool, {{"dilation", INTS}}), false},
      {1, 1, cat(pool, {{"dilation", INTS}}), false},
      {1, 1, cat(cat(pool, {{"in_zp", INT}}), StageAttrs()), false},
      {1, 1, cat(cat(pool, {{"in_zp", INT}}), StageAttrs()), false},
      {1, 1, cat({{"in_zp", INT}}, StageAttrs()), false},
      {1, 1, {{"shape", INTS}}, false},
      {1, 1, {{"zero_point", INT}}, false},
  };
  return table[opcode];
}

bool IsInt8(int d) { return d == kI8 || d == kU8; }
void Range(int d, int64_t* lo, int64_t* hi) {
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

// Reads a stage (or a per-input rescale, prefix "in_" at position i) out of the attributes.
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
  Range(out_dtype, &lo, &hi);
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

}  // namespace

Status PrepareConv(Graph* g, GraphOp& op, int index, std::vector<int64_t>* out_shape);  // prepare_conv.cc

Status ReadStageFor(const GraphOp& op, int index, int64_t channels, int out_dtype, StageData* sd) {
  return ReadStage(op, index, channels, out_dtype, sd);
}

// Marks convs that can compute the ADD consuming their output (PreparedOp::fused_add).
void FuseResidualAdds(Graph* g) {
  const size_t nt = g->tensors.size();
  std::vector<int> producer(nt, -1), consumers(nt, 0);
  std::vector<char> is_output(nt, 0);
  for (uint32_t t : g->outputs) is_output[t] = 1;
  for (size_t i = 0; i < g->ops.size(); ++i) {
    producer[g->ops[i].outputs[0]] = static_cast<int>(i);
    for (uint32_t t : g->ops[i].inputs) ++consumers[t];
  }
  for (size_t bi = 0; bi < g->ops.size(); ++bi) {
    const GraphOp& add = g->ops[bi];
    if (add.opcode != kAdd || add.inputs.size() != 2 || add.inputs[0] == add.inputs[1]) continue;
    // the later-produced input's conv takes the ADD: the other one is ready by then
    int best = -1;
    for (int slot = 0; slot < 2; ++slot) {
      const uint32_t t = add.inputs[slot];
      const int a = producer[t];
      if (a < 0 || consumers[t] != 1 || is_output[t] || g->tensors[t].dtype != kI32) continue;
      const GraphOp& conv = g->ops[a];
      const PreparedOp* p = conv.prepared.get();
      if (p == nullptr || !p->amx_conv || !p->fast_acc || p->spatial == 0) continue;
      const int other = producer[add.inputs[1 - slot]];
      if (other >= a) continue;  // (graph inputs have no producer: -1)
      if (best < 0 || a > producer[add.inputs[best]]) best = slot;
    }
    if (best < 0) continue;
    PreparedOp& p = *g->ops[producer[add.inputs[best]]].prepared;
    p.fused_add = static_cast<int32_t>(bi);
    p.fused_slot = best;
  }
}

// PreparedOp::twins: a conv whose inputs (activation, weight and bias tensors) and prepared
// geometry equal an earlier conv's, both with the fast output stage (fast_acc).  The later
// conv's output is then written when the earlier one runs: only that conv produces it, and
// its inputs are the earlier one's, so they are ready.  (A fused ADD on the later conv only
// runs on the AMX path, which computes twins separately: the two never meet.)
void FindTwinConvs(Graph* g) {
  for (size_t j = 0; j < g->ops.size(); ++j) {
    const GraphOp& b = g->ops[j];
    const PreparedOp* pb = b.prepared.get();
    if (pb == nullptr || pb->spatial == 0 || pb->w16.empty() || !pb->fast_acc) continue;
    for (size_t i = 0; i < j; ++i) {
      GraphOp& a = g->ops[i];
      PreparedOp* pa = a.prepared.get();
      if (pa == nullptr || a.opcode != b.opcode || a.inputs != b.inputs || pa->w16.empty() || !pa->fast_acc) continue;
      if (pa->groups != pb->groups || pa->cin != pb->cin || pa->cout != pb->cout || pa->kh != pb->kh ||
          pa->kw != pb->kw || pa->sh != pb->sh || pa->sw != pb->sw || pa->ph != pb->ph || pa->pw != pb->pw ||
          pa->dh != pb->dh || pa->dw != pb->dw || pa->in_zp != pb->in_zp || pa->w_int != pb->w_int ||
          pa->bias != pb->bias)
        continue;
      pa->twins.push_back(static_cast<int32_t>(j));
      break;
    }
  }
}

bool AmxImplicitConv(const GraphOp& op) {
  const PreparedOp* p = op.prepared.get();
  return p != nullptr && p->amx_conv && p->fast_acc && p->spatial > 0;
}

// Graph::nhwc: start from every tensor an AMX implicit conv or an ADD produces, then drop
// tensors with another reader (or that are graph outputs) until stable; an ADD keeps both
// inputs and its output in one layout (it is elementwise: any layout, but the same).
void PlanNhwc(Graph* g) {
  const size_t nt = g->tensors.size();
  std::vector<char>& s = g->nhwc;
  s.assign(nt, 0);
  for (const GraphOp& op : g->ops)
    if (AmxImplicitConv(op) || op.opcode == kAdd) s[op.outputs[0]] = 1;
  for (uint32_t t : g->outputs) s[t] = 0;
  for (bool changed = true; changed;) {
    changed = false;
    for (const GraphOp& op : g->ops) {
      for (size_t k = 0; k < op.inputs.size(); ++k) {
        const uint32_t t = op.inputs[k];
        const bool reads_nhwc = (AmxImplicitConv(op) && k == 0) || op.opcode == kAdd;
        if (s[t] && !reads_nhwc) {
          s[t] = 0;
          changed = true;
        }
      }
      if (op.opcode == kAdd) {
        bool all = s[op.outputs[0]] != 0;
        for (uint32_t t : op.inputs) all = all && s[t];
        if (!all && (s[op.outputs[0]] || s[op.inputs[0]] || s[op.inputs[1]])) {
          s[op.outputs[0]] = 0;
          for (uint32_t t : op.inputs) s[t] = 0;
          changed = true;
        }
      }
    }
  }
}

// The output's proven value range (GraphTensor::value_min/max): the clamp the op applies
// (checked within the dtype above), the input's range for ops that only move values, else
// the dtype's range.
void SetValueRange(const GraphOp& op, const GraphTensor& x, GraphTensor* out) {
  if (!IsInt8(out->dtype)) return;
  const auto& A = op.attrs;
  switch (op.opcode) {
    case kQuantize:
      out->value_min = A.at("qmin").i;
      out->value_max = A.at("qmax").i;
      return;
    case kClamp: {  // monotone: the ends of the input range map to the ends of the output's
      const int64_t lo = A.at("out_min").i, hi = A.at("out_max").i;
      out->value_min = std::clamp(x.value_min, lo, hi);
      out->value_max = std::clamp(x.value_max, lo, hi);
      return;
    }
    case kMaxpool1d: case kMaxpool2d: case kReshape:  // padding taps never win a max pool
      out->value_min = x.value_min;
      out->value_max = x.value_max;
      return;
    default: {
      const auto lo = A.find("out_min"), hi = A.find("out_max");
      if (lo != A.end() && hi != A.end()) {  // every stage (and CONCAT) clamps its output
        out->value_min = lo->second.i;
        out->value_max = hi->second.i;
      }
    }
  }
}

Status PrepareGraph(Graph* g) {
  const int n_tensors = static_cast<int>(g->tensors.size());
  std::vector<char> ready(n_tensors, 0);
  for (int i = 0; i < n_tensors; ++i) ready[i] = g->tensors[i].is_constant;
  for (uint32_t t : g->inputs) {
    const GraphTensor& in = g->tensors[t];
    QDSL_CHECK(!in.is_constant && (in.dtype == kF32 || IsInt8(in.dtype)), StatusCode::kFormatError,
               "graph input '%s' must be an F32/I8/U8 activation", in.name.c_str());
    ready[t] = 1;
  }
  for (GraphTensor& t : g->tensors) Range(t.dtype, &t.value_min, &t.value_max);
  for (int index = 0; index < static_cast<int>(g->ops.size()); ++index) {
    GraphOp& op = g->ops[index];
    const Schema& sc = GetSchema(op.opcode);
    const int n_in = static_cast<int>(op.inputs.size());
    OP_CHECK(n_in >= sc.min_in && (sc.max_in < 0 || n_in <= sc.max_in), "wrong number of inputs (%d)", n_in);
    OP_CHECK(op.outputs.size() == 1, "ops have exactly one output");
    for (uint32_t t : op.inputs) OP_CHECK(ready[t], "input '%s' is not produced before this op", g->tensors[t].name.c_str());
    const uint32_t out_index = op.outputs[0];
    GraphTensor& out = g->tensors[out_index];
    OP_CHECK(!ready[out_index] && !out.is_constant, "output '%s' is produced twice or is a constant", out.name.c_str());
    ready[out_index] = 1;
    // Exactly the listed attributes, with the listed types.
    std::vector<std::pair<const char*, int>> want = sc.attrs;
    if (sc.stage && out.dtype != kBin) want.insert(want.end(), StageAttrs().begin(), StageAttrs().end());
    OP_CHECK(op.attrs.size() == want.size(), "has %zu attributes, expected %zu", op.attrs.size(), want.size());
    for (const auto& w : want) {
      auto it = op.attrs.find(w.first);
      OP_CHECK(it != op.attrs.end(), "missing attribute '%s'", w.first);
      OP_CHECK(it->second.type == w.second, "attribute '%s' has the wrong type", w.first);
    }
    const GraphTensor& x = g->tensors[op.inputs[0]];
    OP_CHECK(!x.is_constant, "first input '%s' must be an activation", x.name.c_str());
    auto prep = std::make_shared<PreparedOp>();
    op.prepared = prep;
    std::vector<int64_t> shape = x.dims;
    const auto& A = op.attrs;
    const int64_t channels = shape.size() >= 2 ? shape[1] : 1;
    switch (op.opcode) {
      case kQuantize: {
        OP_CHECK(x.dtype == kF32 && IsInt8(out.dtype), "QUANTIZE maps F32 to I8/U8");
        int64_t lo, hi;
        Range(out.dtype, &lo, &hi);
        OP_CHECK(A.at("qmin").i >= lo && A.at("qmax").i <= hi && A.at("qmin").i <= A.at("qmax").i,
                 "qmin/qmax outside the output dtype");
        OP_CHECK(std::isfinite(A.at("scale").f) && A.at("scale").f > 0, "scale must be finite and > 0");
        OP_CHECK(A.at("rounding").i >= 0 && A.at("rounding").i <= 3, "unknown rounding");
        OP_CHECK(std::llabs(A.at("zero_point").i) <= (1 << 20), "zero_point out of range");
        break;
      }
      case kDequantize:
        OP_CHECK((IsInt8(x.dtype) || x.dtype == kBin || x.dtype == kI32) && out.dtype == kF32,
                 "DEQUANTIZE maps I8/U8/BIN/I32 to F32");
        OP_CHECK(std::isfinite(A.at("scale").f), "scale must be finite");
        OP_CHECK(std::llabs(A.at("zero_point").i) <= (1 << 20), "zero_point out of range");
        break;
      case kBinarize:
        OP_CHECK((IsInt8(x.dtype) || x.dtype == kF32) && out.dtype == kBin, "BINARIZE maps F32/I8/U8 to BIN");
        OP_CHECK(std::llabs(A.at("zero_point").i) <= (1 << 20), "zero_point out of range");
        break;
      case kRequantize:
      case kGlobalAvgpool: {
        // GLOBAL_AVGPOOL also reads a layer's wide I32 output (docs/qgraph.md §4.4)
        OP_CHECK((IsInt8(x.dtype) || (op.opcode == kGlobalAvgpool && x.dtype == kI32)) && IsInt8(out.dtype),
                 "input and output must be I8/U8 (GLOBAL_AVGPOOL input: or I32)");
        int64_t lo, hi;
        Range(x.dtype, &lo, &hi);
        OP_CHECK(A.at("in_zp").i >= lo && A.at("in_zp").i <= hi, "in_zp outside the input dtype");
        // REQUANTIZE and GLOBAL_AVGPOOL stages may be per channel (axis 1)
        QDSL_RETURN_IF_ERROR(ReadStage(op, index, channels, out.dtype, &prep->out));
        if (op.opcode == kGlobalAvgpool) {
          OP_CHECK(shape.size() >= 3, "GLOBAL_AVGPOOL needs rank >= 3");
          for (size_t d = 2; d < shape.size(); ++d) shape[d] = 1;
        }
        break;
      }
      case kConv1d: case kConv2d: case kLinear: case kBconv1d: case kBconv2d: case kBlinear:
        QDSL_RETURN_IF_ERROR(PrepareConv(g, op, index, &shape));
        break;
      case kAdd:
      case kConcat: {
        OP_CHECK(IsInt8(out.dtype), "output must be I8/U8");
        const size_t n = op.inputs.size();
        for (const char* key : {"in_zp", "in_kind", "in_multiplier", "in_shift", "in_rounding"})
          OP_CHECK(A.at(key).ints.size() == n, "attribute '%s' needs %zu entries", key, n);
        int64_t axis = op.opcode == kConcat ? A.at("axis").i : 0;
        if (op.opcode == kConcat) OP_CHECK(axis >= 1 && axis < static_cast<int64_t>(shape.size()), "bad concat axis");
        if (op.opcode == kConcat) shape[axis] = 0;
        for (size_t i = 0; i < n; ++i) {
          const GraphTensor& xi = g->tensors[op.inputs[i]];
          OP_CHECK(!xi.is_constant && (IsInt8(xi.dtype) || (op.opcode == kAdd && xi.dtype == kI32)),
                   "inputs must be I8/U8 activations (ADD: or I32)");
          OP_CHECK(xi.dims.size() == x.dims.size(), "input ranks differ");
          for (size_t d = 0; d < x.dims.size(); ++d)
            OP_CHECK(static_cast<int64_t>(d) == axis || xi.dims[d] == x.dims[d], "input shapes differ");
          if (op.opcode == kConcat) shape[axis] += xi.dims[axis];
          int64_t lo, hi;
          Range(xi.dtype, &lo, &hi);
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
          prep->in.push_back(sd);
        }
        for (StageData& sd : prep->in) {
          sd.stage.rescale.multiplier = sd.multiplier.data();
          sd.stage.rescale.shift = sd.shift.data();
          const Status v = ValidateRescale(sd.stage.rescale, 1);
          OP_CHECK(v.ok(), "%s", v.message().c_str());
        }
        if (op.opcode == kAdd) {
          OP_CHECK(A.at("pre_shift").i >= 0 && A.at("pre_shift").i <= 31, "pre_shift outside [0, 31]");
          QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &prep->out));
          OP_CHECK(prep->out.multiplier.size() == 1, "ADD rescales are per tensor");
        } else {
          int64_t lo, hi;
          Range(out.dtype, &lo, &hi);
          OP_CHECK(A.at("out_zp").i >= lo && A.at("out_zp").i <= hi && A.at("out_min").i >= lo &&
                       A.at("out_max").i <= hi && A.at("out_min").i <= A.at("out_max").i,
                   "out_zp/out_min/out_max outside the output dtype");
        }
        break;
      }
      case kClamp: {
        OP_CHECK(IsInt8(x.dtype) && out.dtype == x.dtype, "CLAMP keeps its I8/U8 dtype");
        int64_t lo, hi;
        Range(out.dtype, &lo, &hi);
        OP_CHECK(A.at("out_min").i >= lo && A.at("out_max").i <= hi && A.at("out_min").i <= A.at("out_max").i,
                 "out_min/out_max outside the dtype");
        break;
      }
      case kMaxpool1d: case kMaxpool2d: case kAvgpool1d: case kAvgpool2d: {
        const int rank = (op.opcode == kMaxpool1d || op.opcode == kAvgpool1d) ? 1 : 2;
        const bool is_max = op.opcode == kMaxpool1d || op.opcode == kMaxpool2d;
        OP_CHECK((IsInt8(x.dtype) || (!is_max && x.dtype == kI32)) && IsInt8(out.dtype) &&
                     static_cast<int>(shape.size()) == 2 + rank,
                 "pool needs an I8/U8 (AVGPOOL: or I32) input of rank %d", 2 + rank);
        if (is_max) OP_CHECK(out.dtype == x.dtype, "MAXPOOL keeps its dtype");
        const auto& k = A.at("kernel").ints;
        const auto& s = A.at("stride").ints;
        const auto& p = A.at("padding").ints;
        std::vector<int64_t> d(rank, 1);
        if (is_max) d = A.at("dilation").ints;
        OP_CHECK(static_cast<int>(k.size()) == rank && static_cast<int>(s.size()) == rank &&
                     static_cast<int>(p.size()) == rank && static_cast<int>(d.size()) == rank,
                 "kernel/stride/padding/dilation need %d entries", rank);
        for (int i = 0; i < rank; ++i) {
          OP_CHECK(k[i] >= 1 && k[i] <= (1 << 20) && s[i] >= 1 && s[i] <= (1 << 20) && p[i] >= 0 && p[i] <= (1 << 20) &&
                       d[i] >= 1 && d[i] <= (1 << 20) &&
                       p[i] <= k[i] / 2, "bad pool window in dim %d", i);
          const int64_t len = shape[2 + i] + 2 * p[i] - d[i] * (k[i] - 1) - 1;
          OP_CHECK(len >= 0, "pool window larger than the input");
          shape[2 + i] = len / s[i] + 1;
        }
        if (!is_max) {
          int64_t lo, hi;
          Range(x.dtype, &lo, &hi);
          OP_CHECK(A.at("in_zp").i >= lo && A.at("in_zp").i <= hi, "in_zp outside the input dtype");
          QDSL_RETURN_IF_ERROR(ReadStage(op, index, shape[1], out.dtype, &prep->out));
        }
        break;
      }
      case kReshape: {
        OP_CHECK(out.dtype == x.dtype, "RESHAPE keeps its dtype");
        const auto& s = A.at("shape").ints;
        OP_CHECK(s.size() <= 7, "RESHAPE shape too long");
        std::vector<int64_t> ns = {shape[0]};
        int64_t n_new = 1, n_old = 1;
        for (int64_t v : s) {
          OP_CHECK(v >= 1 && v <= (int64_t{1} << 36), "RESHAPE entries must be >= 1");
          n_new *= v;
          OP_CHECK(n_new <= (int64_t{1} << 36), "RESHAPE too large");
          ns.push_back(v);
        }
        for (size_t i = 1; i < shape.size(); ++i) n_old *= shape[i];
        OP_CHECK(n_new == n_old, "RESHAPE changes the element count (%lld -> %lld)", (long long)n_old, (long long)n_new);
        shape = ns;
        break;
      }
      default:
        OP_CHECK(false, "unknown opcode %d", op.opcode);
    }
    SetValueRange(op, x, &out);
    OP_CHECK(out.dims == shape, "declared output shape of '%s' differs from the inferred shape", out.name.c_str());
  }
  for (uint32_t t : g->outputs)
    QDSL_CHECK(ready[t] && !g->tensors[t].is_constant, StatusCode::kFormatError, "graph output '%s' is never produced",
               g->tensors[t].name.c_str());
  for (int i = 0; i < n_tensors; ++i)
    QDSL_CHECK(ready[i], StatusCode::kFormatError, "activation '%s' is never produced", g->tensors[i].name.c_str());
  g->overflow.assign(g->ops.size(), 0);
  FuseResidualAdds(g);
  FindTwinConvs(g);
  PlanNhwc(g);
  return Status::Ok();
}

}  // namespace qdsl

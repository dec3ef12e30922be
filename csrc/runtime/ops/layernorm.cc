// LAYERNORM over the last axis, integer only (docs/qgraph.md §4.4).  The row is the sum of
// one or two inputs (I8/U8/I32; input 1 may be a constant (1, ...) over the batch), each
// rescaled to one grid as ADD does: x_i = sat32(Σ_j rescale_j(x_j,i - zp_j)).  Per row of N,
//   D_i = N·x_i - Σ x,  k = max(0, bitlen(max |D|) - 24),  D_i = round_half_away(D_i / 2^k),
//   W = Σ D_i² + round_half_away(eps / 4^k),  G = (62 - bitlen(W)) / 2,  R = isqrt(W · 4^G),
//   Z_i = round_half_away(D_i · 2^(G+16) / R) (0 when R = 0),  acc_i = Z_i·gamma_i + beta_i,
//   y_i = clamp(rescale(acc_i) + out_zp, out_min, out_max)  (I8/U8, or I32: the wide output).
// k is 0 in the narrow form (one I8/U8 input, identity rescale: |D| < 2^24).
// W < 2^62 (checked at prepare from N and eps); R < 2^31 and |D_i|·2^G <= R + 1, so the
// quotient's numerator stays below 2^49 and |Z_i| <= 2^16 + 1: acc fits int32.
//
// Reference path: the formula as written (k = 0 in the narrow form).  Optimized paths, every
// form, the same values (LayernormRowOpt): each input's rescaled int32 terms (typed loads, the
// vector StageI32Kernel; an I32 input at zero point 0 with the identity rescale is read in
// place), then the path's LayernormKernels (dispatch.h): the saturated pair sum with Σ, min and
// max in one pass (max |D| from min and max, so k needs no pass of its own), D_i and Σ D_i²
// in int32 lanes, and Z_i = floor((2·|D_i|·2^(G+16) + R) / 2R) by the exact vector division
// with acc_i = Z_i·gamma_i + beta_i from int32 copies of gamma and beta.  Then the vectorized
// output stage (RequantKernel; I32: StageI32Kernel, or none for the identity stage).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "dispatch.h"
#include "qdsl/requant.h"
#include "runtime/ops/last_axis.h"

namespace qdsl {
namespace {

struct LayernormParams : OpParams {
  std::vector<int64_t> gamma, beta;
  std::vector<int32_t> gamma32, beta32;  // the same values (14 bits, |beta| <= 2^30) for the optimized rows
  int64_t eps = 0;
  StageData out;
  std::vector<StageData> in;    // per input: zero point and rescale
  std::vector<int64_t> const1;    // a constant input 1, rescaled at prepare (repeats per batch row)
  std::vector<int32_t> const1_32;  // the same values (RescaleOne's results are int32) for the optimized rows
  bool out_identity = false;       // an I32 output whose stage is the identity: rows written in place
};

int BitLength(uint64_t v) {
  int b = 0;
  while (v != 0) {
    ++b;
    v >>= 1;
  }
  return b;
}

// Exact floor(sqrt(v)) for 0 <= v <= 2^62: the double estimate, stepped to r² <= v < (r+1)².
int64_t ISqrt(int64_t v) {
  int64_t r = static_cast<int64_t>(std::sqrt(static_cast<double>(v)));
  while (r > 0 && r * r > v) --r;
  while ((r + 1) * (r + 1) <= v) ++r;
  return r;
}

// round_half_away(v / 2^k) for k in [0, 62]
int64_t HalfAwayShift(int64_t v, int k) {
  if (k == 0) return v;
  const int64_t a = ((v < 0 ? -v : v) + (int64_t{1} << (k - 1))) >> k;
  return v < 0 ? -a : a;
}

}  // namespace

Status PrepareLayernorm(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const size_t n_in = op.inputs.size();
  OP_CHECK(IsInt8(out.dtype) || out.dtype == kI32, "LAYERNORM output must be I8/U8/I32");
  OP_CHECK(!x.is_constant, "LAYERNORM input 0 must be an activation");
  OP_CHECK(shape->size() >= 2 && shape->back() >= 1, "LAYERNORM needs a normalized axis");
  const int64_t n = shape->back();
  auto p = std::make_shared<LayernormParams>();
  const auto& A = op.attrs;
  for (const char* key : {"in_zp", "in_kind", "in_multiplier", "in_shift", "in_rounding"})
    OP_CHECK(A.at(key).ints.size() == n_in, "attribute '%s' needs %zu entries", key, n_in);
  for (size_t i = 0; i < n_in; ++i) {
    const GraphTensor& xi = g->tensors[op.inputs[i]];
    OP_CHECK(IsInt8(xi.dtype) || xi.dtype == kI32, "LAYERNORM inputs must be I8/U8/I32");
    if (i == 1) {
      bool same = xi.dims.size() == x.dims.size(), bcast = xi.is_constant && same && xi.dims[0] == 1;
      for (size_t d = 1; same && d < x.dims.size(); ++d) same = xi.dims[d] == x.dims[d];
      OP_CHECK(same && (bcast || xi.dims[0] == x.dims[0]), "input 1 must have input 0's shape (a constant: (1, ...))");
    }
    int64_t lo, hi;
    DTypeRange(xi.dtype, &lo, &hi);
    const int64_t zp = A.at("in_zp").ints[i], m = A.at("in_multiplier").ints[i], s = A.at("in_shift").ints[i];
    const int64_t kind = A.at("in_kind").ints[i], rnd = A.at("in_rounding").ints[i];
    OP_CHECK(zp >= lo && zp <= hi, "in_zp outside the input dtype");
    OP_CHECK(m >= 0 && m <= INT32_MAX && std::llabs(s) <= 64 && kind >= 0 && kind <= 2 && rnd >= 0 && rnd <= 3,
             "per-input rescale %zu out of range", i);
    StageData sd;
    sd.multiplier = {static_cast<int32_t>(m)};
    sd.shift = {static_cast<int32_t>(s)};
    sd.stage.rescale.kind = static_cast<RescaleKind>(kind);
    sd.stage.rescale.rounding = static_cast<Rounding>(rnd);
    sd.stage.zero_point = static_cast<int32_t>(zp);
    p->in.push_back(sd);
  }
  for (StageData& sd : p->in) {  // pointers into the final vectors
    sd.stage.rescale.multiplier = sd.multiplier.data();
    sd.stage.rescale.shift = sd.shift.data();
    const Status v = ValidateRescale(sd.stage.rescale, 1);
    OP_CHECK(v.ok(), "per-input rescale: %s", v.message().c_str());
  }
  if (n_in > 1 && g->tensors[op.inputs[1]].is_constant) {
    const GraphTensor& c1 = g->tensors[op.inputs[1]];
    const Rescale& q1 = p->in[1].stage.rescale;
    for (int64_t v : c1.values)
      p->const1.push_back(RescaleOne(v - p->in[1].stage.zero_point, q1.kind, q1.multiplier[0], q1.shift[0], q1.rounding));
    OP_CHECK(!p->const1.empty(), "constant input 1 is empty");
  }
  const Rescale& r0 = p->in[0].stage.rescale;
  const bool narrow = n_in == 1 && IsInt8(x.dtype) && r0.kind == RescaleKind::kPot && r0.shift[0] == 0 &&
                      r0.multiplier[0] == 1;
  p->gamma = op.attrs.at("gamma").ints;
  p->beta = op.attrs.at("beta").ints;
  p->eps = op.attrs.at("eps").i;
  OP_CHECK(static_cast<int64_t>(p->gamma.size()) == n && static_cast<int64_t>(p->beta.size()) == n,
           "gamma/beta need %lld entries", (long long)n);
  for (int64_t i = 0; i < n; ++i) {
    OP_CHECK(std::abs(p->gamma[i]) <= (1 << 14) - 1, "gamma entry %lld outside 14 bits", (long long)i);
    OP_CHECK(std::abs(p->beta[i]) <= (int64_t{1} << 30), "beta entry %lld outside [-2^30, 2^30]", (long long)i);
  }
  if (narrow) {
    OP_CHECK(p->eps >= 0 && n <= 40000 && n * n * n * 65025 + p->eps < (int64_t{1} << 62) && n * n * n * 65025 > 0,
             "row length %lld with eps %lld overflows the int64 variance sum", (long long)n, (long long)p->eps);
  } else {  // |D| <= 2^24 after the row shift: N·2^48 <= 2^61
    OP_CHECK(p->eps >= 0 && n <= 8192 && p->eps < (int64_t{1} << 61),
             "row length %lld (at most 8192) with eps %lld (below 2^61) overflows a wide LAYERNORM's variance sum",
             (long long)n, (long long)p->eps);
  }
  p->gamma32.assign(p->gamma.begin(), p->gamma.end());
  p->beta32.assign(p->beta.begin(), p->beta.end());
  p->const1_32.assign(p->const1.begin(), p->const1.end());
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "LAYERNORM rescales are per tensor");
  const OutputStage& so = p->out.stage;
  p->out_identity = out.dtype == kI32 && so.rescale.kind == RescaleKind::kPot && so.rescale.shift[0] == 0 &&
                    so.zero_point == 0 && so.qmin == INT32_MIN && so.qmax == INT32_MAX;
  op.prepared = std::move(p);
  return Status::Ok();
}

namespace {

// The header's formula as written, for every form (in the narrow form k = 0 and the rescale is
// the identity, so it is the narrow formula line by line): the reference path's rows.
// The call's operands, as both row runners read them.
struct LnCall {
  int64_t n, rows, work;
  const uint8_t* x;
  int dt;
  const uint8_t* x1;  // input 1 when it is an activation, else nullptr (a constant or none)
  int dt1;
  uint8_t* y;
  int ydt;
  LnCall(RunCtx& c, const GraphOp& op, const LayernormParams& p) {
    const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
    n = xs.back();
    rows = Numel(xs) / std::max<int64_t>(n, 1);
    const size_t n_in = op.inputs.size();
    work = rows * n * kLayernormCost * static_cast<int64_t>(n_in);
    x = c.Buf(op.inputs[0]);
    dt = c.DType(op.inputs[0]);
    const bool act1 = n_in > 1 && p.const1.empty();
    x1 = act1 ? c.Buf(op.inputs[1]) : nullptr;
    dt1 = act1 ? c.DType(op.inputs[1]) : 0;
    y = c.Buf(op.outputs[0]);
    ydt = c.DType(op.outputs[0]);
  }
};

void RunLayernormWide(RunCtx& c, const GraphOp& op, const LayernormParams& p) {
  const LnCall call(c, op, p);
  const int64_t n = call.n, rows = call.rows, work = call.work;
  const uint8_t* x = call.x;
  const uint8_t* x1 = call.x1;
  const int dt = call.dt, dt1 = call.dt1;
  const int64_t n1 = static_cast<int64_t>(p.const1.size());  // a (1, ...) constant repeats per batch row
  uint8_t* y = call.y;
  const bool y32 = call.ydt == kI32;  // the wide output
  const OutputStage& st = p.out.stage;
  ParallelRanges(rows, RowChunk(rows, work), work, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> d(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * n;
      int64_t sum = 0, most = 0;
      for (int64_t i = 0; i < n; ++i) {
        const Rescale& q0 = p.in[0].stage.rescale;
        int64_t v = RescaleOne(static_cast<int64_t>(LoadValue(x, dt, o + i)) - p.in[0].stage.zero_point, q0.kind,
                               q0.multiplier[0], q0.shift[0], q0.rounding);
        if (x1 != nullptr) {
          const Rescale& q1 = p.in[1].stage.rescale;
          v = Sat32(v + RescaleOne(static_cast<int64_t>(LoadValue(x1, dt1, o + i)) - p.in[1].stage.zero_point, q1.kind,
                                   q1.multiplier[0], q1.shift[0], q1.rounding));
        } else if (n1 > 0) {
          v = Sat32(v + p.const1[static_cast<size_t>((o + i) % n1)]);
        }
        d[i] = v;
        sum += v;
      }
      for (int64_t i = 0; i < n; ++i) {
        d[i] = n * d[i] - sum;
        most = std::max(most, d[i] < 0 ? -d[i] : d[i]);
      }
      const int k = std::max(0, BitLength(static_cast<uint64_t>(most)) - 24);
      int64_t w = HalfAwayShift(p.eps, 2 * k);
      for (int64_t i = 0; i < n; ++i) {
        d[i] = HalfAwayShift(d[i], k);
        w += d[i] * d[i];
      }
      const int gs = (62 - BitLength(static_cast<uint64_t>(w))) / 2;
      const int64_t root = ISqrt(w << (2 * gs));
      for (int64_t i = 0; i < n; ++i) {
        int64_t z = 0;
        if (root != 0) {
          const int64_t num = (d[i] < 0 ? -d[i] : d[i]) << (gs + 16);
          z = (2 * num + root) / (2 * root);
          if (d[i] < 0) z = -z;
        }
        const int32_t v = ApplyStage(z * p.gamma[i] + p.beta[i], st, 0);
        if (y32) {
          std::memcpy(y + 4 * (o + i), &v, 4);
        } else {
          y[o + i] = static_cast<uint8_t>(v);
        }
      }
    }
  });
}

// One row on the optimized paths, the same integers as RunLayernormWide, from the row's
// rescaled int32 terms t0 (+ t1) by the path's LayernormKernels (dispatch.h):
//   sum:       v = sat32(t0 + t1), Σ v and min/max v (int32 lanes, int64 sum);
//   k:         max |D_i| = max(n·max v - Σ v, Σ v - n·min v), no pass over D;
//   center:    D_i = round_half_away((n·v_i - Σ v) / 2^k) and Σ D_i².  After the shift
//              |D_i| <= 2^24 (bitlen(max|D| >> k) <= 24; half-away rounding may reach 2^24),
//              and |n·v_i - Σ v| <= n·(max v - min v) < 2^46 (n <= 8192 wide; the narrow form
//              has k = 0 and |D_i| <= 40000·255 < 2^24);
//   normalize: Z_i = round_half_away(D_i · 2^(G+16) / R) = sign(D_i)·floor((|D_i|·2^(G+17) + R) / 2R),
//              acc_i = Z_i·gamma_i + beta_i.  W >= D_i² gives |D_i|·2^G <= R, so the numerator
//              is below 2^51 and the quotient at most 2^16 + 1: |Z·gamma| < 2^31 - 2^30 and
//              |beta| <= 2^30, so int32 holds acc.
// v, d: scratch of n; acc: n outputs (the stage's input, or the I32 result itself).
void LayernormRowOpt(const LayernormParams& p, const LayernormKernels& ker, const int32_t* t0, const int32_t* t1,
                     int64_t n, int32_t* v, int32_t* d, int32_t* acc) {
  int64_t sum;
  int32_t lo, hi;
  ker.sum(t0, t1, n, v, &sum, &lo, &hi);
  const int32_t* x = t1 != nullptr ? v : t0;
  const int64_t most = std::max(n * hi - sum, sum - n * lo);
  const int k = std::max(0, BitLength(static_cast<uint64_t>(most)) - 24);
  const int64_t w = ker.center(x, n, sum, k, d) + HalfAwayShift(p.eps, 2 * k);
  const int gs = (62 - BitLength(static_cast<uint64_t>(w))) / 2;
  const int64_t root = ISqrt(w << (2 * gs));
  if (root == 0) {  // W = 0: every D_i = 0, so Z = 0
    std::memcpy(acc, p.beta32.data(), static_cast<size_t>(n) * 4);
    return;
  }
  ker.normalize(d, n, gs + 17, root, p.gamma32.data(), p.beta32.data(), acc);
}

// Input j's rescaled terms for one row: the row itself for an I32 input at zero point 0 with
// the identity rescale (MiniLM's LINEAR results), else x - zp loaded typed into t, then the
// path's vectorized one-channel int32 stage (StageI32Kernel, == ApplyStage: csrc/tests/test_main.cc)
// with zero point 0 and the int32 range as clamps, which is RescaleOne(x - zp) since x - zp
// fits int32 (8-bit inputs; I32 inputs at zero point 0).  An I32 input at another zero point
// (x - zp may pass int32: RescaleOne saturates it first) takes the scalar RescaleOne.
template <typename T>
void LoadMinusZp(const T* __restrict x, int64_t n, int32_t zp, int32_t* __restrict t) {
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(x[i]) - zp;
}

const int32_t* RescaleRow(const uint8_t* x, int dt, int64_t n, const StageData& in, StageI32Kernel stage, int32_t* t) {
  const Rescale& q = in.stage.rescale;
  const int32_t zp = in.stage.zero_point;
  const bool identity = q.kind == RescaleKind::kPot && q.shift[0] == 0 && q.multiplier[0] == 1;
  if (dt == kI32 && zp != 0) {
    const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
    for (int64_t i = 0; i < n; ++i)
      t[i] = static_cast<int32_t>(
          RescaleOne(static_cast<int64_t>(x32[i]) - zp, q.kind, q.multiplier[0], q.shift[0], q.rounding));
    return t;
  }
  if (dt == kI32 && identity) return reinterpret_cast<const int32_t*>(x);
  if (dt == kI32) {
    std::memcpy(t, x, static_cast<size_t>(n) * 4);
  } else if (dt == kI8) {
    LoadMinusZp(reinterpret_cast<const int8_t*>(x), n, zp, t);
  } else {
    LoadMinusZp(x, n, zp, t);
  }
  if (identity) return t;
  OutputStage one;
  one.rescale = q;
  one.zero_point = 0;
  one.qmin = INT32_MIN;
  one.qmax = INT32_MAX;
  stage(t, n, one, t);  // element-wise: in place is fine
  return t;
}

struct OptScratch {
  std::vector<int32_t> t0, t1, v, d, acc;
};

// Every form on the optimized paths: per row, each input's terms (RescaleRow), a (1, ...)
// constant input 1 as its rescaled int32 row, LayernormRowOpt, then the vectorized stage
// (RequantKernel for I8/U8; for I32 StageI32Kernel, or nothing when the stage is the identity:
// the row is computed straight into y).
void RunLayernormOpt(RunCtx& c, const GraphOp& op, const LayernormParams& p) {
  const LnCall call(c, op, p);
  const int64_t n = call.n, rows = call.rows, work = call.work;
  const uint8_t* x = call.x;
  const uint8_t* x1 = call.x1;
  const int dt = call.dt, dt1 = call.dt1;
  const int64_t n1 = static_cast<int64_t>(p.const1_32.size());
  uint8_t* y = call.y;
  const bool y32 = call.ydt == kI32;
  const bool out_signed = call.ydt == kI8;
  const OutputStage& st = p.out.stage;
  const RequantKernel requant = SelectRequantKernel(c.path);
  const StageI32Kernel stage_i32 = SelectStageI32Kernel(c.path);
  const LayernormKernels ker = SelectLayernormKernels(c.path);
  const int64_t xb = ElementBytes(dt) * n, x1b = ElementBytes(dt1) * n;
  ParallelRanges(rows, RowChunk(rows, work), work, [&](int64_t r0, int64_t r1) {
    thread_local OptScratch sc;
    for (auto* b : {&sc.t0, &sc.t1, &sc.v, &sc.d, &sc.acc}) b->resize(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * n;
      const int32_t* t0 = RescaleRow(x + r * xb, dt, n, p.in[0], stage_i32, sc.t0.data());
      const int32_t* t1 = nullptr;
      if (x1 != nullptr) {
        t1 = RescaleRow(x1 + r * x1b, dt1, n, p.in[1], stage_i32, sc.t1.data());
      } else if (n1 > 0) {
        t1 = p.const1_32.data() + (o % n1);  // n1 is a multiple of n: the row is contiguous
      }
      int32_t* acc = y32 && p.out_identity ? reinterpret_cast<int32_t*>(y + 4 * o) : sc.acc.data();
      LayernormRowOpt(p, ker, t0, t1, n, sc.v.data(), sc.d.data(), acc);
      if (y32 && !p.out_identity) {
        stage_i32(acc, n, st, reinterpret_cast<int32_t*>(y + 4 * o));
      } else if (!y32) {
        requant(acc, 1, n, n, st, 0, y + o, n, out_signed);
      }
    }
  });
}

}  // namespace

Status RunLayernorm(RunCtx& c, const GraphOp& op) {
  const LayernormParams& p = ParamsOf<LayernormParams>(op);
  if (c.path == kPathRef) {
    RunLayernormWide(c, op, p);
  } else {
    RunLayernormOpt(c, op, p);
  }
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kLayernormDef = {PrepareLayernorm, RunLayernorm, ValueRange::kStage};

}  // namespace qdsl

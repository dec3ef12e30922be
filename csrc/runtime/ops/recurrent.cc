// LSTM (35), GRU (36) and RNN (39): one recurrent layer and direction, looping over time inside the
// op (docs/qgraph.md §4.4).  The reference is qdsl/graph/ops/recurrent.py; this file equals
// it bit for bit.  Integer only, int64 throughout; one rounding primitive,
//
//   Rnd(v, s) = round_half_even(v / 2^s)   (s >= 1),
//
// factor pairs (m, s) meaning m·2^-s, gates in Q24 from one sigmoid table over [-16, 16]
// in steps of 1/128, interpolated quadratically from Q20 pre-activations; tanh(x) = 2σ(2x) - 1.
// The reference path runs each sample's scalar loop (RunSample; samples split across
// threads); the optimized paths (RunRecurrentFast) compute the same integer sums with the
// GEMM front door: all steps' input products at once, then the batch's hidden products per
// step, and the same scalar gates.
#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "qdsl/gemm.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

constexpr int64_t kTableSize = 4098;  // -16 + k/128, one past +16 for the second difference
constexpr int64_t kOne = int64_t{1} << 24;      // 1.0 in the gates' Q24
constexpr int64_t kMaxFeatures = 16384;         // F, H: the accumulators stay below 2^31
constexpr int64_t kBiasLimit = int64_t{1} << 30;
constexpr int64_t kPreLimit = int64_t{1} << 36;  // |Pih|, |Phh| clamp (Q20)

struct Factor {
  int64_t m = 0;
  int s = 1;
};

constexpr int64_t kReluLimit = int64_t{1} << 31;  // RNN relu: Q20 pre-activation clamp before h_m

struct RecurrentParams : OpParams {
  bool lstm = true, reverse = false;
  bool rnn = false, relu = false;  // RNN (39): one gate block, tanh or relu
  int64_t f = 0, h = 0, rows = 0;
  int64_t x_zp = 0, h_zp = 0, h_qmin = 0, h_qmax = 0, c_zp = 0, c_qmin = 0, c_qmax = 0;
  std::vector<int32_t> w_ih, w_hh;  // [rows][f], [rows][h]
  std::vector<int64_t> b_ih, b_hh;
  std::vector<Factor> ih, hh;
  Factor hf, cf, ctf;
  std::vector<int64_t> sig;
  int n_states = 0;
  PackedWeights packed_ih, packed_hh;  // the optimized paths' GEMM operands (W_ih, W_hh)
};

inline int64_t Rnd(int64_t v, int s) {
  const int64_t q = v >> s;  // arithmetic: floor
  const uint64_t mask = (uint64_t{1} << s) - 1;
  const uint64_t r = static_cast<uint64_t>(v) & mask;  // v - q·2^s, in [0, 2^s)
  const uint64_t half = uint64_t{1} << (s - 1);
  return q + ((r > half || (r == half && (q & 1) != 0)) ? 1 : 0);
}

// Newton's quadratic through T[i], T[i+1], T[i+2] at t = f / 2^13, over 2^27, rounded half up.
inline int64_t Sig(const std::vector<int64_t>& t, int64_t p) {
  const int64_t u = ClampI64(p, -(int64_t{1} << 24), (int64_t{1} << 24) - 1) + (int64_t{1} << 24);
  const int64_t i = u >> 13, f = u & 8191;
  const int64_t t0 = t[static_cast<size_t>(i)], t1 = t[static_cast<size_t>(i) + 1], t2 = t[static_cast<size_t>(i) + 2];
  const int64_t num = (t1 - t0) * f * (int64_t{1} << 14) + (t2 - 2 * t1 + t0) * f * (f - 8192);
  return t0 + ((num + (int64_t{1} << 26)) >> 27);
}
inline int64_t Tanh(const std::vector<int64_t>& t, int64_t p) {
  return 2 * Sig(t, ClampI64(p, -kPreLimit, kPreLimit) * 2) - kOne;
}

inline int64_t Pre(int64_t acc, const Factor& fa) { return ClampI64(Rnd(acc * fa.m, fa.s), -kPreLimit, kPreLimit); }

inline void StoreValue(uint8_t* b, int dtype, int64_t i, int64_t v) {
  if (dtype == kI32) {
    const int32_t w = static_cast<int32_t>(v);
    std::memcpy(b + 4 * i, &w, 4);
  } else {
    b[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
  }
}

Status ReadFactor(const GraphOp& op, int index, const char* name, Factor* f) {
  const std::string base(name);
  const int64_t m = op.attrs.at(base + "_mult").i, s = op.attrs.at(base + "_shift").i;
  OP_CHECK(m >= 0 && m < (int64_t{1} << 31) && s >= 1 && s <= 62, "factor '%s' (%lld, %lld) out of range", name,
           (long long)m, (long long)s);
  f->m = m;
  f->s = static_cast<int>(s);
  return Status::Ok();
}

Status ReadFactors(const GraphOp& op, int index, const char* name, int64_t n, std::vector<Factor>* out) {
  const std::string base(name);
  const auto& ms = op.attrs.at(base + "_mult").ints;
  const auto& ss = op.attrs.at(base + "_shift").ints;
  OP_CHECK(static_cast<int64_t>(ms.size()) == n && static_cast<int64_t>(ss.size()) == n,
           "'%s_mult'/'%s_shift' must have %lld values", name, name, (long long)n);
  out->resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    OP_CHECK(ms[r] >= 0 && ms[r] < (int64_t{1} << 31) && ss[r] >= 1 && ss[r] <= 62, "factor '%s'[%lld] out of range",
             name, (long long)r);
    (*out)[r].m = ms[r];
    (*out)[r].s = static_cast<int>(ss[r]);
  }
  return Status::Ok();
}

Status ReadTable(const GraphOp& op, int index, const char* name, std::vector<int64_t>* out) {
  const auto& t = op.attrs.at(name).ints;
  OP_CHECK(static_cast<int64_t>(t.size()) == kTableSize, "table '%s' must have %lld entries", name,
           (long long)kTableSize);
  for (int64_t v : t) OP_CHECK(v >= 0 && v <= kOne, "table '%s' value %lld outside [0, 2^24]", name, (long long)v);
  out->assign(t.begin(), t.end());
  return Status::Ok();
}

int64_t ReluAttr(const GraphOp& op) { return op.attrs.at("relu").i; }

Status PrepareRecurrent(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape, bool lstm, bool rnn = false) {
  const int gates = lstm ? 4 : (rnn ? 1 : 3);
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& w_ih = g->tensors[op.inputs[1]];
  const GraphTensor& w_hh = g->tensors[op.inputs[2]];
  const GraphTensor& b_ih = g->tensors[op.inputs[3]];
  const GraphTensor& b_hh = g->tensors[op.inputs[4]];
  const GraphTensor& y = g->tensors[op.outputs[0]];
  const GraphTensor& hn = g->tensors[op.outputs[1]];
  const auto& A = op.attrs;
  OP_CHECK(IsInt8(x.dtype) && (x.dims.size() == 2 || x.dims.size() == 3), "input must be I8/U8 [N, T, F] or [N, F]");
  OP_CHECK(w_ih.is_constant && w_hh.is_constant && w_ih.dtype == kI8 && w_hh.dtype == kI8 && w_ih.dims.size() == 2 &&
               w_hh.dims.size() == 2,
           "weights must be constant I8 matrices");
  auto p = std::make_shared<RecurrentParams>();
  p->lstm = lstm;
  p->rnn = rnn;
  if (rnn) {
    OP_CHECK(ReluAttr(op) == 0 || ReluAttr(op) == 1, "relu must be 0 or 1");
    p->relu = ReluAttr(op) == 1;
  }
  p->h = w_hh.dims[1];
  p->rows = w_hh.dims[0];
  p->f = x.dims.back();
  OP_CHECK(p->rows == gates * p->h, "w_hh must be [%d·H, H]", gates);
  OP_CHECK(w_ih.dims[0] == p->rows && w_ih.dims[1] == p->f, "w_ih must be [%lld, %lld]", (long long)p->rows,
           (long long)p->f);
  OP_CHECK(p->f <= kMaxFeatures && p->h <= kMaxFeatures, "F and H must be <= %lld", (long long)kMaxFeatures);
  for (const GraphTensor* b : {&b_ih, &b_hh}) {
    OP_CHECK(b->is_constant && b->dtype == kI32 && b->dims.size() == 1 && b->dims[0] == p->rows,
             "biases must be constant I32 [%lld]", (long long)p->rows);
    for (int32_t v : b->values) OP_CHECK(v >= -kBiasLimit && v <= kBiasLimit, "bias values must be within ±2^30");
  }
  p->w_ih.assign(w_ih.values.begin(), w_ih.values.end());
  p->w_hh.assign(w_hh.values.begin(), w_hh.values.end());
  p->b_ih.assign(b_ih.values.begin(), b_ih.values.end());
  p->b_hh.assign(b_hh.values.begin(), b_hh.values.end());
  {
    const std::vector<int16_t> wi(w_ih.values.begin(), w_ih.values.end()), wh(w_hh.values.begin(), w_hh.values.end());
    QDSL_RETURN_IF_ERROR(PackWeights(wi.data(), p->rows, p->f, p->f, &p->packed_ih));
    QDSL_RETURN_IF_ERROR(PackWeights(wh.data(), p->rows, p->h, p->h, &p->packed_hh));
  }
  OP_CHECK(A.at("reverse").i == 0 || A.at("reverse").i == 1, "reverse must be 0 or 1");
  p->reverse = A.at("reverse").i == 1;
  int64_t lo, hi;
  DTypeRange(x.dtype, &lo, &hi);
  p->x_zp = A.at("x_zp").i;
  OP_CHECK(p->x_zp >= lo && p->x_zp <= hi, "x_zp outside the input dtype");
  OP_CHECK(IsInt8(y.dtype) && hn.dtype == y.dtype, "y and h_n must be I8/U8 of one dtype");
  DTypeRange(y.dtype, &lo, &hi);
  p->h_zp = A.at("h_zp").i;
  p->h_qmin = A.at("h_qmin").i;
  p->h_qmax = A.at("h_qmax").i;
  OP_CHECK(p->h_zp >= lo && p->h_zp <= hi && p->h_qmin >= lo && p->h_qmax <= hi && p->h_qmin <= p->h_qmax,
           "h_zp/h_qmin/h_qmax outside the output dtype");
  const std::vector<int64_t> state_dims = {x.dims[0], p->h};
  OP_CHECK(hn.dims == state_dims, "h_n must be [N, H]");
  QDSL_RETURN_IF_ERROR(ReadFactors(op, index, "ih", p->rows, &p->ih));
  QDSL_RETURN_IF_ERROR(ReadFactors(op, index, "hh", p->rows, &p->hh));
  QDSL_RETURN_IF_ERROR(ReadFactor(op, index, "h", &p->hf));
  QDSL_RETURN_IF_ERROR(ReadTable(op, index, "sigmoid", &p->sig));
  if (lstm) {
    const GraphTensor& cn = g->tensors[op.outputs[2]];
    OP_CHECK((IsInt8(cn.dtype) || cn.dtype == kI32) && cn.dims == state_dims, "c_n must be I8/U8/I32 [N, H]");
    QDSL_RETURN_IF_ERROR(ReadFactor(op, index, "c", &p->cf));
    QDSL_RETURN_IF_ERROR(ReadFactor(op, index, "ct", &p->ctf));
    p->c_zp = A.at("c_zp").i;
    p->c_qmin = A.at("c_qmin").i;
    p->c_qmax = A.at("c_qmax").i;
    DTypeRange(cn.dtype, &lo, &hi);
    const int64_t lim = int64_t{1} << 16;
    OP_CHECK(p->c_zp >= -lim && p->c_zp <= lim && p->c_qmin >= std::max(lo, -lim) && p->c_qmax <= std::min(hi, lim) &&
                 p->c_qmin <= p->c_qmax,
             "c_zp/c_qmin/c_qmax outside the cell dtype or ±2^16");
  }
  p->n_states = static_cast<int>(op.inputs.size()) - 5;
  for (int k = 0; k < p->n_states; ++k) {
    const GraphTensor& s = g->tensors[op.inputs[5 + k]];
    // N static when sliced from a module's (layers·directions, N, H) state input (SELECT)
    OP_CHECK(!s.is_constant && s.dims.size() == 2 && s.dims[1] == p->h &&
                 (s.dims[0] == x.dims[0] || s.dims[0] == -1 || x.dims[0] == -1),
             "initial state '%s' must be an activation [N, H]", s.name.c_str());
    OP_CHECK(k == 0 ? s.dtype == y.dtype : (IsInt8(s.dtype) || s.dtype == kI32), "initial state '%s' has the wrong dtype",
             s.name.c_str());
  }
  shape->back() = p->h;
  op.prepared = std::move(p);
  return Status::Ok();
}

// The gates of one sample and step from its Q20 pre-activation terms (RunSample's loop body).
inline void Gates(const RecurrentParams& p, const int64_t* pih, const int64_t* phh, int64_t* h, int64_t* c,
                  int64_t* hnew) {
  const int64_t H = p.h;
  if (p.rnn) {
    for (int64_t j = 0; j < H; ++j) {
      const int64_t v = p.relu ? ClampI64(pih[j] + phh[j], 0, kReluLimit) : Tanh(p.sig, pih[j] + phh[j]);
      hnew[j] = ClampI64(Rnd(v * p.hf.m, p.hf.s) + p.h_zp, p.h_qmin, p.h_qmax);
    }
  } else if (p.lstm) {
    for (int64_t j = 0; j < H; ++j) {
      const int64_t si = Sig(p.sig, pih[j] + phh[j]);
      const int64_t sf = Sig(p.sig, pih[H + j] + phh[H + j]);
      const int64_t tg = Tanh(p.sig, pih[2 * H + j] + phh[2 * H + j]);
      const int64_t so = Sig(p.sig, pih[3 * H + j] + phh[3 * H + j]);
      const int64_t u = sf * (c[j] - p.c_zp) + Rnd(Rnd(si * tg, 24) * p.cf.m, p.cf.s);
      c[j] = ClampI64(Rnd(u, 24) + p.c_zp, p.c_qmin, p.c_qmax);
      const int64_t tc = Tanh(p.sig, Rnd((c[j] - p.c_zp) * p.ctf.m, p.ctf.s));
      hnew[j] = ClampI64(Rnd(Rnd(so * tc, 24) * p.hf.m, p.hf.s) + p.h_zp, p.h_qmin, p.h_qmax);
    }
  } else {
    for (int64_t j = 0; j < H; ++j) {
      const int64_t r = Sig(p.sig, pih[j] + phh[j]);
      const int64_t z = Sig(p.sig, pih[H + j] + phh[H + j]);
      const int64_t n = Tanh(p.sig, pih[2 * H + j] + Rnd(r * phh[2 * H + j], 24));
      const int64_t u = Rnd(Rnd((kOne - z) * n, 24) * p.hf.m, p.hf.s) + z * (h[j] - p.h_zp);
      hnew[j] = ClampI64(Rnd(u, 24) + p.h_zp, p.h_qmin, p.h_qmax);
    }
  }
}

// One sample: steps over time, writing y rows and the final states.
void RunSample(const RecurrentParams& p, const uint8_t* x, int x_dtype, int64_t steps, int64_t* h, int64_t* c,
               uint8_t* y, int y_dtype, int64_t y_base) {
  const int64_t H = p.h, F = p.f;
  std::vector<int64_t> pih(static_cast<size_t>(p.rows)), phh(static_cast<size_t>(p.rows)), hnew(static_cast<size_t>(H));
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t t = p.reverse ? steps - 1 - k : k;
    for (int64_t r = 0; r < p.rows; ++r) {
      int64_t a = p.b_ih[r];
      const int32_t* w = p.w_ih.data() + r * F;
      for (int64_t i = 0; i < F; ++i) a += (static_cast<int64_t>(LoadValue(x, x_dtype, t * F + i)) - p.x_zp) * w[i];
      pih[r] = Pre(a, p.ih[r]);
      int64_t b = p.b_hh[r];
      const int32_t* u = p.w_hh.data() + r * H;
      for (int64_t i = 0; i < H; ++i) b += (h[i] - p.h_zp) * u[i];
      phh[r] = Pre(b, p.hh[r]);
    }
    Gates(p, pih.data(), phh.data(), h, c, hnew.data());
    for (int64_t j = 0; j < H; ++j) {
      h[j] = hnew[j];
      StoreValue(y, y_dtype, y_base + t * H + j, h[j]);
    }
  }
}

// The optimized paths: the input products of every sample and step as one GEMM before the
// time loop, then per step one GEMM of the batch's hidden codes (int32 accumulators: exact,
// F, H <= 16384 keep |A| + |b| below 2^31), Pre and the gates as RunSample.  The GEMMs are
// the front door's (qdsl/gemm.h), so each path runs its own kernels.
Status RunRecurrentFast(RunCtx& c, const GraphOp& op) {
  const RecurrentParams& p = ParamsOf<RecurrentParams>(op);
  const uint32_t xi = op.inputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = xs[0], steps = xs.size() == 3 ? xs[1] : 1, H = p.h, R = p.rows;
  const int x_dtype = c.DType(xi);
  const uint32_t yi = op.outputs[0];
  const int y_dtype = c.DType(yi);
  QDSL_CHECK_ARG(p.n_states == 0 || c.Shape(op.inputs[5])[0] == n, "initial state batch differs from the input's");
  if (n == 0) return Status::Ok();
  std::vector<int32_t> acc_ih(static_cast<size_t>(n * steps * R)), acc_hh(static_cast<size_t>(n * R));
  ActView av;
  av.data = c.Buf(xi);
  av.dtype = x_dtype == kI8 ? DType::kInt8 : DType::kUInt8;
  av.rows = n * steps;
  av.cols = av.ld = p.f;
  av.zero_point = static_cast<int32_t>(p.x_zp);
  GemmOutput o;
  o.data = acc_ih.data();
  o.dtype = DType::kInt32;
  o.ld = R;
  const std::vector<int32_t> b_ih(p.b_ih.begin(), p.b_ih.end()), b_hh(p.b_hh.begin(), p.b_hh.end());
  QDSL_RETURN_IF_ERROR(Gemm(av, p.packed_ih, b_ih.data(), o, c.path));
  // the state: codes as the hidden GEMM reads them (y's 8-bit container) and int64 for the gates
  std::vector<uint8_t> hq(static_cast<size_t>(n * H));
  std::vector<int64_t> h(static_cast<size_t>(n * H)), cs(static_cast<size_t>(n * H)), hnew(static_cast<size_t>(H));
  const uint8_t* h0 = p.n_states > 0 ? c.Buf(op.inputs[5]) : nullptr;
  const uint8_t* c0 = p.n_states > 1 ? c.Buf(op.inputs[6]) : nullptr;
  const int h0_dtype = p.n_states > 0 ? c.DType(op.inputs[5]) : kI8;
  const int c0_dtype = p.n_states > 1 ? c.DType(op.inputs[6]) : kI8;
  for (int64_t i = 0; i < n * H; ++i) {
    h[i] = h0 != nullptr ? LoadValue(h0, h0_dtype, i) : p.h_zp;
    cs[i] = c0 != nullptr ? LoadValue(c0, c0_dtype, i) : p.c_zp;
    hq[i] = static_cast<uint8_t>(static_cast<int8_t>(h[i]));
  }
  ActView hv;
  hv.data = hq.data();
  hv.dtype = y_dtype == kI8 ? DType::kInt8 : DType::kUInt8;
  hv.rows = n;
  hv.cols = hv.ld = H;
  hv.zero_point = static_cast<int32_t>(p.h_zp);
  GemmOutput oh;
  oh.data = acc_hh.data();
  oh.dtype = DType::kInt32;
  oh.ld = R;
  std::vector<int64_t> pih(static_cast<size_t>(R)), phh(static_cast<size_t>(R));
  uint8_t* y = c.Buf(yi);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t t = p.reverse ? steps - 1 - k : k;
    QDSL_RETURN_IF_ERROR(Gemm(hv, p.packed_hh, b_hh.data(), oh, c.path));
    for (int64_t s = 0; s < n; ++s) {
      const int32_t* ai = acc_ih.data() + (s * steps + t) * R;
      const int32_t* ah = acc_hh.data() + s * R;
      for (int64_t r = 0; r < R; ++r) {
        pih[r] = Pre(ai[r], p.ih[r]);
        phh[r] = Pre(ah[r], p.hh[r]);
      }
      int64_t* hs = h.data() + s * H;
      Gates(p, pih.data(), phh.data(), hs, cs.data() + s * H, hnew.data());
      for (int64_t j = 0; j < H; ++j) {
        hs[j] = hnew[j];
        hq[s * H + j] = static_cast<uint8_t>(static_cast<int8_t>(hnew[j]));
        StoreValue(y, y_dtype, (s * steps + t) * H + j, hnew[j]);
      }
    }
  }
  uint8_t* hn = c.Buf(op.outputs[1]);
  uint8_t* cn = p.lstm ? c.Buf(op.outputs[2]) : nullptr;
  const int c_dtype = p.lstm ? c.DType(op.outputs[2]) : kI32;
  for (int64_t i = 0; i < n * H; ++i) {
    StoreValue(hn, y_dtype, i, h[i]);
    if (cn != nullptr) StoreValue(cn, c_dtype, i, cs[i]);
  }
  return Status::Ok();
}

Status RunRecurrent(RunCtx& c, const GraphOp& op) {
  if (c.path != kPathRef) return RunRecurrentFast(c, op);
  const RecurrentParams& p = ParamsOf<RecurrentParams>(op);
  const uint32_t xi = op.inputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = xs[0], steps = xs.size() == 3 ? xs[1] : 1, H = p.h;
  const uint8_t* x = c.Buf(xi);
  const int x_dtype = c.DType(xi);
  const uint32_t yi = op.outputs[0], hi = op.outputs[1];
  const int y_dtype = c.DType(yi);
  uint8_t* y = c.Buf(yi);
  uint8_t* hn = c.Buf(hi);
  uint8_t* cn = p.lstm ? c.Buf(op.outputs[2]) : nullptr;
  const int c_dtype = p.lstm ? c.DType(op.outputs[2]) : kI32;
  const uint8_t* h0 = p.n_states > 0 ? c.Buf(op.inputs[5]) : nullptr;
  const uint8_t* c0 = p.n_states > 1 ? c.Buf(op.inputs[6]) : nullptr;
  const int h0_dtype = p.n_states > 0 ? c.DType(op.inputs[5]) : kI8;
  const int c0_dtype = p.n_states > 1 ? c.DType(op.inputs[6]) : kI8;
  QDSL_CHECK_ARG(p.n_states == 0 || c.Shape(op.inputs[5])[0] == n, "initial state batch differs from the input's");
  const int64_t work = n * steps * p.rows * (p.f + H);
  ParallelRanges(n, /*chunk=*/1, work, [&](int64_t s0, int64_t s1) {
    std::vector<int64_t> h(static_cast<size_t>(H)), cs(static_cast<size_t>(H));
    for (int64_t s = s0; s < s1; ++s) {
      for (int64_t j = 0; j < H; ++j) {
        h[j] = h0 != nullptr ? LoadValue(h0, h0_dtype, s * H + j) : p.h_zp;
        cs[j] = c0 != nullptr ? LoadValue(c0, c0_dtype, s * H + j) : p.c_zp;
      }
      RunSample(p, x + s * steps * p.f * (x_dtype == kI32 ? 4 : 1), x_dtype, steps, h.data(), cs.data(), y, y_dtype,
                s * steps * H);
      for (int64_t j = 0; j < H; ++j) {
        StoreValue(hn, y_dtype, s * H + j, h[j]);
        if (cn != nullptr) StoreValue(cn, c_dtype, s * H + j, cs[j]);
      }
    }
  });
  return Status::Ok();
}

Status PrepareLstm(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  return PrepareRecurrent(g, op, index, shape, true);
}
Status PrepareGru(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  return PrepareRecurrent(g, op, index, shape, false);
}
Status PrepareRnn(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  return PrepareRecurrent(g, op, index, shape, false, true);
}

}  // namespace

// The op table's entries (op_schema.h names them by opcode); the outputs' range is the dtype's.
const OpDef kLstmDef = {PrepareLstm, RunRecurrent, ValueRange::kStage};
const OpDef kGruDef = {PrepareGru, RunRecurrent, ValueRange::kStage};
const OpDef kRnnDef = {PrepareRnn, RunRecurrent, ValueRange::kStage};

}  // namespace qdsl
